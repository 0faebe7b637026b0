"""tools/bench_prefill.py on the CPU: the attended-pair counts its TFLOP/s divide by, its tile and
shape options (the timed runs need a GPU and FlashInfer)."""
from __future__ import annotations

import numpy as np
import pytest

import tool_module

bench = tool_module.load("bench_prefill")


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
    assert bench.parse_tile("wg_q128_kv64_s3_pp_fe") == {"mma": "wgmma", "rows": 128, "tile_kv": 64, "stages": 3,
                                                         "pingpong": True, "fma_exp2": True}
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


def test_shapes_name_the_neighbourhood_and_bad_ones_are_refused(monkeypatch, capsys):
    assert bench.parse_shapes(["32:8:64:16", "32:32:128:1"]) == [("32:8", 64, 16), ("32:32", 128, 1)]
    for bad in ("32:8:64", "32:8:x:16", "nbhd2"):
        with pytest.raises(SystemExit, match="HQ:HKV:D:PAGE"):
            bench.parse_shapes([bad])
    # the named neighbourhood: groups 7, 5, 8 (64 heads), 2 (d256), MHA on 128-token pages, d64 on 2-token pages
    nb = bench.parse_shapes(["nbhd"])
    assert nb == [("28:4", 128, 16), ("40:8", 128, 16), ("64:8", 128, 16), ("16:8", 256, 16), ("32:32", 128, 128),
                  ("32:8", 64, 2)]
    assert bench.parse_shapes(["32:8:64:16", "nbhd"]) == [("32:8", 64, 16)] + nb
    from rtattn.families import prefill as family
    built = []
    monkeypatch.setattr(family, "compile_prefill", lambda spec, tile, arch, quiet=None: built.append(
        (spec.head_dim, tile.tag)))
    shape = (bench.HQ, bench.HKV, bench.D, bench.PAGE)
    try:   # each shape prebuilt in turn; a tag one shape refuses is skipped there, naming the shape
        assert bench.main(["--prebuild", "sm_90", "--rows", "16x1024", "--shapes", "32:8:64:16", "32:8:256:16",
                           "--rt-tiles", "default", "wg_q128_kv64_s3_pp_b2"]) == 0
        with pytest.raises(SystemExit, match="bad shape"):
            bench.main(["--prebuild", "sm_90", "--rows", "16x1024", "--shapes", "32:8:64:16", "32:8:96:16"])
    finally:
        bench.set_shape(f"{shape[0]}:{shape[1]}", shape[2], shape[3])
    assert built == [(64, "ws_q128_kv128_w8_s3_b1"), (64, "wg_q128_kv64_w8_s3_pp_b2"), (256, "wg_q128_kv32_w8_s3_pp_b1")]
    assert "32/8 d256 p16 wg_q128_kv64_s3_pp_b2: skipped" in capsys.readouterr().out
    built.clear()
    try:   # every neighbourhood shape has a tile for its rows (the policy refuses none of them)
        assert bench.main(["--prebuild", "sm_90", "--rows", "16x1024", "chunk16x4096+512", "--shapes", "nbhd"]) == 0
    finally:
        bench.set_shape(f"{shape[0]}:{shape[1]}", shape[2], shape[3])
    assert {d for d, _ in built} == {64, 128, 256} and "skipped" not in capsys.readouterr().out


def test_variant_rows_run_after_their_causal_twin_and_globs_select_them():
    names = [r.name for r in bench._rows()]
    for size in ("8x2048", "2x8192", "1x16384"):
        i = names.index(size)
        assert names[i + 1:i + 5] == [f"{size}-{v}" for v in bench.VARIANTS]
    assert "32x512-window" not in names   # a 1024 window covers the whole 512-token request
    windows = [r.name for r in bench.select_rows(["*-window"])]
    assert windows == ["8x2048-window", "2x8192-window", "1x16384-window"]
    assert all(r.variant == "window" for r in bench.select_rows(["*-window"]))
    assert [r.name for r in bench.select_rows(["1x16384", "8x2048*"])][:2] == ["8x2048", "8x2048-softcap"]
    with pytest.raises(SystemExit, match="matches no row"):
        bench.select_rows(["8x2048-nope"])


def test_variant_costs_read_each_variant_against_its_causal_twin():
    assert bench.causal_twin("8x2048-alibi") == "8x2048"
    assert bench.causal_twin("mtd64x4096-q4") is None and bench.causal_twin("16xU512-1024") is None
    ok = lambda t: {"ok": True, "tflops": t}  # noqa: E731
    results = {"8x2048": {"rt": ok(200.0)}, "8x2048-alibi": {"rt": ok(190.0)},
               "8x2048-window": {"rt": {"ok": False}}, "2x8192-softcap": {"rt": ok(100.0)}}
    assert bench.variant_costs(results) == [("8x2048-alibi", 0.95)]


def test_prebuild_compiles_what_the_wrapper_would_load(monkeypatch, capsys):
    """--prebuild (no GPU) builds each row's instance per tile, the tile the wrapper's policy picks
    with the tag's overrides: 8x2048 on the warp-specialized kernel by default (its KV bound is past
    WS_MIN_KV),
    the pingpong and 3-CTA tags as named; a row and tile pair once."""
    from rtattn.families import prefill as family
    built = []
    monkeypatch.setattr(family, "compile_prefill", lambda spec, tile, arch, quiet=None: built.append(
        (spec.variant, tile.tag, arch)))
    assert bench.main(["--prebuild", "sm_90", "--rows", "8x2048", "8x2048-softcap", "--rt-tiles", "default",
                       "wg_q128_pp", "wg_q64_kv32_s3_b3"]) == 0
    default = "ws_q128_kv64_w8_s4_b1"   # KV bound >= WS_MIN_KV: the warp-specialized kernel
    want = list(dict.fromkeys([default, "wg_q128_kv128_w8_s2_pp_b1", "wg_q64_kv32_w4_s3_b3"]))
    assert f"prebuilt {2 * len(want)} rtattn prefill instances for sm_90" in capsys.readouterr().out
    assert [t for v, t, a in built if v == "causal"] == want
    assert {a for *_, a in built} == {"sm_90"} and len({v for v, *_ in built}) == 2


def test_queue_order_option_and_what_a_plan_took(monkeypatch):
    from rtattn.families import prefill as family
    monkeypatch.setattr(family, "compile_prefill", lambda *a, **k: None)
    assert bench.main(["--prebuild", "sm_90", "--rows", "16x1024", "--queue-order", "lpt", "request"]) == 0
    with pytest.raises(SystemExit):
        bench.main(["--prebuild", "sm_90", "--rows", "16x1024", "--queue-order", "fifo"])
    assert bench.queue_taken({}) == "" and bench.queue_taken({"queue_order": "lpt", "queue_order_asked": "lpt"}) == ""
    assert bench.queue_taken({"queue_order": "request", "queue_order_asked": "request"}) == ", q=request"
    assert bench.queue_taken({"queue_order": "lpt", "queue_order_asked": "request"}) == ", q=lpt (asked request)"
