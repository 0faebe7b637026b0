"""The prefill family: tile policy and resource model, codegen (CPU tier: instances compile for
sm_80 and sm_90), plans the float64 executor checks, wrapper refusals; and the kernel against
the float64 reference (GPU tier)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rtattn.families import prefill as P
from rtattn.families.resources import blocks_by_smem, device_for_arch
from rtattn.plan import reference as ref
from rtattn.plan.executor import execute_plan
from rtattn.plan.inspector import Planner
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.plan.verify import verify_plan

H200 = device_for_arch("sm_90")
A100 = device_for_arch("sm_80")


def _ptxas_log(spec, tile, source, whole=False):
    """ptxas -v's report of this instance's entry function (its spills, then 'Used N registers');
    whole: everything ptxas said (its performance warnings come before the functions' reports)."""
    from rtattn.runtime import compile_to_cubin
    cubin = compile_to_cubin(source, name=P.instance_name(spec, tile), arch=tile.arch("sm_90"),
                             options=P.PREFILL_OPTIONS + ("--ptxas-options=-v",), quiet=True)
    return cubin.log if whole else cubin.log.split("Compiling entry function 'rtattn_prefill_" + spec.variant)[1]


# ----------------------------------------------------------------------------- CPU tier
@pytest.mark.parametrize("avg,group,rows", [(1024, 4, 128), (4, 4, 16), (8, 4, 32), (1, 16, 16), (3, 16, 64),
                                            (1, 32, 32), (2000, 1, 128)])
def test_rows_cover_the_fused_rows(avg, group, rows):
    assert P.choose_tile(H200, 128, group, avg, mma="sync").rows == rows
    assert P.choose_tile(A100, 128, group, avg).rows == rows


@pytest.mark.parametrize("avg,group,mma", [(1024, 4, "wgmma"), (128, 4, "wgmma"), (127, 4, "sync"), (16, 8, "sync"),
                                           (4, 16, "sync"), (128, 1, "ws"), (200, 64, "wgmma"), (200, 128, "sync")])
def test_hopper_takes_the_wgmma_kernel_for_prompts_of_128_tokens(avg, group, mma):
    t = P.choose_tile(H200, 128, group, avg)
    assert t.mma == mma and (t.rows == 128 if mma != "sync" else t.rows == P.choose_tile(A100, 128, group, avg).rows)
    assert P.choose_tile(A100, 128, group, avg).mma == "sync"


@pytest.mark.parametrize("head_dim,rows,tile_kv,stages,ctas", [(64, 128, 64, 3, 2), (128, 128, 32, 3, 2),
                                                                (256, 128, 32, 3, 1)])
def test_wgmma_policy_tiles_by_head_dim_compile_for_sm90a(head_dim, rows, tile_kv, stages, ctas):
    t = P.choose_tile(H200, head_dim, 8, 512, mma="wgmma")
    assert (t.rows, t.num_warps, t.tile_kv, t.stages, t.min_blocks) == (rows, rows // 16, tile_kv, stages, ctas)
    assert t.pingpong and P.choose_tile(H200, head_dim, 8, 512, avg_kv_len=1e5, mma="wgmma").rows == 128
    assert t.tag.startswith(f"wg_q{rows}") and t.arch("sm_90") == "sm_90a"
    assert t.smem_bytes(head_dim) == (rows + 2 * stages * tile_kv) * head_dim * 2
    assert P.choose_tile(H200, 128, 8, 512, tile_kv=128, stages=2).min_blocks == 1   # 144 KiB
    # a shape the caller fixes keeps the mma.sync kernel; the override picks either
    assert P.choose_tile(H200, 128, 8, 512, rows=128).mma == "sync"
    assert P.choose_tile(H200, 128, 8, 512, mma="sync").mma == "sync"
    assert P.choose_tile(H200, 128, 8, 1, mma="wgmma").rows == 128
    assert P.choose_tile(H200, 64, 8, 1, mma="wgmma").rows == 128
    assert P.choose_tile(H200, 64, 8, 1, mma="wgmma", rows=64).tag == "wg_q64_kv128_w4_s3_b2"   # one warpgroup
    two = P.choose_tile(H200, head_dim, 8, 512, rows=128, mma="wgmma")   # two warpgroups, one CTA per SM
    assert (two.num_warps, two.min_blocks, two.tag[:7]) == (8, 1, "wg_q128")


def test_evict_first_kv_copies_are_a_tile_field_refused_on_the_ws_kernel():
    """kv_evict_first (a cascade's read-once shared level): '_ef' in the tag, a define in the source;
    the warp-specialized kernel refuses it (ptxas miscompiles its evict-first copies)."""
    from dataclasses import replace
    t = replace(P.choose_tile(H200, 128, 4, 16, mma="wgmma", rows=64), kv_evict_first=True)
    assert t.tag == "wg_q64_kv64_w4_s3_ef_b2"
    with pytest.raises(ValueError, match="kv_evict_first=True is built for the sync and wgmma kernels"):
        replace(P.choose_tile(H200, 128, 4, 4096, mma="ws"), kv_evict_first=True)


def test_head_dim_128_takes_two_warpgroups_and_long_kv_128_token_tiles():
    long = P.choose_tile(H200, 128, 4, 1024, avg_kv_len=P.WGMMA_LONG_KV, mma="wgmma")
    assert (long.mma, long.rows, long.tile_kv, long.stages, long.min_blocks) == ("wgmma", 128, 128, 2, 1)
    short = P.choose_tile(H200, 128, 4, 1024, avg_kv_len=P.WS_MIN_KV - 1)
    assert short.tag == "wg_q128_kv32_w8_s3_pp_b2"                 # two CTAs per SM, taking turns
    assert P.choose_tile(H200, 128, 4, 1024) == short              # KV unknown
    assert P.choose_tile(H200, 128, 4, 1024, linear_bias=True) == long   # ALiBi's registers: one CTA per SM
    # d64: two 128-row CTAs per SM with 64-token tiles at every KV length, ALiBi too (no spill there);
    # d256: one 128-row CTA per SM (prefill v6)
    for kw in (dict(avg_kv_len=1e5), dict(avg_kv_len=100), dict(linear_bias=True)):
        assert P.choose_tile(H200, 64, 4, 1024, mma="wgmma", **kw).tag == "wg_q128_kv64_w8_s3_pp_b2"
        assert P.choose_tile(H200, 256, 4, 1024, **kw).tag == "wg_q128_kv32_w8_s3_pp_b1"
    assert P.choose_tile(H200, 128, 4, 1024, avg_kv_len=1e5, tile_kv=64, stages=4,
                         pingpong=False).tag == "wg_q128_kv64_w8_s4_b1"


def test_wgmma_refusals_name_the_cause():
    with pytest.raises(ValueError, match="cc 9.0"):
        P.choose_tile(A100, 128, 4, 1024, mma="wgmma")
    with pytest.raises(ValueError, match="warpgroups of 64 rows"):
        P.PrefillTile(128, 64, 4, 3, mma="wgmma")
    with pytest.raises(ValueError, match="warpgroups of 64 rows"):
        P.PrefillTile(32, 64, 2, 3, mma="wgmma")
    with pytest.raises(ValueError, match="mma="):
        P.PrefillTile(64, 64, 4, 3, mma="tcgen05")
    with pytest.raises(ValueError, match="mma="):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma2")
    with pytest.raises(ValueError, match="ctas_per_sm"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", ctas_per_sm=3)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=128, ctas_per_sm=2)
    with pytest.raises(ValueError, match="head_dim"):
        P.choose_tile(H200, 96, 4, 1024, mma="wgmma")
    with pytest.raises(ValueError, match="sm_90"):
        P.PrefillTile(64, 64, 4, 3, mma="wgmma").arch("sm_80")


def test_cross_item_stream_is_a_tile_field():
    """The KV stream across items (template CROSS of both kernels): off by default, picked by
    cross=True on the policy's kernel, named '_x' in the tag, refused where its cursor would spill."""
    assert not P.choose_tile(H200, 128, 4, 1024).cross
    t = P.choose_tile(H200, 128, 4, 1024, rows=64, cross=True)
    assert (t.mma, t.rows, t.cross, t.tag) == ("wgmma", 64, True, "wg_q64_kv64_w4_s3_x_b2")
    long = P.choose_tile(H200, 128, 4, 1024, avg_kv_len=P.WGMMA_LONG_KV, cross=True, pingpong=False)
    assert (long.rows, long.min_blocks, long.tag) == (128, 1, "wg_q128_kv128_w8_s2_x_b1")
    assert P.choose_tile(H200, 128, 4, 4, cross=True).tag == "q16_kv32_w1_s3_x_b2"   # the policy's kernel
    assert P.choose_tile(H200, 128, 4, 1024, rows=64, paged=False, cross=True).tag == "wg_q64_kv64_w4_s3_ragged_x_b2"
    sync = P.choose_tile(H200, 128, 4, 16, mma="sync", cross=True)
    assert (sync.rows, sync.cross, sync.tag) == (64, True, "q64_kv32_w4_s3_x_b2")
    assert P.choose_tile(A100, 64, 4, 4, cross=True).tag == "q16_kv64_w1_s3_x_b2"
    with pytest.raises(ValueError, match="one 16-row group per warp"):
        P.choose_tile(H200, 128, 4, 1024, mma="sync", cross=True)      # q128 w4
    with pytest.raises(ValueError, match="one 16-row group per warp"):
        P.choose_tile(A100, 128, 4, 1024, num_warps=8, cross=True)     # q128 w8
    with pytest.raises(ValueError, match="head_dim 256"):
        P.choose_tile(H200, 256, 4, 1024, cross=True)


@pytest.mark.parametrize("mma,head_dim,rows", [("wgmma", 128, 64), ("wgmma", 128, 128), ("sync", 128, 64)])
def test_cross_item_stream_compiles_without_spills(mma, head_dim, rows, isolated_cache):
    """The cursor of the KV stream across items stays in registers (ptxas, sm_90a / sm_90) with the
    hook that takes the most of them (ALiBi; docs/perf-log.md prefill v4 lists the others); the
    per-item path is unchanged by the flag (the template's CROSS = false)."""
    from rtattn.codegen.render import render_prefill
    from rtattn.codegen.spec import BUILTINS
    fn = "prefill_sm90_persistent" if mma == "wgmma" else "prefill_persistent"
    tile = P.choose_tile(H200, head_dim, 4, 1024, rows=rows, mma=mma, cross=True)
    for name in ("alibi",):
        spec = BUILTINS[name](dtype="bfloat16", head_dim=head_dim)
        src = render_prefill(spec, tile).source
        assert re.search(fn + r"<.*, true, true(, false)*>\(p, smem\)", src)   # (wgmma: pingpong, fma_exp2 off)
        log = _ptxas_log(spec, tile, src)
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log.split("Used")[0]), log[:400]
    per_item = render_prefill(BUILTINS["causal"](dtype="bfloat16", head_dim=head_dim),
                              P.choose_tile(H200, head_dim, 4, 1024, rows=rows, mma=mma)).source
    assert re.search(fn + r"<.*, true, false(, false)*>\(p, smem\)", per_item)


def test_pingpong_and_three_ctas_per_sm_are_tile_fields():
    """The 128-row wgmma tile's turns ('_pp'; off unless WGMMA_PINGPONG) and one warpgroup with
    32-token KV tiles at 3 CTAs per SM (168 registers); refused where they do not apply."""
    long = P.choose_tile(H200, 128, 4, 1024, avg_kv_len=P.WGMMA_LONG_KV, mma="wgmma")
    assert long.pingpong == P.WGMMA_PINGPONG
    pp = P.choose_tile(H200, 128, 4, 1024, rows=128, mma="wgmma", pingpong=True, tile_kv=64, stages=3)
    assert (pp.pingpong, pp.tag) == (True, "wg_q128_kv64_w8_s3_pp_b1")
    assert not P.choose_tile(H200, 128, 4, 1024, rows=64).pingpong              # 64 rows: one warpgroup
    b3 = P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=64, tile_kv=32, ctas_per_sm=3)
    assert (b3.min_blocks, b3.tag) == (3, "wg_q64_kv32_w4_s3_b3")                # 3 x 64 KiB
    assert P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=64, tile_kv=32, stages=4, ctas_per_sm=3).min_blocks == 2
    assert P.choose_tile(H200, 128, 4, 1024, rows=64, tile_kv=32).min_blocks == 2   # 3 only when asked
    two = P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=128, tile_kv=32, stages=3, ctas_per_sm=2, pingpong=True)
    assert two.tag == "wg_q128_kv32_w8_s3_pp_b2"                                 # 2 x 80 KiB, 128 registers
    assert P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=128, tile_kv=32, stages=3).min_blocks == 1
    with pytest.raises(ValueError, match="ctas_per_sm=2"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=128, ctas_per_sm=2)   # kv128: 255 registers
    with pytest.raises(ValueError, match="two warpgroups"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=64, pingpong=True)   # 64 rows
    with pytest.raises(ValueError, match="two warpgroups"):
        P.choose_tile(H200, 128, 4, 1024, mma="sync", rows=128, pingpong=True)
    with pytest.raises(ValueError, match="ctas_per_sm=3"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=64, tile_kv=64, ctas_per_sm=3)
    fe = P.choose_tile(H200, 128, 4, 1024, rows=64, fma_exp2=True)
    assert (fe.fma_exp2, fe.tag) == (True, "wg_q64_kv64_w4_s3_fe_b2")
    with pytest.raises(ValueError, match="fma_exp2"):
        P.choose_tile(H200, 128, 4, 1024, mma="sync", fma_exp2=True)


@pytest.mark.parametrize("tile", [dict(rows=128, pingpong=True, fma_exp2=True), dict(rows=64, tile_kv=32, ctas_per_sm=3),
                                  dict(rows=128, tile_kv=32, stages=3, ctas_per_sm=2, pingpong=True)])
def test_pingpong_and_three_ctas_compile_without_spills(tile, isolated_cache):
    """ptxas (sm_90a) keeps the new tiles out of local memory with the hook taking the most
    registers (ALiBi; causal for two warpgroups at 2 CTAs/SM, where ALiBi and the built-in soft_cap
    spill a few bytes per item), within the registers their CTAs per SM leave (168 at 3 x 128
    threads, 128 at 2 x 256)."""
    from rtattn.codegen.render import render_prefill
    from rtattn.codegen.spec import BUILTINS
    t = P.choose_tile(H200, 128, 4, 1024, mma="wgmma", **tile)
    spec = BUILTINS["causal" if t.rows == 128 and t.min_blocks == 2 else "alibi"](dtype="bfloat16", head_dim=128)
    src = render_prefill(spec, t).source
    flags = ", ".join("true" if f else "false" for f in (t.pingpong, t.fma_exp2))
    assert re.search(r"prefill_sm90_persistent<.*, %s>\(p, smem\)" % flags, src)
    log = _ptxas_log(spec, t, src)
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log.split("Used")[0]), log[:400]
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 65536 // (t.threads * t.min_blocks) // 8 * 8


@pytest.mark.parametrize("head_dim,tile", [(64, dict(rows=128, tile_kv=64, stages=3, ctas_per_sm=2, pingpong=True)),
                                           (64, dict(rows=128, tile_kv=32, stages=3, ctas_per_sm=2, pingpong=True)),
                                           (256, dict(rows=128, pingpong=True))])
@pytest.mark.parametrize("variant", ["alibi", "soft_cap", "sinks"])
def test_head_dim_64_and_256_two_warpgroup_tiles_compile_without_spills(head_dim, tile, variant, isolated_cache):
    """The 128-row tiles at d64 (two CTAs per SM: 64-token KV tiles keep S + P + O at 80 registers per
    thread, as 32 do at d128) and d256 (one CTA: O alone is 128 registers) stay out of local memory
    with the heavy hooks, within the registers their CTAs per SM leave."""
    from rtattn.codegen.render import render_prefill
    from rtattn.codegen.spec import BUILTINS
    spec = BUILTINS[variant](dtype="bfloat16", head_dim=head_dim)
    t = P.choose_tile(H200, head_dim, 4, 1024, mma="wgmma", **tile)
    assert t.min_blocks == tile.get("ctas_per_sm", 1) and t.pingpong
    log = _ptxas_log(spec, t, render_prefill(spec, t).source)
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log.split("Used")[0]), log[:400]
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= min(255, 65536 // (t.threads * t.min_blocks) // 8 * 8)


def test_the_register_cap_follows_the_accumulators():
    """One more CTA per SM where S + P + O take at most WGMMA_SMALL_ACC registers per thread."""
    assert P.wgmma_ctas_cap(128, 64, 64) == 2 and P.wgmma_ctas_cap(128, 64, 128) == 1
    assert P.wgmma_ctas_cap(64, 64, 64) == 3 and P.wgmma_ctas_cap(64, 32, 128) == 3
    assert P.wgmma_ctas_cap(128, 32, 256) == 1 and P.wgmma_ctas_cap(64, 128, 64) == 2
    assert P.choose_tile(H200, 64, 4, 1024, mma="wgmma", rows=128, tile_kv=64, ctas_per_sm=2).min_blocks == 2
    with pytest.raises(ValueError, match="ctas_per_sm=2"):
        P.choose_tile(H200, 128, 4, 1024, mma="wgmma", rows=128, tile_kv=64, ctas_per_sm=2)


@pytest.mark.parametrize("tile", [dict(mma="ws"), dict(mma="wgmma", rows=128, tile_kv=32, stages=3, ctas_per_sm=2,
                                                      pingpong=True)], ids=["ws", "wg-pp"])
def test_opt_in_softmax_builds_compile_without_spills(tile, isolated_cache):
    """The fixed-reference soft cap and the tensor-core row sums (RTATTN_FIXED_SOFTMAX,
    RTATTN_TC_ROWSUM: opt-in until measured, tools/gpu_softmax_ab.sh) keep compiling, out of local
    memory, and build other code than the default."""
    from rtattn.codegen.render import render_prefill
    from rtattn.runtime import compile_to_cubin
    from prefill_cases import combo_spec
    t = P.choose_tile(H200, 128, 4, 2048, **tile)
    spec = combo_spec("causal+soft_cap")
    src = render_prefill(spec, t).source
    logs, cubins = {}, {}
    for name, defs in (("default", ()), ("opt-in", ("-DRTATTN_FIXED_SOFTMAX", "-DRTATTN_TC_ROWSUM"))):
        cubin = compile_to_cubin(src, name=P.instance_name(spec, t), arch=t.arch("sm_90"),
                                 options=P.PREFILL_OPTIONS + defs + ("--ptxas-options=-v",), quiet=True)
        cubins[name] = bytes(cubin)
        logs[name] = log = cubin.log.split("Compiling entry function 'rtattn_prefill_" + spec.variant)[1]
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log.split("Used")[0]), (name, log[:400])
    assert cubins["default"] != cubins["opt-in"]
    used = {k: int(re.search(r"Used (\d+) registers", v).group(1)) for k, v in logs.items()}
    assert used["opt-in"] <= 65536 // (t.threads * t.min_blocks) // 8 * 8, used


def test_head_dim_256_caps_rows_and_the_resource_model_reads_the_device():
    t = P.choose_tile(H200, 256, 4, 4096, mma="sync")
    assert t.rows == 64 and t.tile_kv == 32
    assert t.smem_bytes(256) == (64 + 2 * 2 * 32) * 256 * 2
    # H200: 2 CTAs of 96 KiB fit 228 KiB; A100's 164 KiB holds one
    assert P.choose_tile(H200, 256, 4, mma="sync").min_blocks == 2
    assert P.choose_tile(A100, 256, 4).min_blocks == 1
    assert P.choose_tile(A100, 128, 4).min_blocks == 2   # 80 KiB
    assert blocks_by_smem(H200, 200 * 1024, 2) == 1


def test_ctas_per_sm_sets_the_register_budget_within_the_shared_memory():
    t = P.choose_tile(H200, 128, 4, 1024, rows=64, ctas_per_sm=3)
    assert t.min_blocks == 3 and t.tag.endswith("_b3")          # 64 KiB x 3 fit 228 KiB
    assert P.choose_tile(H200, 128, 4, 1024, ctas_per_sm=3).min_blocks == 2   # 80 KiB: only 2 fit
    assert P.choose_tile(H200, 128, 4, 1024, ctas_per_sm=3).mma == "sync"
    with pytest.raises(ValueError, match="ctas_per_sm"):
        P.choose_tile(H200, 128, 4, ctas_per_sm=0)


def test_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="rows"):
        P.PrefillTile(48, 64, 1, 2)
    with pytest.raises(ValueError, match="tile_kv"):
        P.PrefillTile(64, 16, 4, 2)
    with pytest.raises(ValueError, match="head group"):
        P.choose_tile(H200, 128, 256)
    with pytest.raises(ValueError, match="shared memory"):
        P.choose_tile(A100, 256, 4, rows=128, tile_kv=128, stages=3)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_prefill_instance_compiles(arch, isolated_cache):
    spec, tile = P.shipped(arch)[1]   # causal bf16 d128
    rendered, cubin = P.compile_prefill(spec, tile, arch, quiet=True)
    assert cubin[:4] == b"\x7fELF" and "prefill" in rendered.attention_name
    if arch == "sm_90":   # the wgmma kernel, an sm_90a CUBIN
        assert tile.mma == "wgmma" and f"PrefillSm90Shape<128, {tile.rows // 64}, {tile.tile_kv}, {tile.stages}" in rendered.source
        assert "prefill_sm90_persistent" in rendered.source and "prefill_persistent<" not in rendered.source
    else:
        assert f"PrefillShape<128, {tile.num_warps}, {tile.mma_q}, {tile.tile_kv}" in rendered.source


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_wgmma_tiles_fit_their_registers(head_dim, isolated_cache):
    """The resource model's promise for the policy's wgmma tiles, with the heaviest hooks (ALiBi,
    which keeps one CTA per SM at d128, and sinks): no spill, except the d128 tile of two 128-row CTAs
    per SM (128 registers), where ptxas parks at most a few words outside the KV loop (8 B for
    sinks; docs/perf-log.md prefill v5); d256 is the tight one."""
    from rtattn.codegen.render import render_prefill
    from rtattn.codegen.spec import BUILTINS
    for name in ("alibi", "sinks"):
        spec = BUILTINS[name](dtype="bfloat16", head_dim=head_dim)
        tile = P.choose_tile(H200, head_dim, 4, 1024, linear_bias=spec.linear_bias)   # the wrapper's choice
        log = _ptxas_log(spec, tile, render_prefill(spec, tile).source).split("Used")[0]
        spilled = int(re.search(r"(\d+) bytes spill stores", log).group(1))
        assert spilled <= (16 if tile.rows == 128 and tile.min_blocks == 2 else 0), (tile.tag, log[:400])


def test_warp_specialized_tile_fields_and_refusals():
    """The ws tile: 128 rows on 8 consumer warps plus the producer warpgroup (384 threads), two q
    tiles in its shared memory, one CTA per SM, sm_90a only; shapes it is not built for are refused."""
    t = P.choose_tile(H200, 128, 4, 1024, mma="ws")
    assert (t.tag, t.threads, t.min_blocks, t.arch("sm_90")) == ("ws_q128_kv64_w8_s4_b1", 384, 1, "sm_90a")
    assert t.smem_bytes(128) == (2 * 128 + 2 * 4 * 64) * 128 * 2 == 192 * 1024
    assert P.choose_tile(H200, 64, 4, 1024, mma="ws").tag == "ws_q128_kv128_w8_s3_b1"
    assert P.choose_tile(H200, 256, 4, 1024, mma="ws").tag == "ws_q128_kv32_w8_s2_b1"
    assert P.choose_tile(H200, 128, 4, 1024, mma="ws", tile_kv=128, stages=2, paged=False).tag == \
        "ws_q128_kv128_w8_s2_ragged_b1"
    for bad, match in ((dict(rows=64), "128 rows"), (dict(ctas_per_sm=2), "one CTA per SM")):
        with pytest.raises(ValueError, match=match):
            P.choose_tile(H200, 128, 4, 1024, mma="ws", **bad)
    with pytest.raises(ValueError, match="cc 9.0"):
        P.choose_tile(A100, 128, 4, 1024, mma="ws")
    with pytest.raises(ValueError, match="shared memory"):
        P.choose_tile(H200, 128, 4, 1024, mma="ws", tile_kv=128, stages=3)   # 256 KiB
    for bad in (dict(num_warps=4), dict(cross=True), dict(pingpong=True)):
        with pytest.raises(ValueError, match="warp-specialized"):
            P.PrefillTile(128, 64, **{"num_warps": 8, **bad}, stages=4, mma="ws")


@pytest.mark.parametrize("head_dim,group,avg_kv,mma", [(128, 4, 2048, "ws"), (128, 4, 2047, "wgmma"),
                                                       (128, 4, None, "wgmma"), (128, 1, None, "ws"),
                                                       (128, 16, 1e5, "ws"), (64, 4, None, "ws"),
                                                       (256, 4, 1e5, "wgmma")])
def test_policy_takes_the_warp_specialized_kernel_where_it_measured_faster(head_dim, group, avg_kv, mma):
    t = P.choose_tile(H200, head_dim, group, 1024, avg_kv_len=avg_kv)
    assert t.mma == mma and t.rows == 128
    # a caller tuning the warpgroup tile keeps the wgmma kernel
    assert P.choose_tile(H200, head_dim, group, 1024, avg_kv_len=avg_kv, tile_kv=32).mma == "wgmma"


def test_warp_specialized_render_and_registers(isolated_cache):
    """The ws instance renders its own kernel and compiles for sm_90a without a spill, with the
    heaviest hooks (ALiBi, sinks, custom masks, soft cap) at d128 and causal at d64 and ragged KV,
    its products asynchronous (ptxas serialized none)."""
    from rtattn.codegen.render import render_prefill
    from rtattn.codegen.spec import BUILTINS
    for name, d, kw in (("alibi", 128, {}), ("sinks", 128, {}), ("custom_mask", 128, {}), ("soft_cap", 128, {}),
                        ("causal", 64, {}), ("causal", 128, {"paged": False})):
        spec = BUILTINS[name](dtype="bfloat16", head_dim=d)
        tile = P.choose_tile(H200, d, 4, 1024, mma="ws", **kw)
        src = render_prefill(spec, tile).source
        assert f"PrefillWsShape<{d}, {tile.tile_kv}, {tile.stages}" in src and "prefill_ws_persistent<" in src
        assert "__launch_bounds__(384, 1)" in src
        full = _ptxas_log(spec, tile, src, whole=True)
        log = full.split("Compiling entry function 'rtattn_prefill_" + spec.variant)[1].split("Used")[0]
        assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) == 0, (name, d, tile.tag, log[:400])
        # a product issued on a runtime condition makes ptxas serialize every wgmma (C7514)
        assert "instructions are serialized" not in full, (name, d, tile.tag)


def test_user_linear_bias_and_transform_compile(isolated_cache):
    """A user variant declaring a linear bias as data (LinearBiasOf) beside a LogitsTransform:
    the prefill kernel starts its accumulators at the bias and calls the transform after it."""
    from rtattn.codegen import spec as S
    source = """
    struct DistanceDecay : rtattn::VariantBase {
      static constexpr bool has_linear_bias = true;
      static constexpr bool has_logits_transform = true;
      template <class P> __device__ rtattn::LinearBias LinearBiasOf(const P& p, int qo_idx, int) const {
        return {-p.extra.decay, q_pos(qo_idx)};
      }
      template <class P> __device__ float LogitsTransform(const P&, float s, int, int, int, int) const {
        return 0.5f * s;
      }
    };"""
    spec = S.custom_variant("decay", source, "DistanceDecay", (S.Param("decay", "float"),), causal=True)
    _, cubin = P.compile_prefill(spec, P.choose_tile(H200, 128, 4), "sm_90", quiet=True)
    assert cubin[:4] == b"\x7fELF"


def test_shipped_set_is_modest_and_named():
    names = [P.instance_name(s, t) for s, t in P.shipped("sm_90")]
    assert len(names) == len(set(names)) <= 32
    assert all("prefill" in n for n in names)


def _plan(qo, kv, group=4, causal=True, page=16, mode="auto", num_ctas=None):
    tile = P.choose_tile(H200, 128, group, float(np.mean(qo)))
    pl = Planner(len(qo) + 1, int(sum(qo)) + 5, int(sum(-(-np.asarray(kv) // page))) + 3, 2 * group, 2, 128, page,
                 device="h200", mode=mode, causal=causal, tile=P.tile_config(tile, 128, group),
                 num_ctas=num_ctas, chunk_tokens=256)
    ip, idx, last = paged_kv(kv, page, shuffle_seed=1)
    return pl, pl.plan(indptr_from_lengths(qo), ip, idx, last), (ip, idx, last)


@pytest.mark.parametrize("mode", ["auto", "naive", "batch-invariant"])
def test_prefill_plans_execute_to_the_reference(mode):
    """The plan the prefill kernel reads (tiles of rows // g tokens, causal KV clipped, split
    chunks merged) gives the reference's attention in float64."""
    rng = np.random.default_rng(3)
    qo, kv = [90, 1, 200, 16], [90, 2000, 450, 16]
    pl, info, (ip, idx, last) = _plan(qo, kv, num_ctas=5, mode=mode)
    if mode != "naive":
        assert info.num_merge_rows > 0
    verify_plan(info.views, qo, kv, tile_q=pl.tile_q, page_size=16, causal=True)
    pages = int(idx.max()) + 1
    q = rng.standard_normal((sum(qo), 8, 128))
    k = rng.standard_normal((pages, 16, 2, 128))
    v = rng.standard_normal((pages, 16, 2, 128))
    var = ref.Variant(causal=True)
    o, lse = execute_plan(info.views, q, k, v, var)
    want_o, want_lse = ref.reference_attention(q, k, v, indptr_from_lengths(qo), ip, idx, last, 16, var)
    assert np.allclose(o, want_o, atol=1e-10) and np.allclose(lse, want_lse)


def test_causal_plans_skip_hidden_blocks():
    """No item reaches past its tile's causal horizon: a 4096-token causal prompt plans about
    half the square's KV (the kernel clips every tile to its last row, VisibleKV)."""
    pl, info, _ = _plan([4096], [4096])
    n = info.num_items
    kv = (info.views["item_kv_end"][:n] - info.views["item_kv_start"][:n]).sum()
    assert kv < 0.52 * (4096 // pl.tile_q) * 4096


# ----------------------------------------------------------------------------- GPU tier
KERNELS = {"sync": {"mma": "sync"}, "wgmma": {"mma": "wgmma"}, "wgmma64": {"mma": "wgmma", "rows": 64},
           "wgmma128": {"mma": "wgmma", "rows": 128}, "ws": {"mma": "ws"}}


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    """Each GPU case on the family's kernels: mma.sync, and wgmma as the policy picks it (d128: two
    128-row CTAs per SM with 32-token KV tiles), with one warpgroup and with 128 rows of 128-token KV
    tiles (the tile override), and the warp-specialized kernel (ws; both need a cc 9.0 device)."""
    from rtattn.runtime import Device
    if request.param != "sync" and Device().arch != "sm_90":
        pytest.skip("the wgmma kernel needs a cc 9.0 device")
    return KERNELS[request.param]


GQA_PAGE_CASES = [((32, 32), 16, True), ((32, 8), 1, True), ((32, 8), 16, True), ((32, 8), 64, True),
                  ((32, 4), 16, True), ((32, 2), 16, True), ((32, 8), 16, False), ((32, 2), 64, False),
                  # the neighbourhood (gpu_all.sh's nbhd stage: -k nbhd): groups 5, 7, 6, 3; pages 128, 2, 4
                  *(pytest.param(h, ps, causal, id=f"{h[0]}/{h[1]}-{ps}-{causal}-nbhd") for h, ps, causal in (
                      ((40, 8), 128, True), ((28, 4), 128, True), ((28, 4), 2, True), ((48, 8), 4, True),
                      ((12, 4), 16, False), ((28, 4), 128, False)))]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,page_size,causal", GQA_PAGE_CASES,
                         ids=lambda x: f"{x[0]}/{x[1]}" if isinstance(x, tuple) else str(x))
def test_prefill_matches_reference(heads, page_size, causal, kernel):
    from prefill_cases import TOL, errors, make_case, run_prefill
    rng = np.random.default_rng(hash((heads, page_size, causal)) % 2**32)
    kv = rng.integers(1, 600, 5)
    qo = np.minimum(kv, rng.integers(1, 400, 5))
    case = make_case(kv, *heads, 128, page_size, qo_lens=qo, seed=int(rng.integers(1 << 30)))
    o, lse, _ = run_prefill(case, "causal" if causal else "plain", tile=kernel)
    eo, el = errors(case, o, lse, ref.Variant(causal=causal))
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "ragged"])
def test_head_dims_dtypes_layouts(head_dim, dtype, kv_layout, kernel):
    from prefill_cases import TOL, errors, make_case, run_prefill
    kv, qo = [700, 129, 1, 2000], [700, 64, 1, 333]
    ps = 1 if kv_layout == "ragged" else 16
    case = make_case(kv, 16, 4, head_dim, ps, dtype=dtype, kv_layout="NHD" if kv_layout == "ragged" else kv_layout,
                     qo_lens=qo, seed=head_dim)
    o, lse, _ = run_prefill(case, "causal", dtype, ragged=kv_layout == "ragged", tile=kernel)
    eo, el = errors(case, o, lse, ref.Variant(causal=True))
    assert eo < TOL[dtype] and el < 2e-2, (eo, el)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sliding_window", "soft_cap", "alibi", "sigmoid", "rope", "custom_mask", "sinks"])
def test_variants(variant, kernel):
    from prefill_cases import TOL, errors, make_case, run_prefill, variant_args
    rng = np.random.default_rng(7)
    kv, qo = np.array([900, 300, 1500]), np.array([900, 100, 37])
    case = make_case(kv, 16, 4, 128, 16, qo_lens=qo, seed=7)
    params, var = variant_args(variant, 16, qo, kv, rng)
    o, lse, _ = run_prefill(case, variant, params=params, tile=kernel)
    eo, el = errors(case, o, lse, var)
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4), (32, 2), (32, 1)], ids=lambda h: f"g{h[0] // h[1]}")
@pytest.mark.parametrize("variant", ["causal+alibi", "causal+soft_cap", "causal+alibi+soft_cap",
                                     "sliding_window+alibi"])
def test_bias_and_cap_variants_across_groups(variant, heads):
    """The linear bias starts the QK accumulators per row (slope and origin of each fused row's
    head and position) and the soft cap folds into the exponent's constants: every head group
    (a thread's four rows on one head, on two, on four; g = 3 mixes them), cached prefixes, a
    request of several query tiles, and both together (the bias before the cap)."""
    from prefill_cases import TOL, combo_spec, errors, make_case, run_prefill, variant_args
    rng = np.random.default_rng(11)
    kv, qo = np.array([700, 130, 1100]), np.array([700, 3, 64])
    case = make_case(kv, *heads, 128, 16, qo_lens=qo, seed=11)
    params, var = variant_args(variant, heads[0], qo, kv, rng)
    o, lse, _ = run_prefill(case, combo_spec(variant), params=params)
    eo, el = errors(case, o, lse, var)
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cap", [1.5, 50.0, 65.0, 66.0, 120.0])
def test_soft_cap_weights_at_both_ends_of_the_cap(cap, dtype, kernel):
    """Logits pinned near -cap (request 0's queries against every key), near +cap (request 1's
    along them) and spread across both (request 2's, large). bf16 caps up to 65 weigh against
    RowSoftmax's fixed reference, no row max: weights from 2^(64 - 2 cap log2 e) to 2^64 must stay
    normal floats; 66, 120 and fp16 keep the running max."""
    from prefill_cases import TOL, errors, make_case, run_prefill
    kv, qo = np.array([700, 300, 1500]), np.array([700, 100, 37])
    case = make_case(kv, 16, 4, 128, 16, dtype=dtype, qo_lens=qo, seed=5)
    case.k_cache.add_(2.0)   # every key leans along (1, .., 1)
    q0, q1, q2 = (slice(int(a), int(b)) for a, b in zip(case.qo_indptr[:-1], case.qo_indptr[1:]))
    case.q[q0] = case.q[q0] * 0.5 - 8.0
    case.q[q1] = case.q[q1] * 0.5 + 8.0
    case.q[q2] = case.q[q2] * 8.0
    o, lse, _ = run_prefill(case, "soft_cap", dtype, params={"soft_cap": cap}, tile=kernel)
    eo, el = errors(case, o, lse, ref.Variant(logits_soft_cap=cap))
    # tanh.approx's absolute error (~2^-11) times the cap is each logit's: a weight's relative error.
    # A weight out of range (zero, inf) is an error of order 1.
    slack = cap * 2.0**-11
    assert eo < TOL[dtype] + slack and el < 2e-2 + slack, (eo, el)


@pytest.mark.gpu
def test_user_linear_bias_comes_before_the_logits_transform():
    """A user variant's bias (slopes / 2, as data) and a LogitsTransform doubling the logit:
    2 (s sm_scale + slope / 2 (kv - q_pos)) is ALiBi at twice sm_scale, if the bias comes first."""
    import torch
    from prefill_cases import TOL, errors, make_case, run_prefill
    from rtattn.codegen import spec as S
    source = """
    struct HalfSlopesDoubled : rtattn::VariantBase {
      static constexpr bool has_linear_bias = true;
      static constexpr bool has_logits_transform = true;
      static constexpr bool has_logits_mask = true;
      template <class P> __device__ rtattn::LinearBias LinearBiasOf(const P& p, int qo_idx, int qo_head) const {
        return {0.5f * p.extra.slopes[qo_head], q_pos(qo_idx)};
      }
      template <class P> __device__ float LogitsTransform(const P&, float s, int, int, int, int) const { return 2.f * s; }
      template <class P> __device__ bool LogitsMask(const P&, int qo_idx, int kv_idx, int, int) const {
        return kv_idx <= q_pos(qo_idx);
      }
    };"""
    spec = S.custom_variant("half_slopes_doubled", source, "HalfSlopesDoubled", (S.Param("slopes", "const float*"),))
    kv, qo = np.array([600, 90]), np.array([600, 20])
    case = make_case(kv, 16, 4, 128, 16, qo_lens=qo, seed=5)
    slopes = torch.tensor(ref.alibi_slopes(16), dtype=torch.float32, device="cuda")
    o, lse, _ = run_prefill(case, spec, params={"slopes": slopes})
    eo, el = errors(case, o, lse, ref.Variant(causal=True, alibi=True, sm_scale=2 / np.sqrt(128)))
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "naive", "batch-invariant"])
def test_split_kv_merge_modes_and_determinism(mode, kernel):
    """Few CTAs force split KV (merged by the shared merge kernel); a second run of the same plan
    gives the same bits."""
    import torch
    from prefill_cases import TOL, errors, make_case, run_prefill
    # few query tiles over long cached prefixes: 7 CTAs must split the KV (auto too)
    case = make_case([6000, 4000, 2500], 8, 2, 128, 16, qo_lens=[32, 20, 100], seed=5)
    o, lse, w = run_prefill(case, "causal", mode=mode, num_ctas=7, chunk_tokens=1024, tile=kernel)
    if mode != "naive":
        assert w.info.num_merge_rows > 0
    eo, el = errors(case, o, lse, ref.Variant(causal=True))
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)
    again = torch.full_like(case.q, float("nan"))
    w.run(case.q, case.k_cache, case.v_cache, out=again)
    torch.cuda.synchronize()
    assert np.array_equal(again.float().cpu().numpy(), o)


@pytest.mark.gpu
def test_long_prompt_and_multi_token_decode(kernel):
    from prefill_cases import TOL, errors, make_case, run_prefill
    case = make_case([4096, 6000], 4, 1, 128, 16, qo_lens=[4096, 3], seed=9)
    o, lse, _ = run_prefill(case, "causal", tile=kernel)
    eo, el = errors(case, o, lse, ref.Variant(causal=True))
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)
    case = make_case([1000, 2000, 1], 32, 8, 128, 16, qo_lens=[4, 2, 1], seed=10)
    o, lse, w = run_prefill(case, "causal", avg_qo_len=4)
    assert w.tile.rows == 16
    eo, el = errors(case, o, lse, ref.Variant(causal=True))
    assert eo < TOL["bfloat16"] and el < 2e-2, (eo, el)


# The KV stream across items on queues of many items (few CTAs), items of one block and of many,
# split rows, the q copy of each warpgroup (64 / 128 rows) or warp (mma.sync: q in registers at
# d128, by ldmatrix per block at d256), a QueryTransform (its q by registers).
CROSS_CASES = {  # name: (kv_lens, qo_lens, (H, Hk), head_dim, page, variant, dtype, mma, rows, num_ctas, ragged)
    "causal-1-block-items": ([300, 1024, 77, 5, 1, 64], None, (32, 8), 128, 16, "causal", "bfloat16", "wgmma", 64, 3,
                             False),
    "causal-128-rows-page1": ([300, 1024, 77, 5, 1], None, (32, 8), 128, 1, "causal", "bfloat16", "wgmma", 128, 2,
                              False),
    "plain-cached-prefix": ([500, 1500, 40], [100, 700, 40], (16, 4), 128, 64, "plain", "float16", "wgmma", 64, 4,
                            False),
    "rope-q-by-registers": ([900, 300], [300, 300], (16, 4), 128, 16, "rope", "bfloat16", "wgmma", 64, 3, False),
    "custom-mask-ragged-d64": ([200, 300, 33], [50, 300, 33], (16, 4), 64, 1, "custom_mask", "float16", "wgmma", 64,
                               2, True),
    "sinks-split-rows": ([2000, 300], [64, 300], (16, 4), 128, 16, "sinks", "bfloat16", "wgmma", 64, 5, False),
    "window-g16-128-rows": ([900, 300, 1200], None, (32, 2), 128, 64, "sliding_window", "bfloat16", "wgmma", 128, 3,
                            False),
    "alibi-128-rows": ([900, 300, 1500], [900, 100, 37], (16, 4), 128, 16, "alibi", "bfloat16", "wgmma", 128, 4,
                       False),
    "sync-q64-causal": ([300, 1024, 77, 5, 1], None, (32, 8), 128, 16, "causal", "bfloat16", "sync", 64, 3, False),
    "sync-q16-multi-token": ([1000, 2000, 1, 300], [16, 9, 1, 3], (32, 8), 128, 16, "causal", "bfloat16", "sync", 16,
                             2, False),
    "sync-q64-d256-sinks": ([700, 129, 1], [700, 64, 1], (16, 4), 256, 16, "sinks", "bfloat16", "sync", 64, 3,
                            False),
    "sync-q32-rope-ragged": ([900, 300], [300, 300], (16, 4), 128, 1, "rope", "float16", "sync", 32, 2, True),
    # the neighbourhood (-k nbhd): multi-token decode (2-16 query tokens over cached prefixes) at g = 7, a
    # tile's rows not a multiple of the group (64 rows: 9 tokens; 32 rows: 4), 128-token pages
    "multi-token-28/4-wg64-nbhd": ([1000, 2000, 17, 300, 4096], [16, 9, 2, 3, 5], (28, 4), 128, 16, "causal", "bfloat16",
                                   "wgmma", 64, 2, False),
    "multi-token-28/4-sync32-p128-nbhd": ([1000, 2000, 17, 300, 4096], [16, 9, 2, 3, 5], (28, 4), 128, 128, "causal",
                                          "bfloat16", "sync", 32, 2, False),
    "causal-40/8-wg128-p128-nbhd": ([300, 1024, 77, 5, 1], None, (40, 8), 128, 128, "causal", "bfloat16", "wgmma", 128,
                                    2, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CROSS_CASES))
def test_cross_item_stream_matches_the_reference_and_the_per_item_bits(name):
    """tile cross=True against the float64 reference (poisoned outputs), and bitwise the output of
    the per-item stream on the same plan shape: the same products in the same order."""
    from prefill_cases import TOL, errors, make_case, run_prefill, variant_args
    from rtattn.runtime import Device
    if Device().arch != "sm_90":
        pytest.skip("the wgmma kernel needs a cc 9.0 device")
    kv, qo, (H, Hk), D, ps, variant, dtype, mma, rows, num_ctas, ragged = CROSS_CASES[name]
    qo = kv if qo is None else qo
    case = make_case(kv, H, Hk, D, ps, dtype=dtype, qo_lens=qo, seed=len(name))
    params, var = variant_args(variant, H, qo, kv, np.random.default_rng(len(name)))
    got = {}
    for cross in (True, False):
        tile = {"mma": mma, "rows": rows, "cross": cross}
        got[cross] = run_prefill(case, variant, dtype, params, ragged=ragged, num_ctas=num_ctas, tile=tile)
        assert got[cross][2].tile.cross == cross
    (o, lse, w), (o0, lse0, _) = got[True], got[False]
    assert w.info.num_items > 2 * num_ctas   # queues of several items (each CTA walks its queue per KV head)
    eo, el = errors(case, o, lse, var)
    assert eo < TOL[dtype] and el < 2e-2, (eo, el)
    assert np.array_equal(o, o0) and np.array_equal(lse, lse0)


# Tiles of the prefill v5 A/B (docs/perf-log.md): the 128-row tile's warpgroups taking turns
# (pingpong: bitwise the default 128-row tile's output), half the exp2 on the FMA pipe (fma_exp2)
# and one warpgroup at 3 CTAs per SM (32-token KV tiles, 168 registers); against the reference.
D64_KV64 = {"rows": 128, "tile_kv": 64, "stages": 3, "ctas_per_sm": 2, "pingpong": True}
D256_PP = {"rows": 128, "tile_kv": 32, "stages": 3, "pingpong": True}
NEW_TILE_CASES = {  # name: (kv_lens, qo_lens, (H, Hk), head_dim, page, variant, dtype, tile, num_ctas)
    "pp-causal-page1": ([300, 1024, 77, 5, 1], None, (32, 8), 128, 1, "causal", "bfloat16",
                        {"rows": 128, "pingpong": True}, 2),
    "pp-alibi-cached": ([900, 300, 1500], [900, 100, 37], (16, 4), 128, 16, "alibi", "bfloat16",
                        {"rows": 128, "pingpong": True, "tile_kv": 64, "stages": 3}, 4),
    "pp-window-g16": ([900, 300, 1200], None, (32, 2), 128, 64, "sliding_window", "bfloat16",
                      {"rows": 128, "pingpong": True}, 3),
    "pp-soft-cap-fp16": ([900, 300], None, (16, 4), 128, 16, "soft_cap", "float16",
                         {"rows": 128, "pingpong": True, "tile_kv": 64, "stages": 4}, 3),
    "pp-sinks-split-cross": ([2000, 300], [64, 300], (16, 4), 128, 16, "sinks", "bfloat16",
                             {"rows": 128, "pingpong": True, "cross": True}, 5),
    "pp-rope-d64": ([900, 300], [300, 300], (16, 4), 64, 16, "rope", "bfloat16", {"rows": 128, "pingpong": True}, 3),
    "fe-causal-cached": ([513, 1500, 64], [1, 700, 64], (32, 8), 128, 16, "causal", "bfloat16",
                         {"rows": 64, "fma_exp2": True}, 3),
    "pp-fe-soft-cap": ([900, 300, 1500], [900, 100, 37], (32, 8), 128, 16, "soft_cap", "float16",
                       {"rows": 128, "pingpong": True, "fma_exp2": True}, 4),
    "fe-window-d64": ([900, 300], None, (16, 4), 64, 16, "sliding_window", "float16", {"rows": 64, "fma_exp2": True}, 2),
    "pp-b2-kv32-causal": ([300, 1024, 77, 5, 1], None, (32, 8), 128, 16, "causal", "bfloat16",
                          {"rows": 128, "tile_kv": 32, "stages": 3, "ctas_per_sm": 2, "pingpong": True}, 4),
    "pp-b2-kv32-alibi-cached": ([900, 300, 1500], [900, 100, 37], (16, 4), 128, 16, "alibi", "bfloat16",
                                {"rows": 128, "tile_kv": 32, "stages": 3, "ctas_per_sm": 2, "pingpong": True}, 4),
    "b3-causal": ([300, 1024, 77, 5, 1], None, (32, 8), 128, 16, "causal", "bfloat16",
                  {"rows": 64, "tile_kv": 32, "ctas_per_sm": 3}, 3),
    "b3-soft-cap-split": ([3000, 200], [3000, 10], (8, 2), 128, 16, "soft_cap", "bfloat16",
                          {"rows": 64, "tile_kv": 32, "ctas_per_sm": 3}, 3),
    "b3-custom-mask-d64-ragged": ([200, 300, 33], [50, 300, 33], (16, 4), 64, 1, "custom_mask", "float16",
                                  {"rows": 64, "tile_kv": 32, "ctas_per_sm": 3}, 2),
    # prefill v6: two warpgroups at d64 (two CTAs per SM, 64- or 32-token KV tiles) and d256 (one CTA),
    # d128 with 4 stages
    "d64-pp-b2-kv64-causal": ([300, 1024, 77, 5, 1], None, (32, 8), 64, 16, "causal", "bfloat16", D64_KV64, 4),
    "d64-pp-b2-kv64-alibi-cached-fp16": ([900, 300, 1500], [900, 100, 37], (16, 4), 64, 16, "alibi", "float16",
                                         D64_KV64, 4),
    "d64-pp-b2-kv64-soft-cap-page1-g1": ([700, 129, 33], None, (8, 8), 64, 1, "soft_cap", "bfloat16", D64_KV64, 3),
    "d64-pp-b2-kv64-window-g16-page64": ([900, 300, 1200], None, (32, 2), 64, 64, "sliding_window", "bfloat16",
                                         D64_KV64, 3),
    "d64-pp-b2-kv64-sinks-split": ([2000, 300], [64, 300], (16, 4), 64, 16, "sinks", "bfloat16", D64_KV64, 5),
    "d64-pp-b2-kv64-custom-mask-ragged": ([200, 300, 33], [50, 300, 33], (16, 4), 64, 1, "custom_mask", "float16",
                                          D64_KV64, 2),
    "d64-pp-b2-kv32-causal-cached": ([513, 1500, 64], [1, 700, 64], (32, 8), 64, 16, "causal", "bfloat16",
                                     {**D64_KV64, "tile_kv": 32}, 3),
    "d256-pp-causal": ([300, 1024, 77, 5, 1], None, (32, 8), 256, 16, "causal", "bfloat16", D256_PP, 4),
    "d256-pp-alibi-cached": ([900, 300, 1500], [900, 100, 37], (16, 4), 256, 16, "alibi", "bfloat16", D256_PP, 4),
    "d256-pp-soft-cap-fp16-split": ([3000, 200], [3000, 10], (8, 2), 256, 16, "soft_cap", "float16", D256_PP, 3),
    "d256-pp-window-g1-page1": ([900, 300, 1200], None, (8, 8), 256, 1, "sliding_window", "bfloat16", D256_PP, 3),
    "d256-pp-sinks-split-g16": ([2000, 300], [64, 300], (32, 2), 256, 64, "sinks", "bfloat16", D256_PP, 5),
    "d256-pp-custom-mask-ragged": ([200, 300, 33], [50, 300, 33], (16, 4), 256, 1, "custom_mask", "bfloat16",
                                   D256_PP, 2),
    "d128-pp-b2-kv32-s4-soft-cap": ([900, 300, 1500], [900, 100, 37], (32, 8), 128, 16, "soft_cap", "bfloat16",
                                    {"rows": 128, "tile_kv": 32, "stages": 4, "ctas_per_sm": 2, "pingpong": True}, 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(NEW_TILE_CASES))
def test_pingpong_and_three_ctas_per_sm_match_the_reference(name):
    """The v5 tiles against the float64 reference (poisoned outputs); pingpong also bitwise the same
    tile without turns (the same products on the same operands)."""
    from prefill_cases import TOL, errors, make_case, run_prefill, variant_args
    from rtattn.runtime import Device
    if Device().arch != "sm_90":
        pytest.skip("the wgmma kernel needs a cc 9.0 device")
    kv, qo, (H, Hk), D, ps, variant, dtype, tile, num_ctas = NEW_TILE_CASES[name]
    qo = kv if qo is None else qo
    case = make_case(kv, H, Hk, D, ps, dtype=dtype, qo_lens=qo, seed=len(name))
    params, var = variant_args(variant, H, qo, kv, np.random.default_rng(len(name)))
    ragged = name.endswith("ragged")
    o, lse, w = run_prefill(case, variant, dtype, params, ragged=ragged, num_ctas=num_ctas,
                            tile={"mma": "wgmma", **tile})
    assert w.tile.pingpong == bool(tile.get("pingpong")) and w.tile.fma_exp2 == bool(tile.get("fma_exp2"))
    assert w.tile.min_blocks == tile.get("ctas_per_sm", 1 if w.tile.rows == 128 else 2)
    eo, el = errors(case, o, lse, var)
    assert eo < TOL[dtype] and el < 2e-2, (eo, el)
    if tile.get("pingpong") and not tile.get("fma_exp2"):
        o0, lse0, _ = run_prefill(case, variant, dtype, params, ragged=ragged, num_ctas=num_ctas,
                                  tile={"mma": "wgmma", **tile, "pingpong": False})
        assert np.array_equal(o, o0) and np.array_equal(lse, lse0)


@pytest.mark.gpu
def test_bad_input_is_refused_before_launch():
    import torch
    from prefill_cases import make_case
    from rtattn.prefill_wrapper import BatchPrefillWrapper
    case = make_case([100, 50], 8, 2, 128, 16, qo_lens=[100, 50], seed=1)
    w = BatchPrefillWrapper(8, 2, 128, 16, max_batch=4, max_qo_tokens=200, max_pages=20)
    with pytest.raises(ValueError, match="qo_len"):   # causal: q longer than its KV
        w.plan(indptr_from_lengths([101, 50]), case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len[:1])
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    with pytest.raises(ValueError, match="q"):
        w.run(case.q[:10], case.k_cache, case.v_cache)
    with pytest.raises(TypeError, match="dtype|q"):
        w.run(case.q.float(), case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="k_cache"):
        w.run(case.q, case.k_cache[:, :, :1], case.v_cache)
    with pytest.raises(ValueError, match="ragged"):
        BatchPrefillWrapper(8, 2, 128, kv_layout="ragged", max_batch=4, max_qo_tokens=200)
    del torch
