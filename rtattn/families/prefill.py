"""The prefill family: tile policy, resource model and the kernels a launch enqueues, in one place.

A tile is ROWS = 16 * mma_q * num_warps fused query rows (tokens x head group) against TILE_KV
KV tokens per pipeline stage, run by one of two kernels (`PrefillTile.mma`): "sync", the
mma.sync kernel (cuda_src/prefill.cuh, sm_80 and sm_90), or "wgmma", the warpgroup kernel
(cuda_src/prefill_sm90.cuh, compiled for sm_90a: warpgroups of 64 rows; by default two per CTA
sharing the K/V tiles and taking turns on the tensor cores, or one). Its shared memory (q tile +
stages x (K + V) tiles) and the CTAs per SM it is compiled for (__launch_bounds__) come from
`PrefillTile` alone, from the device's real limits: the renderer spells the same numbers into the
source (a static_assert checks the shared memory), the planner sizes its grid with them, and the
loaded kernel's occupancy is checked against them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from rtattn.codegen.render import Rendered, render_prefill
from rtattn.codegen.spec import BUILTINS, DTYPES, AttentionSpec
from rtattn.kernels import COMPILE_OPTIONS, LoadedKernels, dev_defines
from rtattn.plan import devices as plan_devices
from rtattn.plan.tiles import TileConfig

from . import resources

ROWS = (16, 32, 64, 128)
TILE_KV = (32, 64, 128)
MAX_CTAS_PER_SM = 2   # register budget: 255 per thread at 128 threads leaves room for 2
MMAS = ("sync", "wgmma", "ws")
WGMMA_ROWS = 64       # one warpgroup's m64 products: the smallest wgmma tile (wgmma_runs's fit)
# wgmma tiles by (rows, head_dim) -> (tile_kv, stages): what a caller fixing the shape leaves out
# (the policy's own tiles are WGMMA_POLICY's). 64 rows: two CTAs per SM fit in the shared memory
# (d128: 16 KiB q + 3 x 32 KiB stages = 112 KiB each) and S + P + O fit 255 registers (ptxas: 212
# at d64/d128, 255 at d256, no spills). 128 rows (two warpgroups, one CTA per SM): 128-token tiles
# (d64 in 3 stages, d128 in 2; d256: 32 in 3, 64 spills).
WGMMA_TILES = {(64, 64): (128, 3), (64, 128): (64, 3), (64, 256): (32, 2),
               (128, 64): (128, 3), (128, 128): (128, 2), (128, 256): (32, 3)}
WGMMA_MIN_QO = 128    # average query tokens from which the policy takes the wgmma kernel
# The policy's wgmma tile by head_dim: two warpgroups (128 rows) taking turns on the tensor cores
# (PrefillTile.pingpong), as (tile_kv, stages, CTAs per SM) below WGMMA_LONG_KV average KV tokens
# per request (None: unknown) and from there. H200, TFLOP/s (docs/perf-log.md v12 and prefill v6):
# d128, 64-row tile / kv32 pp b2 / kv128 pp b1: 16x1024 240 / 297 / 259, 32x512 189 / 230 / 186,
# 4x4096 347 / 359 / 365, 1x16384 391 / 381 / 412; d64, 64-row kv128 b2 / kv64 pp b2 / kv32 pp b2 /
# kv128 pp b1: 16x1024 195 / 255 / 226 / 193, 32x512 142 / 197 / 184 / 142, 4x4096 273 / 327 / 273 / 264;
# d256, 64-row kv32 b2 / 128-row kv32 pp b1 (two do not fit the shared memory): 16x1024 246 / 262,
# 32x512 188 / 204, 4x4096 303 / 333.
WGMMA_LONG_KV = 4096
WGMMA_POLICY = {64: (128, (64, 3, 2), (64, 3, 2)), 128: (128, (32, 3, 2), (128, 2, 1)),
                256: (128, (32, 3, 1), (32, 3, 1))}   # head_dim: (rows, short-KV tile, long-KV tile)
WGMMA_BIAS_SPILLS = (128,)   # head dims whose short-KV tile spills with a linear bias (ALiBi 8-20 B at d128)
# The KV stream across items (PrefillTile.cross; template CROSS of both kernels), an A/B path until
# measured. ptxas (sm_90a / sm_90) holds its cursor (4 registers) with no spill in the KV loop for
# the wgmma kernel at head dims 64 and 128 (d128 64 rows 244 registers, 128 rows 254; d256, at 252
# without it, spills there) and for the mma.sync kernel's tiles of one 16-row group per warp and at
# most 4 warps (q16-q64; d64 to d256, ALiBi, sinks, custom masks). Its q128 tiles spill there: w4
# (two groups per warp, 255 registers) with ALiBi, sinks, custom masks; w8 (128 registers) always.
CROSS_HEAD_DIMS = (64, 128)
# The 128-row wgmma tile's warpgroups take turns on the tensor cores (PrefillTile.pingpong): the
# same products in another order (bitwise the same outputs), +3-9 % on every 128-row row measured
# (v12).
WGMMA_PINGPONG = True
# The warp-specialized kernel (mma "ws", cuda_src/prefill_ws.cuh): a producer warpgroup beside two
# consumer warpgroups of 64 rows (num_warps counts the consumers' 8 warps), two q tiles, one CTA per
# SM, by head_dim -> (tile_kv, stages): d64 128 x 3 (128 KiB), d128 64 x 4 (192 KiB: +2-8 % over 128 x 2
# on the H200 but at 8x2048-softcap), d256 32 x 2 (192 KiB; 64-token tiles spill).
WS_ROWS, WS_WARPS, WS_PRODUCER_THREADS = 128, 8, 128
WS_TILES = {64: (128, 3), 128: (64, 4), 256: (32, 2)}
# Where the policy takes it (_ws_fits): d64 and d128 (d256: measured only for correctness), at d128
# with g >= 2 from WS_MIN_KV average KV tokens per request. H200, TFLOP/s ws / wgmma policy tile
# (32/8 d128 unless named): 4x4096 377 / 363, 8x2048 362 / 344, chunk16x4096+512 358 / 351, 1x16384
# 418 / 419, 8x2048 ALiBi 329 / 317, window 337 / 329, soft-cap 316 / 315; 16x1024 290 / 302, 32x512
# 222 / 229; g = 1 (32/32): 16x1024 260 / 246, 32x512 195 / 188, 4x4096 338 / 329; d64: 16x1024 264 /
# 254, 4x4096 354 / 324, 32x512 193 / 195.
WS_HEAD_DIMS = (64, 128)
WS_MIN_KV = 2048
WGMMA_SMALL_ACC = 88  # accumulator registers per thread with which one more CTA fits the registers (wgmma_ctas_cap)


@dataclass(frozen=True)
class PrefillTile:
    rows: int            # fused query rows per CTA (tile_q tokens x g heads fit in it)
    tile_kv: int         # KV tokens per pipeline stage
    num_warps: int
    stages: int
    paged: bool = True   # False: ragged KV (rows of a [tokens, H, D] tensor)
    min_blocks: int = 1  # CTAs per SM the kernel is compiled for (resource model)
    mma: str = "sync"    # the kernel: "sync" (mma.sync) or "wgmma" (sm_90a warpgroup MMA)
    cross: bool = False  # the KV stream (and q) runs across items (template CROSS of either kernel)
    pingpong: bool = False  # two warpgroups take turns on the tensor cores (wgmma, 128 rows; PINGPONG)
    fma_exp2: bool = False  # half the softmax's exp2 on the FMA pipe (wgmma; FMA_EXP2)
    # KV copies under L2's evict-first policy, for plans that read each KV block once (a cascade's
    # shared level: rtattn.cascade.shared_prefill_tile); sync / wgmma (RTATTN_PREFILL_KV_EVICT_FIRST)
    kv_evict_first: bool = False

    def __post_init__(self):
        if self.mma not in MMAS:
            raise ValueError(f"prefill mma={self.mma!r}: use one of {MMAS}")
        if self.mma == "wgmma" and (self.rows not in (64, 128) or self.num_warps != self.rows // 16):
            raise ValueError(f"the wgmma prefill kernel runs warpgroups of 64 rows: rows 64 or 128 with "
                             f"num_warps = rows / 16 (got rows={self.rows}, num_warps={self.num_warps})")
        if self.mma == "ws" and (self.rows != WS_ROWS or self.num_warps != WS_WARPS or self.cross or self.pingpong):
            raise ValueError(f"the warp-specialized prefill kernel runs 128 rows on {WS_WARPS} consumer warps, its "
                             f"stream across items and turns built in (got rows={self.rows}, num_warps="
                             f"{self.num_warps}, cross={self.cross}, pingpong={self.pingpong})")
        if self.pingpong and (self.mma != "wgmma" or self.rows != 128):
            raise ValueError(f"prefill pingpong=True takes turns between two warpgroups: the wgmma kernel at "
                             f"128 rows (got mma={self.mma!r}, rows={self.rows})")
        if self.kv_evict_first and self.mma == "ws":
            raise ValueError("prefill kv_evict_first=True is built for the sync and wgmma kernels: ptxas miscompiles "
                             "the warp-specialized kernel's evict-first copies (tools/scan_sass.py)")
        if self.fma_exp2 and self.mma == "sync":
            raise ValueError(f"prefill fma_exp2=True is built for the warpgroup kernels (got mma={self.mma!r})")
        if self.rows not in ROWS:
            raise ValueError(f"prefill rows={self.rows}: use one of {ROWS}")
        if self.tile_kv not in TILE_KV:
            raise ValueError(f"prefill tile_kv={self.tile_kv}: use one of {TILE_KV}")
        if self.num_warps < 1 or self.rows % (16 * self.num_warps):
            raise ValueError(f"rows={self.rows} is not a multiple of 16 x num_warps={self.num_warps}")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: the pipeline needs at least 2")

    @property
    def mma_q(self) -> int:
        return self.rows // (16 * self.num_warps)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps + (WS_PRODUCER_THREADS if self.mma == "ws" else 0)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Mirror of rtattn::PrefillShape::smem_bytes (and PrefillSm90Shape's, PrefillWsShape's):
        q tile (two for the warp-specialized kernel) + stages x (K tile + V tile)."""
        q_tiles = 2 if self.mma == "ws" else 1
        return (q_tiles * self.rows + self.stages * 2 * self.tile_kv) * head_dim * elem_bytes

    @property
    def tag(self) -> str:
        flags = "".join(part for part, on in (("_ragged", not self.paged), ("_x", self.cross),
                                              ("_pp", self.pingpong), ("_fe", self.fma_exp2),
                                              ("_ef", self.kv_evict_first)) if on)
        return (f"{ {'wgmma': 'wg_', 'ws': 'ws_'}.get(self.mma, '')}q{self.rows}_kv{self.tile_kv}_w{self.num_warps}"
                f"_s{self.stages}{flags}_b{self.min_blocks}")

    def arch(self, device_arch: str) -> str:
        """The CUBIN target: the wgmma kernel needs sm_90a (cc 9.0 only)."""
        if self.mma == "sync":
            return device_arch
        if device_arch not in ("sm_90", "sm_90a"):
            raise ValueError(f"the wgmma prefill kernel runs on sm_90 (Hopper) only, not {device_arch}")
        return "sm_90a"


def spec_for(variant, dtype: str, head_dim: int) -> AttentionSpec:
    """A built-in variant's name or an AttentionSpec -> the spec (prefill has no per-spec tile)."""
    return resources.variant_spec(variant, dtype, head_dim)


def choose_tile(device, head_dim: int, group: int, avg_qo_len: float = 1024, *, paged: bool = True,
                rows: int | None = None, tile_kv: int | None = None, num_warps: int | None = None,
                stages: int | None = None, ctas_per_sm: int | None = None, mma: str | None = None,
                avg_kv_len: float | None = None, cross: bool = False, pingpong: bool | None = None,
                fma_exp2: bool = False, linear_bias: bool = False) -> PrefillTile:
    """The tile for a workload. mma: the kernel (MMAS); by default "wgmma" on cc 9.0 for queries
    of WGMMA_MIN_QO tokens or more on average unless the caller fixes another shape (rows,
    num_warps) or more than 2 CTAs per SM, else "sync". On mma.sync: the smallest ROWS covering
    the average fused rows (avg query length x g), at least the head group, at head_dim 256 at
    most 64 rows (O alone is 128 registers per thread there); KV tile and stages: the largest that
    keep MAX_CTAS_PER_SM resident where the shared memory allows it. On wgmma: WGMMA_POLICY's rows
    and tile at head_dim (its short-KV tile below WGMMA_LONG_KV average KV tokens per request,
    avg_kv_len; None: unknown; the long-KV tile from there); a tile_kv or stages given keeps
    WGMMA_TILES's for the rows. Any argument given explicitly overrides the policy (A/B tests);
    ctas_per_sm is the register budget the kernel is compiled for (__launch_bounds__), capped by
    the shared memory. cross: the KV stream across items (an A/B path, off by default) on
    whichever kernel the rest picks. pingpong: the two warpgroups of a 128-row wgmma tile take
    turns (None: WGMMA_PINGPONG there). fma_exp2: half the softmax's exp2 on the FMA pipe (the
    wgmma kernel; an A/B path). linear_bias: the variant's (AttentionSpec.linear_bias): at the head
    dims of WGMMA_BIAS_SPILLS it takes the long-KV tile at every KV length, where its registers fit
    (at two CTAs per SM ptxas spills 8-20 B)."""
    dev = plan_devices.get_device(device)
    if group > ROWS[-1]:
        raise ValueError(f"head group {group} exceeds the prefill kernel's {ROWS[-1]} rows")
    if mma not in (None,) + MMAS:
        raise ValueError(f"prefill mma={mma!r}: use one of {MMAS} (or None: the policy's)")
    if mma is None:
        fixed = rows not in (None, WGMMA_ROWS) or num_warps not in (None, 4) or (ctas_per_sm or 0) > MAX_CTAS_PER_SM
        mma = "wgmma" if not fixed and _wgmma_fits(dev, head_dim, group, avg_qo_len) else "sync"
        tuned = any(x is not None for x in (rows, num_warps, tile_kv, stages, ctas_per_sm, pingpong)) or cross
        if mma == "wgmma" and not tuned and _ws_fits(head_dim, group, avg_kv_len):
            mma = "ws"
    if mma == "ws":
        return _ws_tile(dev, head_dim, group, paged, rows, tile_kv, stages, ctas_per_sm, fma_exp2)
    if mma == "wgmma":
        _require_sm90a(dev, mma)
        if rows is None:
            rows, short_tile, long_tile = WGMMA_POLICY.get(head_dim, (WGMMA_ROWS, None, None))   # (others: refused below)
            short_kv = (avg_kv_len or 0) < WGMMA_LONG_KV and not (linear_bias and head_dim in WGMMA_BIAS_SPILLS)
            if short_tile and tile_kv is None and stages is None:
                tile_kv, stages, ctas = short_tile if short_kv else long_tile
                ctas_per_sm = ctas if ctas_per_sm is None else ctas_per_sm
        if cross and head_dim not in CROSS_HEAD_DIMS:
            raise ValueError(f"prefill cross=True at head_dim {head_dim}: the KV stream across items is built for "
                             f"head dims {CROSS_HEAD_DIMS} (at 256 its cursor's registers spill in the KV loop)")
        if pingpong is None:   # (the cross-item stream, an A/B path, keeps the turn-less tile it was measured on)
            pingpong = WGMMA_PINGPONG and rows == 128 and not cross
        return replace(_wgmma_tile(dev, head_dim, rows, paged, tile_kv, stages, ctas_per_sm), cross=bool(cross),
                       pingpong=bool(pingpong), fma_exp2=bool(fma_exp2))
    if rows is None:
        need = max(group, avg_qo_len * group)
        rows = next((r for r in ROWS if r >= need), ROWS[-1])
        if head_dim > 128:
            rows = min(rows, 64)
        rows = max(rows, next(r for r in ROWS if r >= group))
    if num_warps is None:
        num_warps = min(4, rows // 16)
    # Measured on the H200 (docs/perf-log.md, prefill v1): d128 at 128 rows, 32-token tiles in 3
    # stages beat 64-token tiles in 2 (+8% at 16 x 1024, +5% at 1 x 16384; same 2 CTAs/SM).
    if tile_kv is None:
        tile_kv = {64: 64, 128: 32, 256: 32}[head_dim]
    if stages is None:
        stages = 2 if head_dim > 128 else 3
    tile = PrefillTile(rows, tile_kv, num_warps, stages, paged, cross=bool(cross), pingpong=bool(pingpong),
                       fma_exp2=bool(fma_exp2))
    if cross and (tile.mma_q != 1 or num_warps > 4):
        raise ValueError(f"prefill cross=True with the mma.sync tile {tile.tag}: the stream's cursor spills in its KV "
                         f"loop; it takes tiles of one 16-row group per warp and at most 4 warps (rows <= 64)")
    smem = _smem_checked(dev, tile, head_dim)
    if ctas_per_sm is not None and not 1 <= ctas_per_sm <= 8:
        raise ValueError(f"prefill ctas_per_sm={ctas_per_sm}: use 1 to 8")
    blocks = resources.blocks_by_smem(dev, smem, ctas_per_sm or MAX_CTAS_PER_SM)
    return replace(tile, min_blocks=blocks)


def _smem_checked(dev, tile: PrefillTile, head_dim: int) -> int:
    """`tile`'s shared memory at head_dim, refused where it exceeds what one block may use."""
    smem = tile.smem_bytes(head_dim)
    if smem > dev.smem_per_block_optin:
        raise ValueError(f"prefill tile {tile.tag} needs {smem} B of shared memory, more than the "
                         f"{dev.smem_per_block_optin} B one block may use on {dev.name}")
    return smem


def wgmma_runs(dev, head_dim: int, group: int) -> bool:
    """Whether the wgmma kernel can take this shape: a cc 9.0 device, its 64-row tile at
    head_dim, the head group within its rows."""
    return tuple(dev.cc) == (9, 0) and (WGMMA_ROWS, head_dim) in WGMMA_TILES and group <= WGMMA_ROWS


def _wgmma_fits(dev, head_dim: int, group: int, avg_qo_len: float) -> bool:
    """The policy's kernel choice: wgmma on Hopper for prompts of WGMMA_MIN_QO query tokens or
    more. Multi-token decode and short prompts (memory-bound: a few tokens per request) stay on
    mma.sync, whose 16-128-row tiles read a request's KV once for up to 128 fused rows."""
    return wgmma_runs(dev, head_dim, group) and avg_qo_len >= WGMMA_MIN_QO


def _require_sm90a(dev, mma: str) -> None:
    """The warpgroup kernels are sm_90a CUBINs: a cc 9.0 device only."""
    if tuple(dev.cc) != (9, 0):
        raise ValueError(f"prefill mma={mma!r} needs a cc 9.0 (sm_90a) device, not {dev.name} (cc {dev.cc})")


def _ws_fits(head_dim: int, group: int, avg_kv_len: float | None) -> bool:
    """The policy's choice between the warpgroup kernels, where it takes one (H200, docs/perf-log.md
    "prefill v7"): the warp-specialized kernel at WS_HEAD_DIMS, except at d128 with head groups of 2
    or more below WS_MIN_KV average KV tokens (None: unknown), where the 128-row kv32 tile at two
    CTAs per SM hides short items' prologues better (16x1024 32/8: 302 against 290 TFLOP/s)."""
    if head_dim not in WS_HEAD_DIMS:
        return False
    return head_dim != 128 or group == 1 or (avg_kv_len or 0) >= WS_MIN_KV


def _wgmma_tile(dev, head_dim: int, rows: int, paged: bool, tile_kv, stages, ctas_per_sm) -> PrefillTile:
    if (rows, head_dim) not in WGMMA_TILES:
        raise ValueError(f"the wgmma prefill kernel takes (rows, head_dim) in {sorted(WGMMA_TILES)}, "
                         f"got ({rows}, {head_dim})")
    kv, st = WGMMA_TILES[rows, head_dim]
    tile = PrefillTile(rows, tile_kv or kv, rows // 16, stages or st, paged, mma="wgmma")
    cap = wgmma_ctas_cap(rows, tile.tile_kv, head_dim)
    smem = _smem_checked(dev, tile, head_dim)
    if ctas_per_sm is not None and not 1 <= ctas_per_sm <= cap:
        raise ValueError(f"prefill ctas_per_sm={ctas_per_sm} for the wgmma kernel at {rows} rows, tile_kv "
                         f"{tile.tile_kv}: use 1 to {cap} (the register file: {65536 // (cap * tile.threads)} "
                         f"registers per thread at {cap})")
    blocks = resources.blocks_by_smem(dev, smem, ctas_per_sm or MAX_CTAS_PER_SM * 64 // rows)   # more: on request
    return replace(tile, min_blocks=blocks)


def _ws_tile(dev, head_dim: int, group: int, paged: bool, rows, tile_kv, stages, ctas_per_sm, fma_exp2) -> PrefillTile:
    """The warp-specialized kernel's tile: WS_TILES's at head_dim unless tile_kv / stages are given;
    one CTA per SM (its three warpgroups split the register file between them)."""
    _require_sm90a(dev, "ws")
    if head_dim not in WS_TILES or rows not in (None, WS_ROWS) or group > WS_ROWS:
        raise ValueError(f"the warp-specialized prefill kernel takes {WS_ROWS} rows (head group <= {WS_ROWS}) at "
                         f"head dims {sorted(WS_TILES)}, got rows={rows}, head_dim={head_dim}, group={group}")
    if ctas_per_sm not in (None, 1):
        raise ValueError(f"prefill ctas_per_sm={ctas_per_sm} for the warp-specialized kernel: it runs one CTA per SM")
    kv, st = WS_TILES[head_dim]
    tile = PrefillTile(WS_ROWS, tile_kv or kv, WS_WARPS, stages or st, paged, mma="ws", fma_exp2=bool(fma_exp2))
    _smem_checked(dev, tile, head_dim)
    return tile


def wgmma_ctas_cap(rows: int, tile_kv: int, head_dim: int) -> int:
    """CTAs per SM the wgmma kernel may be compiled for (__launch_bounds__), from the register
    file (64K per SM): 255 registers per thread at 2 x 128 or 1 x 256 threads. One more CTA fits
    where a warpgroup's accumulators per thread (S tile_kv / 2, P tile_kv / 4, O head_dim / 2
    registers) take at most WGMMA_SMALL_ACC, as at d128 with 32-token KV tiles (88) or d64 with 64
    (80): one warpgroup at 3 per SM (168 registers), two at 2 (128 registers). ptxas (d64/d128): no
    spill, but at 2 x 256 ALiBi (12/20 B) and the built-in soft_cap (8/4 B) spill outside the block
    loop at d128; the shared memory allows them at d <= 128 (d128, 3 stages: 64 / 80 KiB)."""
    if 3 * tile_kv // 4 + head_dim // 2 <= WGMMA_SMALL_ACC:
        return 3 if rows == 64 else 2
    return MAX_CTAS_PER_SM * 64 // rows


def tile_config(tile: PrefillTile, head_dim: int, group: int, ctas_per_sm: int | None = None) -> TileConfig:
    """The planner's view of a tile: tile_q query tokens per work item (rows // g)."""
    return TileConfig(tile_q=tile.rows // group, tile_kv=tile.tile_kv, max_rows=tile.rows, stages=tile.stages,
                      threads=tile.threads, smem_bytes=tile.smem_bytes(head_dim), kernel="prefill",
                      ctas_per_sm=ctas_per_sm or tile.min_blocks)


def shipped(arch: str = "sm_90") -> list[tuple[AttentionSpec, PrefillTile]]:
    """The prefill instances rtattn-compile warms: every built-in variant at head_dim 128 in both
    dtypes with the long-prompt tile of an unknown KV length (paged; on sm_90 the wgmma kernel's,
    on sm_80 128 rows of mma.sync), plus plain and causal at head_dims 64 and 256, and on sm_90 plain and causal at
    head_dim 128 with the long-KV tile (two warpgroups). Other tiles compile on first use (about
    2-3 s each)."""
    dev = resources.device_for_arch(arch)
    out = []
    for dtype in DTYPES:
        base, long = choose_tile(dev, 128, 4), choose_tile(dev, 128, 4, avg_kv_len=WGMMA_LONG_KV)
        for make in BUILTINS.values():
            spec = make(dtype=dtype, head_dim=128)
            out.append((spec, choose_tile(dev, 128, 4, linear_bias=spec.linear_bias)))
        if long != base:
            out += [(BUILTINS[name](dtype=dtype, head_dim=128), long) for name in ("plain", "causal")]
        for d in (64, 256):
            for name in ("plain", "causal"):
                out.append((BUILTINS[name](dtype=dtype, head_dim=d), choose_tile(dev, d, 4)))
    return out


def check_kv_strides(name: str, page_stride: int, token_stride: int, itemsize: int) -> None:
    """The prefill loader forms KV offsets as 32 x 32 -> 64-bit products (cuda_src/paged_loader.cuh):
    every launcher of the prefill kernel refuses a cache whose page or token stride (elements of
    `itemsize` bytes) is negative or 2**32 bytes or more."""
    if not (0 <= page_stride * itemsize < 2**32 and 0 <= token_stride * itemsize < 2**32):
        raise ValueError(f"{name}: page and token strides must be non-negative and under 2**32 bytes "
                         f"(the prefill loader's 32-bit offsets), got {page_stride} and {token_stride} elements")


# -default-device: the kernel's per-block body is a generic lambda (instantiated masked and
# unmasked), which NVRTC compiles only with unannotated functions taken as device functions.
PREFILL_OPTIONS = COMPILE_OPTIONS + ("-default-device",)


def instance_name(spec: AttentionSpec, tile: PrefillTile) -> str:
    return f"prefill_{spec.variant}_{spec.dtype}_d{spec.head_dim}_{tile.tag}"


def compile_prefill(spec: AttentionSpec, tile: PrefillTile, arch: str, quiet: bool | None = None) -> tuple[Rendered, bytes]:
    """Render and compile to CUBIN (through the on-disk cache); needs no GPU."""
    from rtattn.runtime import compile_to_cubin
    rendered = render_prefill(spec, tile)
    cubin = compile_to_cubin(rendered.source, name=instance_name(spec, tile), arch=tile.arch(arch),
                             options=PREFILL_OPTIONS + dev_defines(), quiet=quiet)
    return rendered, bytes(cubin)


class PrefillKernels(LoadedKernels):
    """The prefill (+ merge) kernels of one (spec, tile), loaded on one device."""

    def __init__(self, spec: AttentionSpec, tile: PrefillTile, device=None):
        from rtattn.runtime import Device
        self.spec, self.tile = spec, tile
        device = device or Device()
        rendered, cubin = compile_prefill(spec, tile, device.arch)
        super().__init__(rendered, cubin, rendered.attention_name, device)
        self.attention = self.kernel


@functools.lru_cache(maxsize=None)
def prefill_kernels(spec: AttentionSpec, tile: PrefillTile, device_ordinal: int = 0) -> PrefillKernels:
    """One loaded module per (spec, tile, device) per process."""
    from rtattn.runtime import Device
    return PrefillKernels(spec, tile, Device(device_ordinal))
