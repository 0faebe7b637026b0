"""tools/fuzz_gpu.py's draws, on the CPU: the same case for the same seed, every family, and the
bounds that keep the float64 reference affordable and the shapes ones the wrappers take."""
from __future__ import annotations

import numpy as np

import tool_module

fuzz = tool_module.load("fuzz_gpu")


def test_draws_are_reproducible_and_cover_every_family():
    cases = [fuzz.draw(s) for s in range(200)]
    assert {c["family"] for c in cases} == set(fuzz.FAMILIES)
    assert fuzz.describe(fuzz.draw(17)) == fuzz.describe(cases[17])
    assert len({fuzz.describe(c) for c in cases}) == len(cases)


def test_draws_stay_within_what_the_wrappers_and_reference_take():
    for seed in range(300):
        c = fuzz.draw(seed)
        H, Hk = c["heads"]
        assert H % Hk == 0 and H <= 64 and c["head_dim"] in (64, 128, 256) and c["page"] <= 128
        if c["family"] == "cascade":
            assert 1 <= c["prefix"] <= 8192 and c["batch"] >= 1
            continue
        kv, qo = c["kv"], c["qo"]
        assert kv.sum() <= fuzz.KV_TOKENS and (kv >= 1).all() and (qo >= 1).all() and (qo <= kv).all()
        if c["family"] == "decode":
            assert (qo == 1).all()
        if c["family"] == "decode-mtd":
            assert c["variant"] == "causal" and qo.max() <= 16
        if c["family"].startswith("prefill"):
            assert (qo * kv).sum() * H * c["head_dim"] <= 2e10 or (qo == 1).all()
        if c["family"] == "prefill-ragged":
            assert c["page"] == 1 and c["layout"] == "NHD"
    assert np.mean([fuzz.draw(s)["layout"] == "HND" for s in range(300)]) > 0.05
