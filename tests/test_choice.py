"""The family choice (rtattn.families.choice): the cost rule reproduces the H200 figures its
constants come from, picks by the KV reads each family's tiles need, can be forced and
overridden; and rtattn.multi_token_wrapper builds the chosen family's wrapper (fake GPU)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rtattn.families import choice as C
from rtattn.plan.layout import indptr_from_lengths, paged_kv

import fakes

# (family, H_qo, H_kv, q_len, kv_len, batch, measured us): docs/perf-log.md v6 (decode) and v7
# (prefill's multi-token rows), H200, head_dim 128
MEASURED = [("decode", 32, 8, 1, 4096, 64, 244.5), ("decode", 32, 8, 1, 4096, 256, 962.4),
            ("decode", 32, 8, 1, 1024, 16, 22.2), ("decode", 32, 2, 1, 2048, 64, 38.4),
            ("decode", 32, 1, 1, 2048, 64, 26.9), ("decode", 32, 8, 1, 32768, 1, 39.8),
            ("prefill", 32, 8, 4, 4096, 64, 248.0), ("prefill", 32, 8, 1, 4096, 64, 245.0)]


@pytest.mark.parametrize("family, hq, hk, q, kv, batch, us", MEASURED)
def test_the_rule_reproduces_the_figures_it_was_fit_to(family, hq, hk, q, kv, batch, us):
    t, _ = C.estimate_us(family, hq, hk, 128, q, kv, batch)
    assert abs(t / us - 1) < 0.08, (t, us)


def test_target_row_q4_at_64x4096_is_within_10_percent_of_one_token_decode():
    one = C.estimate_us("decode", 32, 8, 128, 1, 4096, 64)[0]
    c = C.choose_family(32, 8, 128, 4, 4096, 64)
    assert c.estimates_us[c.family] <= 1.10 * one


@pytest.mark.parametrize("hq, hk, q", [(32, 8, 1), (32, 8, 2), (32, 8, 4), (32, 4, 2), (32, 2, 1), (64, 8, 2)])
def test_rows_one_decode_tile_holds_in_16_rows_stay_on_decode(hq, hk, q):
    """Same KV reads, the same measured rate within noise: a tie, decode's."""
    c = C.choose_family(hq, hk, 128, q, 4096, 64)
    assert c.family == "decode" and c.rows["decode"] == 16, c


@pytest.mark.parametrize("hq, hk, q", [(32, 8, 16), (32, 4, 16), (32, 2, 4), (32, 1, 2), (32, 4, 8)])
def test_rows_beyond_32_go_to_prefill_whose_tile_reads_the_kv_once(hq, hk, q):
    c = C.choose_family(hq, hk, 128, q, 4096, 64)
    g = hq // hk
    assert q * g > 32 and c.family == "prefill", c
    assert c.rows["prefill"] >= q * g and c.estimates_us["prefill"] < c.estimates_us["decode"]


@pytest.mark.parametrize("hq, hk, q", [(32, 1, 1), (32, 2, 2), (32, 4, 4), (32, 8, 8)])
def test_32_rows_two_decode_mma_tiles_are_compute_bound_at_the_measured_rate(hq, hk, q):
    """One read either way, but two decode MMA tiles per KV block ran at 108 TFLOP/s (g32 row):
    the rule predicts prefill's 32-row tile faster (bench_decode's g32 row with +prefill checks)."""
    c = C.choose_family(hq, hk, 128, q, 4096, 64)
    assert c.rows == {"decode": 32, "prefill": 32} and c.family == "prefill", c


def test_head_dim_256_decode_tiles_stay_16_rows():
    c = C.choose_family(32, 2, 256, 2, 4096, 64)   # 32 rows: two decode reads at d256
    assert c.rows["decode"] == 16 and c.family == "prefill"


def test_forced_overridden_and_fp8():
    assert C.choose_family(32, 8, 128, 16, 4096, 64, family="decode").family == "decode"
    assert C.choose_family(32, 8, 128, 1, 4096, 64, family="prefill").reason.startswith("forced")
    slow = dict(C.COSTS, prefill=dataclasses.replace(C.COSTS["prefill"], hbm_tbps=1.0))
    assert C.choose_family(32, 8, 128, 16, 4096, 64, costs=slow).family == "decode"
    assert C.choose_family(32, 8, 128, 16, 4096, 64, kv_bytes=1).family == "decode"   # fp8: decode's only
    assert "prefill" in str(C.choose_family(32, 8, 128, 16, 4096, 64))


@pytest.mark.parametrize("kw, match", [(dict(family="tc"), "family must be"), (dict(qo_len=0), "qo_len"),
                                       (dict(qo_len=2.5), "qo_len")])
def test_bad_arguments_are_refused(kw, match):
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, qo_len=4, kv_len=4096, batch=64)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        C.choose_family(**args)
    with pytest.raises(ValueError, match="family must be"):
        C.estimate_us("tc", 32, 8, 128, 4, 4096)


@pytest.fixture
def fake_gpu(monkeypatch):
    import rtattn.family_wrapper as FW
    made = fakes.install_prefill(monkeypatch)
    fakes.install(monkeypatch, fakes.FakeKernels)
    monkeypatch.setattr(FW, "current_device", lambda d=None: fakes.fake_device())
    return made


@pytest.mark.parametrize("q, want", [(4, "decode"), (16, "prefill")])
def test_multi_token_wrapper_builds_the_chosen_family(fake_gpu, q, want):
    import rtattn
    from rtattn.runtime import export
    w = rtattn.multi_token_wrapper(32, 8, 128, 16, max_batch=8, max_pages=64, max_qo_len=q, avg_kv_len=100)
    assert w.family_choice.family == want
    assert isinstance(w, rtattn.BatchDecodeWrapper if want == "decode" else rtattn.BatchPrefillWrapper)
    if want == "decode":   # the decode tile holds the request's q x g rows: one KV read per request
        assert w.spec.rows == 16 and w.planner.tile_q == 4 and w.spec.causal
    ip, idx, last = paged_kv([100, 60], 16)
    w.plan(qo_indptr=indptr_from_lengths([q, q]), kv_indptr=ip, kv_indices=idx, kv_last_page_len=last)
    n = 2 * q
    w.run(export(1 << 30, (n, 32, 128), "bfloat16"), export(1 << 32, (64, 16, 8, 128), "bfloat16"),
          export(1 << 33, (64, 16, 8, 128), "bfloat16"), out=export(1 << 34, (n, 32, 128), "bfloat16"))
    with pytest.raises(ValueError, match="max_qo_len"):
        w.plan(qo_indptr=indptr_from_lengths([q + 1]), kv_indptr=ip[:2], kv_indices=idx, kv_last_page_len=last[:1])


def test_multi_token_wrapper_decode_tile_of_32_rows_and_forcing(fake_gpu):
    import rtattn
    w = rtattn.multi_token_wrapper(32, 8, 128, 16, max_batch=8, max_pages=64, max_qo_len=8, family="decode")
    assert w.family_choice.family == "decode" and w.spec.m_tiles == 2 and w.planner.tile_q == 8
    w = rtattn.multi_token_wrapper(32, 8, 128, 16, max_batch=8, max_pages=64, max_qo_len=2, family="prefill",
                                   variant="plain")
    assert isinstance(w, rtattn.BatchPrefillWrapper) and w.tile.rows == 16 and not w.spec.causal
    assert np.isfinite(list(w.family_choice.estimates_us.values())).all()


@pytest.mark.parametrize("heads, q", [((32, 8), 16), ((32, 2), 2), ((32, 1), 1)])
def test_both_families_plans_execute_to_the_reference(fake_gpu, heads, q):
    """The plan each family's wrapper makes for a causal verification batch (decode: 32-row
    tiles, split into two at q16 g4) gives the reference's attention in float64."""
    import rtattn
    from rtattn.plan import reference as ref
    from rtattn.plan.executor import execute_plan
    from rtattn.plan.verify import verify_plan
    hq, hk = heads
    rng = np.random.default_rng(q)
    kv = np.maximum(rng.integers(1, 300, 4), q)
    kv[0] = 700
    ip, _, last = paged_kv(kv, 16)
    pool = int(ip[-1]) + 8
    idx = rng.permutation(pool)[: int(ip[-1])].astype(np.int32)
    qi = indptr_from_lengths([q] * len(kv))
    qq = rng.standard_normal((int(qi[-1]), hq, 64))
    k, v = rng.standard_normal((2, pool, 16, hk, 64))
    want, _ = ref.reference_attention(qq, k, v, qi, ip, idx, last, 16, ref.Variant(causal=True))
    for family in ("decode", "prefill"):
        w = rtattn.multi_token_wrapper(hq, hk, 64, 16, max_batch=4, max_pages=pool, max_qo_len=q, family=family)
        info = w.plan(qo_indptr=qi, kv_indptr=ip, kv_indices=idx, kv_last_page_len=last)
        verify_plan(info.views, np.diff(qi), kv, tile_q=w.planner.tile_q, page_size=16, causal=True)
        got = execute_plan(info.views, qq, k, v, ref.Variant(causal=True))
        got = got[0] if isinstance(got, tuple) else got
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12, family


# ----------------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
@pytest.mark.parametrize("heads, q", [((32, 8), 2), ((32, 8), 4), ((32, 8), 8), ((32, 8), 16), ((32, 2), 1),
                                      ((32, 2), 2), ((32, 1), 1)])
def test_both_families_give_the_reference_on_multi_token_batches(heads, q):
    """multi_token_wrapper forced onto each family: causal verification batches (skewed KV,
    scattered pages, outputs poisoned) match the float64 reference, O and LSE, and the choice's
    family is one of the two checked."""
    import torch
    import rtattn
    from decode_cases import lse_error, rel_error
    from rtattn.plan import reference as ref
    hq, hk = heads
    D, ps, pool = 128, 16, 1024
    rng = np.random.default_rng(q * 100 + hk)
    kv = np.maximum(rng.integers(1, 2000, 6), q)
    kv[0] = 3000   # one long request (split KV)
    ip, _, last = paged_kv(kv, ps)
    idx = rng.permutation(pool)[: int(ip[-1])].astype(np.int32)
    qi = indptr_from_lengths([q] * len(kv))
    T = int(qi[-1])
    gen = torch.Generator(device="cuda").manual_seed(int(q * 10 + hk))
    k = torch.randn(pool, ps, hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(pool, ps, hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    qt = torch.randn(T, hq, D, generator=gen, device="cuda").to(torch.bfloat16)
    f64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
    want_o, want_lse = ref.reference_attention(f64(qt), f64(k), f64(v), qi, ip, idx, last, ps, ref.Variant(causal=True))
    for family in ("decode", "prefill"):
        w = rtattn.multi_token_wrapper(hq, hk, D, ps, max_batch=len(kv), max_pages=pool, max_qo_len=q,
                                       avg_kv_len=float(kv.mean()), family=family)
        w.plan(qo_indptr=qi, kv_indptr=ip, kv_indices=idx, kv_last_page_len=last)
        out = torch.full((T, hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, hq), float("nan"), dtype=torch.float32, device="cuda")
        w.run(qt, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        assert rel_error(out.float().cpu().numpy(), want_o) < 2e-2, family
        assert lse_error(lse.cpu().numpy(), want_lse) < 2e-2, family


def test_the_cascade_flat_rule_weighs_l2_rereads_against_per_query_levels():
    """choice.flat_saving_us (the cascade's flat-or-levels rule): positive (flat faster) for short
    prefixes, negative for long ones; it grows with the heads' columns (the levels' per-query
    states) and falls with the KV bytes of the prefix's further reads."""
    from rtattn.families.choice import flat_saving_us
    assert flat_saving_us(32, 8, 128, 16, 1024, 8) > 0 > flat_saving_us(32, 8, 128, 16, 8192, 8)
    assert flat_saving_us(32, 8, 128, 16, 2048, 8) < 0    # (measured: no 2K row; the model's crossing ~1.2K)
    assert flat_saving_us(32, 2, 128, 16, 2048, 8) > flat_saving_us(32, 8, 128, 16, 2048, 8)
    assert flat_saving_us(32, 8, 128, 16, 1024, 16) < flat_saving_us(32, 8, 128, 16, 1024, 8)
    assert flat_saving_us(32, 8, 128, 16, 0, 8) == pytest.approx(0.4 * 16)   # no prefix bytes: the levels' cost only
