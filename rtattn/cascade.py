"""CascadeWrapper: shared-prefix (multi-level cascade) attention, planned once per step.

FlashInfer's MultiLevelCascadeAttentionWrapper conventions: level 0 holds the most widely
shared prefixes, deeper levels narrower ones, the last level each request's own suffix; each
level is a page table over groups of whole requests (qo_indptr, kv_indptr, kv_indices,
kv_last_page_len per level). Or give the plain page tables and `share_prefixes=True`: the
levels come from the requests' shared leading pages (rtattn.plan.prefix_tree).

plan() plans every level together (rtattn.plan.cascade) into one pinned plan set and issues
one host-to-device copy. A shared group is one "request" whose queries are all its requests',
so its KV is read once per query tile; groups shared by more queries than a decode tile holds
run on the prefill family's tensor-core tiles (up to 128 fused rows: 32 queries at 32/8 heads), the
rest on the decode kernel (rtattn.plan.cascade.prefill_groups is the rule). run() enqueues one
launch list (PDL): the persistent prefill kernel, the persistent decode kernel (which reads
nothing the prefill kernel writes, so it runs concurrently: it waits for that grid only before
exiting), and the fold kernel that combines each query's level states with ⊕ into the output
and LSE -- or the list the plan needs (launch_list(): no prefill kernel where nothing is on its
tiles; the flat plan's decode and merge kernels; the prefill kernel and a decode build that
joins its states, with no fold). Every kernel
has a fixed grid and reads only fixed workspace addresses, so a captured graph
(rtattn.graphs.StepGraph) replays across replans, requests joining and leaving shared
prefixes included.

Variants: plain, causal, sliding window, soft-cap, ALiBi and sigmoid (or an AttentionSpec of
StandardAttention or SigmoidAttention). Positions are absolute on every level (window, ALiBi
and causal masks see a query's real position; cuda_src/level_positions.cuh); causal
attention needs each query's own position in the last level. LSE is natural-log, as
everywhere in rtattn.
"""
from __future__ import annotations

import ctypes
import functools
import math
import re
from dataclasses import replace

import numpy as np

from rtattn.codegen.cstruct import FieldWriter
from rtattn.codegen.spec import BUILTINS, AttentionSpec, Param, max_m_tiles
from rtattn.families import choice, decode as decode_family
from rtattn.families.prefill import MMAS, ROWS as PREFILL_ROWS, WGMMA_ROWS, check_kv_strides, choose_tile, wgmma_runs
from rtattn.families.prefill import prefill_kernels, tile_config
from rtattn.level_fold import CTAS_PER_SM, THREADS, fold_function, params_struct
from rtattn.plan import devices as plan_devices
from rtattn.plan.cascade import PREFILL_MIN_SAVING_US, CascadeInfo, CascadePlanner
from rtattn.plan.fields import FIELD_NAMES, align_up
from rtattn.plan.inspector import Planner
from rtattn.plan.levels import Level, check_against_requests
from rtattn.plan.prefix_tree import share_prefixes as levels_from_page_tables
from rtattn.runtime import DeviceBuffer, Event, PinnedBuffer, export, memcpy_htod_async
from rtattn.runtime import launch as launch_path
from rtattn.runtime.launch import KernelCall, Launch, Params
from rtattn import wrapper as W
from rtattn.wrapper import BatchDecodeWrapper
from rtattn.wrapper_base import host_array as _host

CASCADE_VARIANTS = ("plain", "causal", "sliding_window", "soft_cap", "alibi", "sigmoid")
# Row tiles of the decode builds whose items are one query each -- the joining build (join_levels)
# and the flat plan's: 1 where the head group fits 16 rows, the build that reads its next item's
# fields and query during the current one (cuda_src/decode.cuh kPrefetch), as rtattn's single
# format runs such items. H200, 32/8 d128 (docs/perf-log.md "Cascade v7", the wrapper at m_tiles
# 1 against 2, joined plans): p8192x16 27.3 vs 29.3 us, p8192x64 45.6 vs 50.5, p32768x16 53.4 vs
# 55.3, p32768x64 108.4 vs 112.7. The concurrent build at one row tile where every decode item is
# one query (single_query_build; launch list "prefill-q1"), the same plans (docs/perf-log.md
# "casc8", rt-cm1 against rt-casc, us): nb-4Kx128-q64k8 103.1 vs 113.9, nb-16Kx32-q32k4 47.4 vs
# 54.0, nb-16Kx8-q64k8 38.7 vs 42.0, nb-2Kx128-q32k4 46.3 vs 51.9, nb-4Kx32-q64k8 38.1 vs 43.2.
ONE_QUERY_M_TILES = 1
_STANDARD = re.compile(r"^rtattn::StandardAttention<([a-z, ]+)>$")
# Launch list (CascadeWrapper.launch_list) -> its kernels in launch order; "-narrow": the same
# calls, the prefill kernel on the narrow grid (CascadePlanner.prefill_narrow).
# "prefill-q1": the prefill list with the levels' decode build at one row tile (ONE_QUERY_M_TILES),
# for plans whose decode items are single queries (CascadeInfo.one_query).
LAUNCH_LISTS = {"levels": ("decode", "fold"), "flat": ("decode", "merge"), "prefill": ("prefill", "decode", "fold"),
                "prefill-q1": ("prefill", "decode", "fold"), "join": ("prefill", "decode")}
LAUNCH_LISTS.update({f"{name}-narrow": LAUNCH_LISTS[name] for name in ("prefill", "prefill-q1", "join")})
PREFILL_LISTS = {name for name, kernels in LAUNCH_LISTS.items() if "prefill" in kernels}
FOLD_LISTS = {name for name, kernels in LAUNCH_LISTS.items() if "fold" in kernels}
POSITION_PARAMS = (Param("cascade_q_pos", "const int32_t*"), Param("cascade_kv_offset", "const int32_t*"))


def level_spec(base: AttentionSpec) -> tuple[AttentionSpec, bool, bool]:
    """(the spec the levels' kernel compiles, whether the fold is a softmax fold, whether the
    variant is causal). A variant whose hooks read positions (causal, window, ALiBi) is
    wrapped in LevelPositions. The flags are read from the variant's C++ type (what the
    kernel compiles); the spec's plan-clipping properties, where it has them, are turned off:
    a level's KV range is not the request's, the kernel's masks see the real positions."""
    if base.variant_type == "rtattn::SigmoidAttention":
        return base, False, False
    m = _STANDARD.match(base.variant_type)
    if m is None:
        raise ValueError(f"variant {base.variant!r} ({base.variant_type}) is not supported across cascade levels: "
                         f"use one of {CASCADE_VARIANTS} or an AttentionSpec of StandardAttention/SigmoidAttention "
                         f"(RoPE and custom masks index KV by position within a level)")
    causal, window, _, alibi, *more = (x.strip() == "true" for x in m.group(1).split(","))
    if any(more):
        raise ValueError(f"variant {base.variant!r}: attention sinks are not supported across cascade levels "
                         f"(a sink joins each row's softmax once; the fold would count it once per level)")
    unclipped = {k: False for k in ("causal", "window") if hasattr(base, k)}
    if not (causal or window or alibi):
        return base.with_(**unclipped), True, False
    return base.with_(variant=base.variant + "_levels", variant_type=f"rtattn::LevelPositions<{base.variant_type}>",
                      params=base.params + POSITION_PARAMS, variant_source='#include "level_positions.cuh"',
                      **unclipped), True, causal


def shared_prefill_mma(device: plan_devices.Device, head_dim: int, group: int, mma: str = "auto") -> str:
    """The prefill kernel of the shared levels: `mma` "auto" is the family's sm_90a wgmma kernel
    where it runs (cc 9.0, its 64-row tile at head_dim, the head group in its rows: on the H200
    it measured faster than mma.sync as a shared level on every prefix row, docs/perf-log.md
    "Cascade v6"), else "sync"; "sync" / "wgmma" as given (choose_tile refuses a wgmma it cannot
    build)."""
    if mma not in ("auto",) + MMAS:
        raise ValueError(f"prefill_mma must be 'auto' or one of {MMAS}, got {mma!r}")
    if mma != "auto":
        return mma
    return "wgmma" if wgmma_runs(device, head_dim, group) else "sync"


def shared_prefill_tile(device: plan_devices.Device, head_dim: int, group: int, page_size: int, max_queries: int,
                        mma: str = "auto"):
    """The prefill family's tile for shared groups: its policy for a group of `max_queries`
    queries (the most one group can hold: every query of the step), i.e. the smallest tile that
    holds them, at most 128 fused rows -- 16 decode queries at 32/8 fill 64 rows, and a 128-row
    tile would spend half its MMAs on padding. `mma`: the kernel (shared_prefill_mma) -- on
    "wgmma" its 64-row tile (one warpgroup), or at head_dim 128 its 128-row tile where the group
    fills more (the family's own policy, WGMMA_POLICY, takes 128 rows at d64 and d256 too; the
    shared levels keep 64 there). By default ("auto") those 128 rows run on the warp-specialized
    kernel ("ws"), which measured faster there wherever the prefix is long (H200, docs/perf-log.md
    session 14: p32768x64 111.2 -> 101.5 us, nb-4Kx128-q64k8 99.5 -> 96.5, p8192x64 46.3 -> 44.7,
    nb-16Kx32-q32k4 47.1 -> 45.3; p1024x64 27.0 -> 28.2, the rest within 0.3) and slower on the
    half-filled 128 rows of 16 queries (p8192x16 22.0 -> 24.9: they keep the 64-row wgmma tile).
    None where the family cannot serve: pages past 128 tokens, a
    head group past its rows. Its KV copies are evict-first (kv_evict_first) on the sync and wgmma
    kernels: a shared level reads each prefix block once per query tile, once where one tile holds
    the group (H200, wgmma: p32768x16 52.7 -> 50.0 us, no cascade row slower; docs/perf-log.md
    session 11)."""
    auto, mma = mma == "auto", shared_prefill_mma(device, head_dim, group, mma)
    if page_size > 128 or group > PREFILL_ROWS[-1]:
        return None
    if mma == "wgmma":
        rows = 128 if max_queries * group > WGMMA_ROWS and head_dim == 128 else WGMMA_ROWS
        if auto and rows == 128:   # (the warp-specialized kernel: see above)
            return choose_tile(device, head_dim, group, max_queries, mma="ws")
        tile = choose_tile(device, head_dim, group, max_queries, mma=mma, rows=rows)
    else:
        tile = choose_tile(device, head_dim, group, max_queries, mma=mma)
    return tile if tile.mma == "ws" else replace(tile, kv_evict_first=True)


def shared_level_ctas_per_sm(tile, ctas_per_sm: int | None = None) -> int:
    """The shared level's prefill CTAs per SM, which sizes its grid (one resident wave):
    `ctas_per_sm` as given (1 to the tile's min_blocks), or None: the tile's min_blocks. Fewer
    than the tile allows leaves each SM a slot where the decode level's CTAs run beside the
    shared level (the concurrent and joining decode builds start as soon as they find a slot)."""
    if ctas_per_sm is None:
        return tile.min_blocks
    if isinstance(ctas_per_sm, bool) or not isinstance(ctas_per_sm, int) or not 1 <= ctas_per_sm <= tile.min_blocks:
        raise ValueError(f"prefill_ctas_per_sm must be an int from 1 to {tile.min_blocks} (the shared tile "
                         f"{tile.tag}'s CTAs per SM) or None, got {ctas_per_sm!r}")
    return ctas_per_sm


def fits_beside(device: plan_devices.Device, tile, head_dim: int, decode_spec: AttentionSpec) -> bool:
    """Whether the narrow grid buys an overlap: the device launches the decode kernel while the
    prefill kernel runs (programmatic dependent launch, cc 9.0 on), the shared tile runs two
    CTAs per SM (so one per SM leaves a slot) and one CTA of the levels' decode build
    (`decode_spec`) fits beside one of its CTAs in an SM's shared memory. (The registers fit:
    both kernels are compiled for two CTAs per SM of 128 threads, at most 32K registers a CTA,
    or one of 256 at 128 registers.) d128 at 32/8: 112 + 105.5 KiB; d256's decode build alone
    takes 206 KiB."""
    need = tile.smem_bytes(head_dim) + decode_family.smem_bytes(decode_spec) + 2 * device.smem_reserved_per_block
    return tuple(device.cc) >= (9, 0) and tile.min_blocks > 1 and need <= device.smem_per_sm


def takes_narrow_grid(device: plan_devices.Device, tile, head_dim: int, decode_spec: AttentionSpec,
                      ctas_per_sm: int | None = None, concurrent_levels: bool = True, pdl: bool = True) -> bool:
    """Whether CascadeWrapper gives the shared level the narrow grid too (CascadePlanner's
    prefill_narrow, for short one-prefix plans): only by default (`ctas_per_sm` None: an int
    fixes the grid for every plan), with the decode level launched beside the prefill level
    (`concurrent_levels`, `pdl`) and where its CTAs fit there (fits_beside)."""
    return ctas_per_sm is None and concurrent_levels and pdl and fits_beside(device, tile, head_dim, decode_spec)


OUT_MEMBERS = ("o", "o_stride_tok", "o_stride_head", "lse")
OUT_MEMBERS_BYTES = 8 * len(OUT_MEMBERS)   # 8-byte members


def _out_members_at(cstruct) -> int:
    """Byte offset of the output members (OUT_MEMBERS, adjacent) in a packed struct."""
    ct = cstruct.ctypes_type()
    at = [getattr(ct, m).offset for m in OUT_MEMBERS]
    if [b - a for a, b in zip(at, at[1:])] != [8] * (len(OUT_MEMBERS) - 1):
        raise AssertionError(f"{cstruct.name}: {OUT_MEMBERS} are not adjacent 8-byte members")
    return at[0]


def shared_group_rule(num_qo_heads: int, num_kv_heads: int, head_dim: int, prefill_rows: int):
    """(qo, kv) -> predicted us a shared group saves on prefill tiles of `prefill_rows` fused rows
    (the shared tile's) over decode tiles (the family cost rule, rtattn.families.choice),
    remembered: the cascade planner asks it per shared group per plan()."""
    return functools.lru_cache(maxsize=256)(
        functools.partial(choice.shared_group_saving_us, num_qo_heads, num_kv_heads, head_dim,
                          prefill_rows=prefill_rows))


def default_m_tiles(group: int, head_dim: int) -> int:
    """CascadeWrapper's m_tiles default: two row tiles up to head_dim 128, else the fewest the group needs."""
    return max(decode_family.m_tiles_for(group), max_m_tiles(head_dim))


def shared_level_kw(device: plan_devices.Device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    page_size: int, max_queries: int, mma: str = "auto", ctas_per_sm: int | None = None) -> dict:
    """CascadePlanner.create's prefill arguments as CascadeWrapper(prefill="auto") plans with
    them (the tools that plan without a GPU: rtattn-inspect, bench_cascade --plan): the shared
    tile, the cost rule, its kernel's PREFILL_MIN_SAVING_US, join_levels and the narrow grid (the
    wrapper's defaults; `ctas_per_sm` as its prefill_ctas_per_sm); {} where the family cannot serve."""
    group = num_qo_heads // num_kv_heads
    tile = shared_prefill_tile(device, head_dim, group, page_size, max_queries, mma)
    if tile is None:
        return {}
    levels = decode_family.builtin(BUILTINS["plain"], f"sm_{device.cc[0]}{device.cc[1]}", head_dim=head_dim,
                                   m_tiles=default_m_tiles(group, head_dim))
    return dict(prefill_tile=tile_config(tile, head_dim, group, shared_level_ctas_per_sm(tile, ctas_per_sm)),
                join_levels=True, narrow_prefill=takes_narrow_grid(device, tile, head_dim, levels, ctas_per_sm),
                **_tile_rules(tile, num_qo_heads, num_kv_heads, head_dim))


def _tile_rules(tile, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """CascadePlanner's cost test for shared groups on the prefill `tile` (shared_group_rule)
    and what a saving must beat there (its kernel's PREFILL_MIN_SAVING_US)."""
    return dict(prefill_saving_us=shared_group_rule(num_qo_heads, num_kv_heads, head_dim, tile.rows),
                prefill_min_saving_us=PREFILL_MIN_SAVING_US[tile.mma])


def flat_rule(flat, num_qo_heads: int, num_kv_heads: int, head_dim: int):
    """The cascade planner's flat-or-levels test for `flat` ("auto": the cost rule,
    rtattn.families.choice.flat_saving_us; True: flat wherever it fits; False: never)."""
    if flat == "auto":
        return functools.partial(choice.flat_saving_us, num_qo_heads, num_kv_heads, head_dim)
    return (lambda batch, prefix_tokens, tile_q: math.inf) if flat else None


class _LevelsKernel(BatchDecodeWrapper):
    """The decode family running every level of a cascade plan: a BatchDecodeWrapper whose
    workspace is the cascade's (plan set, then the float32 level states) and whose partial
    rows are those states. Its plan() is not used: the cascade plans."""

    folds_chunks = False   # one state per item: the cascade's state rows (fixed batch-invariant chunks)

    def __init__(self, *args, max_batch, max_qo_tokens, num_levels, cascade_kw: dict, **kw):
        # cascade_kw: CascadePlanner's keyword arguments (its prefill planner and rules)
        self._cascade_bounds, self._cascade_kw = (max_batch, max_qo_tokens, num_levels), cascade_kw
        super().__init__(*args, max_batch=max_batch * num_levels, max_qo_tokens=max_qo_tokens * num_levels, **kw)
        self._may_split = False   # its launch is the decode kernel alone: the cascade's fold merges

    def _workspace(self, workspace):
        # Called by BatchDecodeWrapper.__init__ once its planner exists: the cascade planner
        # wraps it (and the prefill family's planner), and the workspace holds
        # [plan set | state O | state LSE].
        self.cascade = CascadePlanner(self.planner, *self._cascade_bounds, **self._cascade_kw)
        rows, H, D = self.cascade.max_state_rows, self.num_qo_heads, self.head_dim
        self.state_o_offset = align_up(self.cascade.planset.plan_bytes)
        self.state_lse_offset = align_up(self.state_o_offset + rows * H * D * 4)
        need = max(align_up(self.state_lse_offset + rows * H * 4), self.planner.workspace_bytes())
        if workspace is not None:
            raise ValueError("CascadeWrapper allocates its own workspace")
        return DeviceBuffer(need, self.device)

    def _cache_fields(self, name, t):
        fields = super()._cache_fields(name, t)   # (pages, name, shape, ptr, page, token, head strides)
        if self.cascade.prefill is not None:      # the prefill kernel reads these caches too
            check_kv_strides(name, fields[4], fields[5], t.itemsize)
        return fields

    def _fixed_params(self) -> dict:
        fixed = super()._fixed_params()
        fixed.update(partial_o=self.workspace_ptr + self.state_o_offset,
                     partial_lse=self.workspace_ptr + self.state_lse_offset, fused_merge=0)
        return fixed

    def _extra(self, params: dict, stream) -> dict:
        """The user's variant parameters, plus the level positions (plan set arrays) for a
        LevelPositions variant."""
        params = params or {}
        names = {p.name for p in self.spec.params}
        if "cascade_q_pos" not in names:
            return super()._extra(params, stream)
        mine = {p.name for p in POSITION_PARAMS}
        if mine & set(params):
            raise ValueError(f"params {sorted(mine & set(params))} are the cascade's own (the plan's positions)")
        ptrs = self.cascade.planset.device_ptrs(self.workspace_ptr)
        c = self.cascade
        pos = dict(cascade_q_pos=export(ptrs["q_pos"], (c.max_qo_tokens,), "int32", self.device.ordinal),
                   cascade_kv_offset=export(ptrs["kv_offset"], (c.planner.bounds.max_batch,), "int32",
                                            self.device.ordinal))
        return super()._extra(dict(params, **pos), stream)


class CascadeWrapper:
    """Multi-level cascade attention over a paged KV cache.

    CascadeWrapper(num_levels, H_qo, H_kv, D, page_size, max_batch=..., max_pages=...,
                   max_qo_tokens=None, variant="plain", dtype="bfloat16", kv_layout="NHD",
                   mode="auto", m_tiles=None, num_ctas=None, pdl=True, prefill="auto",
                   concurrent_levels=True, flat="auto", join_levels=True, prefill_mma="auto",
                   prefill_ctas_per_sm=None)

    `max_pages` bounds the pages of all levels together (a shared page counts once);
    `max_qo_tokens` the query rows (default max_batch: decode). `m_tiles` (16-row query
    tiles per decode work item, 1 or 2) sets how many queries share one read of a prefix on
    the decode kernel: default 2 where the kernel has it (head_dim <= 128), else the fewest
    the head group needs (default_m_tiles).
    `prefill` (default "auto"): a group shared by more queries than a decode work item holds
    runs on the prefill family's tiles (page sizes up to 128) where the family cost rule
    predicts it saves more than its kernel's PREFILL_MIN_SAVING_US, less JOIN_SAVING_US where the
    plan joins its levels (rtattn.plan.cascade: long prefixes, or prefixes of many requests on
    the wgmma kernel); True: every such group on prefill tiles; False: every group on decode.
    The prefill tile is the smallest that holds max_qo_tokens queries (64 fused rows for 16
    decode queries at 32/8), at most 128 rows.
    `num_ctas` is the decode kernel's grid; the prefill kernel's is its own resident wave.
    `concurrent_levels` (default True; False: the A/B): with a prefill kernel, the decode
    kernel runs concurrently with it instead of after it.
    `flat` (default "auto"): share_prefixes steps of decode requests over one prefix that stays
    on decode tiles are planned flat (each request's whole page list, one level: the decode and
    merge kernels, no fold) where rtattn.families.choice.flat_saving_us predicts it faster and
    the page lists fit max_pages; True: flat wherever it fits; False: never. H200 (docs/perf-log.md
    "v16", the one-row-tile build, ONE_QUERY_M_TILES): "auto" against False 15.4 / 17.0 us at
    p1024x16, 15.1 / 16.4 at nb-2Kx8-q32k4, 25.2 / 27.9 at nb-2Kx32-q28k4, within 0.3 % on the
    other 12 rows of bench_cascade (the v5 flat plan, on the two-row-tile build, had lost).
    `join_levels` (default True; needs concurrent levels; False: the A/B): one-prefix plans on
    prefill tiles whose suffix rows are one decode item each skip the fold kernel: the decode
    kernel joins each row's prefix states before writing it (H200: 0.2-3.0 us faster than the
    fold on 5 of the 6 prefix rows, docs/perf-log.md "Cascade v6").
    `prefill_mma` (default "auto": the prefill family's sm_90a kernels on cc 9.0 where their
    tiles fit -- the warp-specialized one for 128-row shared tiles, wgmma for 64 -- else the
    mma.sync kernel; shared_prefill_mma, shared_prefill_tile): "sync", "wgmma" or "ws" forces one.
    `prefill_ctas_per_sm`: the shared level's prefill CTAs per SM, i.e. its grid
    (shared_level_ctas_per_sm); fewer than the tile allows leaves each SM a slot for the decode
    level's CTAs, which then run beside the shared level instead of after it. Default None: as
    many as the tile allows, and on a two-CTA tile one for one-prefix plans of at most
    rtattn.plan.cascade.NARROW_MAX_PREFIX_TOKENS (their own launch lists, "-narrow"); an int
    fixes it for every plan.
    `prefill_ctas` (default None: the resident wave of prefill_ctas_per_sm): the shared level's
    CTAs per KV head; fewer leave whole SMs to the decode level's CTAs (no narrow grid then).
    `single_query_build` (default True; False: the A/B): a plan with prefill tiles whose decode
    items are all single queries runs the concurrent decode build at one row tile
    (ONE_QUERY_M_TILES; launch list "prefill-q1"), as the joining build does.
    `join_uneven` (default False; an A/B): one-prefix plans whose suffixes differ in length (the
    general path) join too where each suffix is one decode item; `join_unsplit` (default False):
    ... and their suffixes are scheduled unsplit so that they are. H200 (docs/perf-log.md "v16"):
    both slower on nb-4Kx128-q64k8 (108.7 / 108.6 against 103.6 us) and nb-2Kx128-q32k4, join_unsplit
    faster on nb-4Kx32-q64k8 (35.9 against 38.2): no rule picks them yet.
    `leave_early` (default True; False: the A/B): the concurrent decode build's CTAs but (0, 0)
    leave after their items instead of waiting for the prefill grid, so later decode CTAs take
    their slots while the shared level runs (codegen spec `leave_early`; the grid still completes
    after the prefill grid, through CTA (0, 0)'s wait). H200 (docs/perf-log.md session 14, with
    the ws shared tile): nb-4Kx128-q64k8 96.5 -> 95.6 us, nb-4Kx32-q64k8 38.5 -> 37.8, never
    slower beyond 0.4 us (this call's spread) on the lists it applies to.
    The launch list follows each plan (launch_list()).
    """

    def __init__(self, num_levels: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 max_batch: int, max_pages: int, max_qo_tokens: int | None = None, variant="plain",
                 dtype: str = "bfloat16", kv_layout: str = "NHD", mode: str = "auto", m_tiles: int | None = None,
                 num_ctas: int | None = None, pdl: bool = True, num_pages_pool: int | None = None, device=None,
                 prefill: bool | str = "auto", concurrent_levels: bool = True, flat: bool | str = "auto",
                 join_levels: bool = True, prefill_mma: str = "auto", prefill_ctas_per_sm: int | None = None,
                 prefill_ctas: int | None = None, leave_early: bool = True, single_query_build: bool = True,
                 join_uneven: bool = False, join_unsplit: bool = False):
        if prefill not in (True, False, "auto"):
            raise ValueError(f"prefill must be 'auto', True or False, got {prefill!r}")
        if flat not in (True, False, "auto"):
            raise ValueError(f"flat must be 'auto', True or False, got {flat!r}")
        if prefill_ctas_per_sm is not None and (isinstance(prefill_ctas_per_sm, bool) or
                                                not isinstance(prefill_ctas_per_sm, int) or prefill_ctas_per_sm < 1):
            raise ValueError(f"prefill_ctas_per_sm must be an int from 1 to the shared tile's CTAs per SM, or None; "
                             f"got {prefill_ctas_per_sm!r}")
        if prefill_ctas is not None and (isinstance(prefill_ctas, bool) or not isinstance(prefill_ctas, int)
                                         or prefill_ctas < 1):
            raise ValueError(f"prefill_ctas must be a positive int (the shared level's CTAs per KV head) or None, "
                             f"got {prefill_ctas!r}")
        for name, value in (("concurrent_levels", concurrent_levels), ("join_levels", join_levels),
                            ("leave_early", leave_early), ("single_query_build", single_query_build),
                            ("join_uneven", join_uneven), ("join_unsplit", join_unsplit)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if not isinstance(num_levels, int) or num_levels < 1:
            raise ValueError(f"num_levels must be a positive int, got {num_levels!r}")
        group = num_qo_heads // max(num_kv_heads, 1)
        need = decode_family.m_tiles_for(group)   # the fewest row tiles the head group needs
        if m_tiles is None:
            m_tiles = default_m_tiles(group, head_dim)
        if m_tiles not in (1, 2) or m_tiles < need:
            raise ValueError(f"m_tiles={m_tiles}: use 1 or 2, at least {need} for a head group of {group}")
        if isinstance(variant, AttentionSpec):
            base = variant.with_(m_tiles=m_tiles)
        elif variant in CASCADE_VARIANTS:
            base = decode_family.builtin(BUILTINS[variant], W.current_device(device).arch, dtype=dtype,
                                         head_dim=head_dim, m_tiles=m_tiles)
        else:
            raise ValueError(f"variant {variant!r} is not supported across cascade levels; use one of "
                             f"{CASCADE_VARIANTS} or an AttentionSpec")
        spec, self.softmax, self.causal = level_spec(base)
        self.base_spec = base
        self.num_levels = num_levels
        self.max_qo_tokens = max_qo_tokens or max_batch
        dev = plan_devices.from_props(W.current_device(device).props)
        shared_prefill_mma(dev, head_dim, group, prefill_mma)   # (refused before anything is built)
        tile = shared_prefill_tile(dev, head_dim, group, page_size, self.max_qo_tokens, prefill_mma) if prefill else None
        pp = narrow = None
        if tile is not None:   # the prefill family's planner: its tile, its grid (shared_level_ctas_per_sm)
            def shared_planner(ctas_per_sm, num_ctas=None):
                return Planner(max_batch * num_levels, self.max_qo_tokens * num_levels, max_pages, num_qo_heads,
                               num_kv_heads, head_dim, page_size, device=dev, mode=mode,
                               tile=tile_config(tile, head_dim, group, ctas_per_sm), num_ctas=num_ctas)
            per_sm = shared_level_ctas_per_sm(tile, prefill_ctas_per_sm)
            wave = dev.sm_count * per_sm // num_kv_heads   # (one resident wave: a larger grid would not be resident)
            if prefill_ctas is not None and prefill_ctas > wave:
                raise ValueError(f"prefill_ctas={prefill_ctas} exceeds the shared tile's resident wave of {wave} "
                                 f"CTAs per KV head ({per_sm} per SM)")
            pp = shared_planner(per_sm, prefill_ctas)
            if pp.tile_q <= max(1, spec.rows // group):   # (CascadePlanner's test: no group could need it)
                tile = pp = None
            elif prefill_ctas is None and takes_narrow_grid(dev, tile, head_dim, spec, prefill_ctas_per_sm,
                                                             concurrent_levels, pdl):
                narrow = shared_planner(1)   # short one-prefix plans: the decode CTAs beside (NARROW_MAX_PREFIX_TOKENS)
        # With a prefill kernel the launch list is prefill, decode, fold; the decode kernel reads
        # nothing the prefill kernel writes, so (concurrent_levels) it runs alongside it
        # (codegen spec `independent`: no wait at entry, one before exiting).
        self.concurrent_levels = concurrent_levels and pp is not None
        cascade_kw = dict(prefill=pp, flat_saving_us=flat_rule(flat, num_qo_heads, num_kv_heads, head_dim),
                          join_levels=join_levels and self.concurrent_levels, prefill_narrow=narrow,
                          join_uneven=join_uneven, join_unsplit=join_unsplit)
        if pp is not None:
            cascade_kw.update(_tile_rules(tile, num_qo_heads, num_kv_heads, head_dim))
            if prefill is True:   # every group past decode's tile on prefill tiles: no cost test
                cascade_kw["prefill_saving_us"] = None
        self.kernel = _LevelsKernel(num_qo_heads, num_kv_heads, head_dim, page_size, max_batch=max_batch,
                                    max_pages=max_pages, max_qo_tokens=self.max_qo_tokens, num_levels=num_levels,
                                    variant=spec.with_(independent=self.concurrent_levels,
                                                       leave_early=leave_early and self.concurrent_levels), dtype=dtype,
                                    kv_layout=kv_layout, mode=mode, pdl=pdl, num_ctas=num_ctas,
                                    num_pages_pool=num_pages_pool, device=device, cascade_kw=cascade_kw)
        k = self.kernel
        if (k.cascade.prefill is None) != (pp is None):
            raise AssertionError("CascadePlanner and CascadeWrapper disagree on the prefill kernel")
        self.device, self.spec, self.page_size, self.dtype = k.device, k.spec, page_size, dtype
        self.num_qo_heads, self.head_dim = num_qo_heads, head_dim
        self.planner = k.cascade
        # The prefill kernel (when the planner may use it) reads the kernels' one Params struct
        # (same spec: same layout) with its own plan pointers.
        self.prefill = None
        if self.planner.prefill is not None:
            self.prefill_tile = tile
            self.prefill = prefill_kernels(k.spec.with_(independent=False, leave_early=False), tile, self.device.ordinal)
            ptrs = self.planner.kernel_plan_ptrs(k.workspace_ptr)["prefill"]
            self._prefill_ptrs = tuple(ptrs[f] for f in FIELD_NAMES)
            self._write_prefill_ptrs = FieldWriter(k.kernels.rendered.params, [f"plan.{f}" for f in FIELD_NAMES])
        # The fold's arguments: fixed but for the output (o, its strides, lse), which it copies from
        # the decode kernel's arguments (the same members in the same order in both structs).
        ws, ptrs = k.workspace_ptr, self.planner.planset.device_ptrs(k.workspace_ptr)
        fs = params_struct(dtype)
        self._fold_template = fs.pack(
            state_o=ws + k.state_o_offset, state_lse=ws + k.state_lse_offset, o=0, o_stride_tok=0, o_stride_head=0,
            lse=0, fold_indptr=ptrs["fold_indptr"], fold_rows=ptrs["fold_rows"], fold_info=ptrs["fold_info"],
            num_qo_heads=num_qo_heads)
        self._fold_out_at = _out_members_at(fs)
        self._out_at = _out_members_at(k.kernels.rendered.params)
        # A plan with nothing on prefill tiles launches no prefill kernel; a concurrent decode
        # kernel (no wait at entry: it relies on the prefill kernel's) then runs as its plain
        # build, which waits for the step's inputs itself (same spec but the flag: same Params).
        self._alone = self._decode_build(k.spec.with_(independent=False, leave_early=False), "plain") \
            if self.concurrent_levels \
            else k.kernels
        # join_levels: one-prefix plans on prefill tiles whose suffix rows are one decode item each
        # need no fold kernel: the decode kernel's level_join build joins the prefix's states
        # into each row before writing it (the planner numbers the states for it). Its items, and
        # the flat plan's (flat: one request each), are single queries: those builds hold the
        # fewest row tiles their head group needs (ONE_QUERY_M_TILES).
        one_query = min(k.spec.m_tiles, max(need, ONE_QUERY_M_TILES))
        self._join = self._decode_build(k.spec.with_(level_join=True, leave_early=False, m_tiles=one_query), "joining") \
            if self.planner.join_levels else None
        # single_query_build: a plan with prefill tiles whose decode items are all single queries (the
        # suffix level beside a shared prefix) runs the concurrent build at that row tile too ("-q1").
        self._one = self._decode_build(k.spec.with_(m_tiles=one_query), "one-query") \
            if self.concurrent_levels and single_query_build and one_query != k.spec.m_tiles else None
        self._flat = self._decode_build(k.spec.with_(independent=False, leave_early=False, m_tiles=one_query), "flat") \
            if flat is not False and one_query != k.spec.m_tiles else self._alone
        self._eager: CascadeLaunch | None = None
        # The plan set in two pinned buffers, used in turn (as BatchDecodeWrapper's plans).
        nbytes = self.planner.planset.plan_bytes
        self._pinned = tuple(PinnedBuffer(nbytes, self.device) for _ in range(2))
        self._arrays = tuple(b.array for b in self._pinned)
        self._copied = tuple(Event(timing=False, device=self.device) for _ in range(2))
        self._in_flight = [False, False]
        self._slot = 0
        self.fold_ctas = self.device.props.sm_count * CTAS_PER_SM
        self.info: CascadeInfo | None = None

    def _decode_build(self, spec: AttentionSpec, what: str):
        """Another build of the levels' decode kernel (`spec`: a flag apart), which must read the
        same Params struct: its calls take the levels' arguments."""
        kernels = W.decode_kernels(spec, self.device.ordinal)
        if kernels.rendered.params.c_source() != self.kernel.kernels.rendered.params.c_source():
            raise AssertionError(f"the {what} and the levels' decode builds disagree on the Params struct")
        return kernels

    @property
    def workspace_ptr(self) -> int:
        return self.kernel.workspace_ptr

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr, *,
             share_prefixes: bool = False, requests=None, stream=None) -> CascadeInfo:
        """Plan one step from host arrays.

        Levels given (FlashInfer's convention): one array per level in each argument, the last
        level the requests. `requests=(kv_indptr, kv_indices, kv_last_page_len)`, if given, is
        checked against the levels (each request's pages over the levels must be its own).

        share_prefixes=True: the arguments are ONE page table (qo_indptr may be None: decode)
        and the levels are built from the requests' shared leading pages, at most num_levels.

        Page ids must lie in the KV pool (`num_pages_pool`, else learnt from the caches run()
        has seen, as BatchDecodeWrapper does). The copy is queued on `stream`; run() on the
        same stream."""
        levels = None
        if share_prefixes:
            plain = [None if qo_indptr_arr is None else _host(qo_indptr_arr),
                     _host(kv_indptr_arr), _host(kv_indices_arr), _host(kv_last_page_len_arr)]
        else:
            arrs = (qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr)
            names = ("qo_indptr_arr", "kv_indptr_arr", "kv_indices_arr", "kv_last_page_len_arr")
            for name, a in zip(names, arrs):
                if not isinstance(a, (list, tuple)):
                    raise TypeError(f"{name} must be a list with one array per level (or pass share_prefixes=True "
                                    f"with one page table), got {type(a).__name__}")
                if len(a) != len(arrs[0]):
                    raise ValueError(f"{name} has {len(a)} levels, qo_indptr_arr {len(arrs[0])}")
            levels = [Level(*(_host(a[l]) for a in arrs)) for l in range(len(arrs[0]))]
            if requests is not None:
                check_against_requests(levels, *(_host(a) for a in requests), self.page_size)
        slot = self._slot
        if self._in_flight[slot]:   # this buffer's copy (two plans ago) may not have run yet
            self._copied[slot].synchronize()
        pool = self.kernel.planner.num_pages_pool
        if levels is None:
            info = self.planner.plan_shared(*plain, out=self._arrays[slot], causal=self.causal, num_pages=pool)
        else:
            info = self.planner.plan(levels, out=self._arrays[slot], causal=self.causal, num_pages=pool)
        memcpy_htod_async(self.workspace_ptr, self._pinned[slot].ptr, self.planner.planset.plan_bytes, stream,
                          self.device)
        self._copied[slot].record(stream)
        self._in_flight[slot] = True
        self._slot = slot ^ 1
        k = self.kernel
        k.info, k._nnz = info.plan, info.num_pages   # what its run() checks the caches against
        self.info = info
        return info

    # ------------------------------------------------------------------ run
    def run(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None, params=None):
        """Attention of every planned query over all its levels; arguments as
        BatchDecodeWrapper.run(). Returns out, or (out, lse) when lse was asked for. The
        launch's argument buffers are rewritten on every call (the driver copies them at
        enqueue), as BatchDecodeWrapper.run()'s."""
        k = self.kernel
        levels = k._bind(k._reusable(), q, k_cache, v_cache, out, lse, stream, sm_scale, params, exact=True)
        launch, name = self._eager, self.launch_list()   # (the list this plan needs)
        if launch is None or launch.levels is not levels:
            launch = self._eager = self._launch(levels)
        else:
            self._bind_calls(launch, name)
        levels.check_plan()
        launch_path.enqueue(launch.lists[name], levels.stream, self.device)
        return (levels.out, levels.lse) if levels.lse is not None else levels.out

    def prepare(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
                params=None) -> "CascadeLaunch":
        """Validate and pack every kernel's arguments into a launch of its own; calling it
        launches them (graph capture calls it once, StepGraph replays it). q/out/lse may be
        sized for the largest batch it will replay, as BatchDecodeWrapper.prepare()."""
        if self.info is None:
            raise RuntimeError("run() before plan(): call plan() for this step first")
        k = self.kernel
        return self._launch(k._bind(k._new_launch(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                                    exact=False))

    def _launch(self, levels) -> "CascadeLaunch":
        """The launch lists over the decode kernel's bound launch `levels`. With prefill tiles:
        the prefill kernel's call (the decode arguments with the prefill plan's pointers), the
        decode kernel's, the fold's (its fixed arguments, and the output pointers and strides of
        the decode arguments). The prefill kernel goes first: it waits for the step's inputs,
        then lets the decode kernel launch, which (concurrent_levels) runs alongside it and
        waits for it only before exiting. (So a prefill kernel must call allow_next_grid only
        after its wait_for_previous_grid, as cuda_src/prefill.cuh does.) Without: the plain
        decode build's call (same arguments), then the fold. The launch picks the list the
        current plan needs (CascadeLaunch.calls)."""
        pdl = self.kernel.pdl and self.kernel.kernels.pdl_capable
        decode = levels.calls[0]       # the decode kernel over its groups (no merge kernel: _LevelsKernel)
        # The fold reads the states after griddepcontrol.wait: PDL overlaps its launch only.
        fold = KernelCall(fold_function(self.dtype, self.head_dim, self.softmax, self.device.ordinal),
                          (self.fold_ctas, 1, 1), (THREADS, 1, 1), 0, Params(self._fold_template), pdl)
        alone = decode if self._alone is self.kernel.kernels else KernelCall(
            self._alone.kernel, decode.grid, decode.block, decode.smem, decode.params, decode.pdl)
        # the flat plan (one level, rtattn's single format): split rows merged by the merge kernel
        flat = alone if self._flat is self._alone else KernelCall(
            self._flat.kernel, decode.grid, decode.block, self._flat.rendered.smem_bytes, decode.params, decode.pdl)
        merge = self._flat.calls(decode.params, decode.grid[0], decode.grid[1], merge=True, pdl=pdl)[1]
        lists = {"levels": (alone, fold), "flat": (flat, merge)}
        if self.prefill is not None:
            r = self.prefill.rendered
            pre = KernelCall(self.prefill.kernel, (self.planner.prefill.num_ctas, self.kernel.num_kv_heads, 1),
                             (r.threads, 1, 1), r.smem_bytes, Params(len(levels.args)), pdl)
            lists["prefill"] = (pre, decode, fold)
            one = None
            if self._one is not None:   # the same call on the one-row-tile build (single-query decode items)
                one = KernelCall(self._one.kernel, decode.grid, decode.block, self._one.rendered.smem_bytes,
                                 decode.params, decode.pdl)
                lists["prefill-q1"] = (pre, one, fold)
            join = None
            if self._join is not None:   # the prefill kernel, then the decode kernel that joins its states
                r = self._join.rendered
                join = KernelCall(self._join.kernel, decode.grid, decode.block, r.smem_bytes, decode.params, decode.pdl)
                lists["join"] = (pre, join)
            if self.planner.prefill_narrow is not None:   # the same calls, the prefill kernel on the narrow grid
                narrow = KernelCall(pre.function, (self.planner.prefill_narrow.num_ctas,) + pre.grid[1:], pre.block,
                                    pre.smem, pre.params, pre.pdl)
                lists["prefill-narrow"] = (narrow, decode, fold)
                if one is not None:
                    lists["prefill-q1-narrow"] = (narrow, one, fold)
                if join is not None:
                    lists["join-narrow"] = (narrow, join)
        launch = CascadeLaunch(self, levels, lists)
        self._bind_calls(launch)
        return launch

    def _bind_calls(self, launch: "CascadeLaunch", name: str | None = None) -> None:
        """Copy what the decode arguments hold for this call into the prefill and fold arguments
        of launch list `name` (run(): the one it enqueues), or of every list (None)."""
        src = ctypes.addressof(launch.levels.args.buffer)
        lists = launch.lists
        every = name is None   # (every list: the prefill lists come with "prefill"; "levels" has the fold)
        if ("prefill" in lists) if every else name in PREFILL_LISTS:   # (its call: one argument buffer in every list)
            args = lists["prefill"][0].params
            ctypes.memmove(args.buffer, src, args.nbytes)
            self._write_prefill_ptrs(args.buffer, self._prefill_ptrs)
        if every or name in FOLD_LISTS:   # (the fold's call: one argument buffer in every list)
            ctypes.memmove(ctypes.addressof(lists["levels"][-1].params.buffer) + self._fold_out_at,
                           src + self._out_at, OUT_MEMBERS_BYTES)

    def launch_list(self) -> str:
        """Which launch list the current plan needs: "prefill" (prefill kernel, decode kernel,
        fold) where it puts work on prefill tiles, "join" (prefill kernel, the decode kernel that
        joins its states: join_levels), "flat" (decode kernel, merge kernel) for the flat plan,
        else "levels" (decode kernel, fold); "-q1" after "prefill": the decode kernel's one-row-tile
        build, where every decode item is one query (single_query_build); "-narrow" last: the
        prefill kernel on the narrow grid the plan was made for (CascadePlanner.prefill_narrow)."""
        info = self.info
        if info is None:
            return "levels"
        if info.flat:
            return "flat"
        narrow = "-narrow" if info.prefill is not None and info.prefill.num_ctas != self.planner.prefill.num_ctas else ""
        if info.joined:
            return "join" + narrow
        if info.prefill is None or not info.prefill.num_items:
            return "levels"
        return "prefill" + ("-q1" if info.one_query and self._one is not None else "") + narrow


class CascadeLaunch(Launch):
    """A validated cascade step: calling it enqueues the launch list the wrapper's current plan
    needs (CascadeWrapper.launch_list: with the prefill kernel or without), so a graph pool
    keyed by `config_key` (rtattn.graphs) holds an executable per list, and replans that keep
    the list replay or update in place. `lists`: name -> calls; `levels` is the decode
    kernel's launch (its arguments, outputs and the plan checks of a replay)."""

    def __init__(self, wrapper: CascadeWrapper, levels, lists: dict):
        # (not Launch.__init__: its calls are fixed) every list's argument buffers, in call order
        self.wrapper, self.levels, self.lists, self.device = wrapper, levels, lists, wrapper.device
        every = [c for calls in lists.values() for c in calls]
        self.param_buffers = list({id(c.params): c.params for c in every}.values())
        self._keys = {name: tuple(c.shape_key for c in calls) for name, calls in lists.items()}

    calls = property(lambda self: self.lists[self.wrapper.launch_list()])
    config_key = property(lambda self: self._keys[self.wrapper.launch_list()])
    out = property(lambda self: self.levels.out)
    lse = property(lambda self: self.levels.lse)
    stream = property(lambda self: self.levels.stream, lambda self, s: None)   # (Launch's default: the levels')
    window_left = property(lambda self: self.levels.window_left)
    tokens = property(lambda self: self.levels.tokens)

    @property
    def fold_params(self) -> bytes:
        return bytes(self.lists["levels"][-1].params)

    def check_plan(self) -> None:
        self.levels.check_plan()

    def __call__(self, stream=None) -> None:
        self.levels.check_plan()
        launch_path.enqueue(self.calls, self.levels.stream if stream is None else stream, self.device)
