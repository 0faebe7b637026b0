"""tools/bench_prefill.py on the CPU: the attended-pair counts its TFLOP/s divide by, its tile and
shape options (the timed runs need a GPU and FlashInfer)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_tools = Path(__file__).parent.parent / "tools"
sys.path.insert(0, str(_tools))
_spec = importlib.util.spec_from_file_location("bench_prefill", _tools / "bench_prefill.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_prefill"] = bench   # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_attended_pairs_match_a_dense_mask():
    qo, kv = np.array([5, 3, 1200]), np.array([9, 3, 2000])
    for variant in ("causal", "plain", "window"):
        want = 0
        for lq, lk in zip(qo, kv):
            i = np.arange(lk - lq, lk)[:, None]
            j = np.arange(lk)[None, :]
            keep = np.ones((lq, lk), bool) if variant == "plain" else j <= i
            if variant == "window":
                keep &= j >= i - bench.WINDOW
            want += int(keep.sum())
        assert bench.attended_pairs(qo, kv, variant) == want


def test_tile_tags_and_shapes():
    assert bench.parse_tile("q64_kv32_w4_s3_b3") == {"rows": 64, "tile_kv": 32, "num_warps": 4, "stages": 3,
                                                     "ctas_per_sm": 3}
    assert bench.parse_tile("sync") == {"mma": "sync"}   # the kernel choice: A/B against the family's
    assert bench.parse_tile("wg_q128_kv64_s4") == {"mma": "wgmma", "rows": 128, "tile_kv": 64, "stages": 4}
    assert bench.parse_tile("x") == {"cross": True}   # the policy's tile, KV stream across items
    assert bench.parse_tile("wg_q64_kv64_w4_s3_x_b2") == {"mma": "wgmma", "rows": 64, "tile_kv": 64, "num_warps": 4,
                                                          "stages": 3, "cross": True, "ctas_per_sm": 2}
    shape = (bench.HQ, bench.HKV, bench.D, bench.PAGE)
    try:
        bench.set_shape("32:4", 64, 64)
        assert (bench.HQ, bench.HKV, bench.D, bench.PAGE) == (32, 4, 64, 64)
        assert bench.rt_spec("alibi").head_dim == 64   # rtattn's spec follows --head-dim
        with pytest.raises(SystemExit, match="bad shape"):
            bench.set_shape("30:4", 128, 16)
        with pytest.raises(SystemExit, match="bad shape"):
            bench.set_shape("32:8", 96, 16)
    finally:
        bench.set_shape(f"{shape[0]}:{shape[1]}", shape[2], shape[3])
    names = [r.name for r in bench._rows()]
    assert len(names) == len(set(names)) and "1x16384-plain" in names and "8x2048" in names
