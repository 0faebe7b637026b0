"""tools/model_l2.py on the CPU: the L2 model of the persistent prefill kernel reproduces what it
was built to show (docs/perf-log.md "prefill queue order"): at head group 1 LPT's queues re-read
the KV from HBM several times over, the request order and a non-persistent grid read it once."""
from __future__ import annotations

import numpy as np

import tool_module

model = tool_module.load("model_l2")


def test_lru_counts_misses():
    assert model.lru_misses(np.array([1, 2, 3, 1, 4, 1, 2]), 2) == 6
    assert model.lru_misses(np.array([1, 2, 1, 2, 1]), 2) == 2


def test_group_1_rereads_and_the_request_order_does_not():
    g1 = model.model("16x1024", "32:32:128:16", ["lpt", "request", "grid"], [50.0])
    g4 = model.model("16x1024", "32:8:128:16", ["lpt"], [50.0])
    lpt, req, grid = (g1["orders"][o][50.0] for o in ("lpt", "request", "grid"))
    assert g1["ideal_mb"] == 16 * 32 * 1024 * 128 * 4 / 1e6   # K + V bf16, every (request, head) once
    assert lpt > 3 * g1["ideal_mb"] and lpt > 3 * g4["orders"]["lpt"][50.0]
    assert req <= 1.1 * g1["ideal_mb"] and grid <= 1.01 * g1["ideal_mb"]
    assert g1["orders"]["request"]["taken"] == "request" and g1["orders"]["request"]["vs_lpt"] <= 1.02
    assert g1["work"] > g4["work"]   # 128-token tiles waste more of the causal diagonal than 32-token ones


def test_main_prints_a_line_per_shape_and_row(capsys):
    model.main(["--rows", "32x512", "--shapes", "32:8:128:16", "--orders", "lpt", "request", "--l2-mb", "50"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("32:8:128:16") and "request" in out[1]
