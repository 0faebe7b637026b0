"""The cascade planner: every level of a step in one plan set, folded in a fixed order.

All levels are planned together, as one batch of pseudo-requests (rtattn.plan.levels): a
shared group is a pseudo-request whose queries are all its requests' queries, so its KV is
read once per query tile instead of once per request. Each group runs on one of two kernel
families (`prefill_groups`, the rule):

    decode   a group with at most decode tile_q queries (one decode work item holds them all:
             its KV is read once either way), and every group with no KV;
    prefill  a group with more queries than that, where the family cost rule predicts a saving
             past PREFILL_MIN_SAVING_US: decode would read its KV once per tile_q queries (8 at
             32/8 heads), the prefill family's tensor-core tiles once per 16-32 (64-128 fused rows) --
             a long prefix shared by many requests.

Each family's groups get their own Algorithm-1 schedule over that family's grid (two plans in
the plan set, two persistent kernels). After scheduling, the plans are rewritten for the fold:
every item writes float32 state rows (levels share query rows, so nothing writes the output
directly; decode's rows first, then prefill's), items read the real query rows, and the fold
map lists each query row's state rows in (level, KV) order; the fold kernel combines them with
⊕ into the output and LSE. The positions the variants need (absolute query positions, each
group's first KV position) sit next to the plans.

Plan set parts: "plan" (the decode PlanLayout of the union: its requests are all the groups),
"prefill" (the prefill family's PlanLayout: its queues and items; it borrows the union's
requests, page ids and empty merge map: `PREFILL_BORROWED`), "q_pos" [max_qo_tokens], "kv_offset"
[pseudo-requests], "fold_indptr" [max_qo_tokens + 1], "fold_rows" [state rows], "fold_info"
[FOLD_INFO_LEN] = (query rows, state rows, levels).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import numpy as np

from . import fields as F
from . import tile_table
from .costs import COST_ALPHA, COST_GAMMA
from .inspector import _ADD, Planner, PlanInfo, _repeat_index
from .layout import Batch, validate_batch
from .prefix_tree import one_shared_prefix, prefix_union
from .levels import Union, check_causal, union_batch
from .planset import PlanSet
from .tiles import TileConfig

FOLD_INFO_LEN = 4
PREFILL_MEMO = 8   # shared-group schedules remembered (CascadePlanner._prefill_items)
# What the prefill part reads from the union plan ("plan"): the pseudo-requests and page ids, and
# the (empty) merge map: nothing merges in a cascade's kernels, the fold does.
PREFILL_BORROWED = ("req_qo_start", "req_qo_len", "req_kv_page_start", "req_kv_len", "kv_indices",
                    "merge_indptr", "merge_qo_row", "merge_partial_start", "merge_partial_stride")


# A shared group moves to prefill tiles only where the cost rule predicts it saves more than
# the prefill level's own cost (its kernel's launch, its items' fixed cost and tail: the rule's
# byte/FLOP terms leave them out), per prefill kernel.
#   sync   Set from the H200 run of 9a33267 (docs/perf-log.md "v9 F2", 32/8 heads, d128):
#          predicted savings 194 / 48.5 / 48.5 us (p32768x64, p32768x16, p8192x64) measured 91 /
#          1.6 / 3.5 us faster on prefill; predicted 24.3 (tree-4Kx16x1K's 4K x 64 level), 12.1
#          (p8192x16), 6.1 and 1.5 (p1024 rows) measured 5-15 us slower. Rechecked in "Cascade v4"
#          (3be52dc): right on 7 of the 8 (p8192x16 2 us faster on prefill).
#   wgmma  Set from the H200 call 2 of session 5 (6a53425, docs/perf-log.md "Cascade v6": rt-wg /
#          rt-wgj against the levels on decode): predicted 6.1 (p1024x64, + the join's fold 3.5)
#          measured 3.3 us faster, 12.1 (p8192x16, joined) 3.6 faster, 24.3 (tree-4Kx16x1K, a fold
#          either way) 1.7 faster; predicted 1.5 (p1024x16, joined) measured 1.2 slower, 6.1
#          (tree-1Kx8x8K's 1K x 64 level, a fold either way) 1.7 slower: 7.5 separates all five
#          (and the three long rows, 48.5-194 predicted, 27-130 measured faster).
#   ws     The wgmma kernel's (the default 128-row shared tile since session 14: not measured on its own).
PREFILL_MIN_SAVING_US = {"sync": 40.0, "wgmma": 7.5, "ws": 7.5}
# What a one-prefix plan on prefill tiles saves where it joins its levels (join_levels: the
# decode kernel folds each suffix row, no fold kernel) against the levels on decode (decode
# kernel, fold): the fold kernel alone on the small rows, 3.4-3.6 us (call 2's breakdown).
JOIN_SAVING_US = 3.5
# A one-prefix plan whose prefix is at most this many tokens runs its shared level on the narrow
# grid (CascadePlanner's prefill_narrow: one prefill CTA per SM), so the decode level's CTAs take
# the other slot of each SM and run beside it instead of after it. H200, 16 decode queries at
# 32/8 d128 on the 64-row wgmma tile (docs/perf-log.md "Cascade v7", joined, one against two CTAs
# per SM): an 8K prefix 24.3 vs 29.3 us, a 32K prefix 58.4 vs 55.3 (beside the decode CTAs the
# shared level runs slower, by more the longer it is): the measured gain crosses zero near 20K.
NARROW_MAX_PREFIX_TOKENS = 16384


def prefill_group(qo_len: int, kv_len: int, decode_tile_q: int, saving_us=None,
                  min_saving_us: float = PREFILL_MIN_SAVING_US["sync"]) -> bool:
    """The family rule for one group: True where it runs on prefill tiles -- more queries than
    one decode work item holds (decode_tile_q), KV to read, and (given `saving_us(qo, kv)`, the
    cost rule's predicted saving, rtattn.families.choice.shared_group_saving_us) a saving above
    `min_saving_us` (the prefill kernel's PREFILL_MIN_SAVING_US, less any credit the plan earns
    there: JOIN_SAVING_US)."""
    return qo_len > decode_tile_q and kv_len > 0 and (saving_us is None or saving_us(qo_len, kv_len) >
                                                      min_saving_us)


def prefill_groups(qo_len: np.ndarray, kv_len: np.ndarray, decode_tile_q: int, saving_us=None,
                   min_saving_us: float = PREFILL_MIN_SAVING_US["sync"]) -> np.ndarray:
    """The family rule (prefill_group) over groups: bool[groups]; the cost rule runs only on the
    groups the size test keeps."""
    on = (qo_len > decode_tile_q) & (kv_len > 0)
    if saving_us is not None:
        for g in np.flatnonzero(on):   # (the size test above is prefill_group's: only its cost test is left)
            on[g] = saving_us(int(qo_len[g]), int(kv_len[g])) > min_saving_us
    return on


@dataclass
class CascadeInfo:
    plan: PlanInfo          # the union plan (decode part; its counts are for pseudo-requests)
    level_of: np.ndarray    # int32[pseudo-requests]: the level of each group
    num_levels: int
    num_qo_tokens: int
    num_state_rows: int
    num_pages: int          # page ids the levels hold (a shared page once per group)
    views: dict
    prefill: PlanInfo | None = None   # the prefill part (None: the planner has no prefill family)
    union: Union | None = None        # the levels as one pseudo-batch (None from the one-prefix path)
    flat: bool = False                # the flat plan: one level, each request its own pages (no fold)
    joined: bool = False              # the suffix rows join the prefill level's states (no fold kernel)
    one_query: bool = False           # every decode item is one query (a one-row-tile build can run them)

    def _parts(self):
        return [p for p in (self.plan, self.prefill) if p is not None]

    def _item_levels(self, part: PlanInfo) -> np.ndarray:
        return self.level_of.take(part.views["item_request"][:part.num_items])

    @property
    def level_items(self) -> np.ndarray:
        """int64[levels]: work items of each level (both families)."""
        return sum(np.bincount(self._item_levels(p), minlength=self.num_levels) for p in self._parts())

    @property
    def level_kv_tokens(self) -> np.ndarray:
        """int64[levels]: KV tokens each level's items read (per KV head; a shared prefix once
        per query tile)."""
        out = np.zeros(self.num_levels, np.int64)
        for p in self._parts():
            v, n = p.views, p.num_items
            kv = v["item_kv_end"][:n].astype(np.int64) - v["item_kv_start"][:n]
            out += np.bincount(self._item_levels(p), weights=kv, minlength=self.num_levels).astype(np.int64)
        return out

    @property
    def level_prefill_items(self) -> np.ndarray:
        """int64[levels]: work items of each level that run on prefill tiles."""
        if self.prefill is None:
            return np.zeros(self.num_levels, np.int64)
        return np.bincount(self._item_levels(self.prefill), minlength=self.num_levels)


class CascadePlanner:
    """Plans cascades of up to `num_levels` levels over up to `max_batch` requests and
    `max_qo_tokens` query rows. `planner`: the decode family's Planner, built for the union:
    bounds (max_batch * num_levels, max_qo_tokens * num_levels, max_pages). `prefill`: the
    prefill family's Planner (its tile and grid) with the same bounds, or None (every group on
    decode); `prefill_narrow`: the same tile on fewer CTAs per SM, or None (_plan_one_prefix's
    short prefixes). `create` builds them."""

    def __init__(self, planner: Planner, max_batch: int, max_qo_tokens: int, num_levels: int = 2,
                 prefill: Planner | None = None, prefill_saving_us=None, flat_saving_us=None,
                 prefill_min_saving_us: float = PREFILL_MIN_SAVING_US["sync"], join_levels: bool = False,
                 prefill_narrow: Planner | None = None, join_uneven: bool = False, join_unsplit: bool = False):
        b = planner.bounds
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        if b.max_batch < max_batch * num_levels or b.max_qo_tokens < max_qo_tokens * num_levels:
            raise ValueError("the cascade's planner needs bounds for every level's groups "
                             f"(max_batch >= {max_batch * num_levels}, max_qo_tokens >= {max_qo_tokens * num_levels})")
        # Query tiles are scheduled without a causal horizon: a causal variant masks in the
        # kernel, with the levels' real positions.
        planner.causal = False
        self.planner, self.num_levels = planner, num_levels
        self.max_batch, self.max_qo_tokens, self.page_size = max_batch, max_qo_tokens, planner.page_size
        if prefill is not None and prefill.tile_q <= planner.tile_q:
            prefill = None    # no group can need it: the rule sends a group there only past decode's tile
        self.prefill = prefill
        # The prefill family's planner on a narrower grid (the same tile, fewer CTAs per SM), or None:
        # one-prefix plans of at most NARROW_MAX_PREFIX_TOKENS use it (_plan_one_prefix).
        self.prefill_narrow = prefill_narrow if prefill is not None else None
        self.prefill_saving_us = prefill_saving_us   # (qo, kv) -> us: prefill_groups' cost rule
        self.prefill_min_saving_us = prefill_min_saving_us   # what it must beat (the kernel's PREFILL_MIN_SAVING_US)
        self.flat_saving_us = flat_saving_us         # (batch, prefix tokens, decode tile_q) -> us: flat_plan's
        # The decode kernel can join the prefill level's states into its suffix rows (a
        # level_join build: CascadeWrapper passes True where it builds one): _plan_one_prefix's
        # prefill-tile plans then need no fold.
        self.join_levels = join_levels
        # ... and plan_union's one-prefix plans whose requests' suffixes differ in length
        # (_union_joinable), where each suffix is one decode item -- `join_unsplit`: made so, by
        # scheduling the suffixes unsplit (A/B paths until measured on a GPU).
        self.join_uneven, self.join_unsplit = join_uneven, join_unsplit
        self.max_state_rows = b.max_partial_rows + b.max_qo_tokens
        parts = {"plan": planner.layout}
        if prefill is not None:
            prefill.causal = False
            pb = prefill.bounds
            if (pb.max_batch, pb.max_qo_tokens, pb.max_pages) != (b.max_batch, b.max_qo_tokens, b.max_pages):
                raise ValueError("the prefill planner needs the union planner's bounds")
            if self.prefill_narrow is not None:
                nb, narrow = self.prefill_narrow.bounds, self.prefill_narrow
                narrow.causal = False
                if (nb.max_batch, nb.max_qo_tokens, nb.max_pages, nb.tile_q) != (pb.max_batch, pb.max_qo_tokens,
                                                                                  pb.max_pages, pb.tile_q) \
                        or narrow.num_ctas >= prefill.num_ctas:
                    raise ValueError("the narrow prefill planner needs the prefill planner's bounds and tile, "
                                     "on fewer CTAs")
            self.prefill_layout = F.PlanLayout(pb, PREFILL_BORROWED)
            parts["prefill"] = self.prefill_layout
            self.max_state_rows += pb.max_partial_rows
        parts.update({"q_pos": max_qo_tokens, "kv_offset": b.max_batch, "fold_indptr": max_qo_tokens + 1,
                      "fold_rows": self.max_state_rows, "fold_info": FOLD_INFO_LEN})
        self.planset = PlanSet(parts)
        self._views = F.ViewCache(self._part_views)
        self._prefill_memo: dict = {}
        self._tiles_memo: dict = {}
        self._ar = np.arange(max(self.max_state_rows, b.max_tiles, b.max_batch) + 1, dtype=np.int64)
        self._ar32 = np.arange(b.max_tiles + 1, dtype=np.int32)
        self._ones = np.ones(b.max_tiles, np.int32)
        self._level01 = np.ones(max_batch + 1, np.int32)   # one prefix: group 0 on level 0, the requests on 1
        self._level01[0] = 0

    def _part_views(self, buf) -> dict:
        v = self.planset.views(buf)
        if "prefill" in v:   # the prefill part's borrowed fields are the union's arrays
            v["prefill"].update({f: v["plan"][f] for f in PREFILL_BORROWED})
        return v

    def kernel_plan_ptrs(self, base: int) -> dict:
        """family -> the PlanPtrs (field -> device address) its kernel reads, for a workspace
        holding the plan set at `base`."""
        ptrs = self.planset.device_ptrs(base)
        out = {"decode": ptrs["plan"]}
        if self.prefill is not None:
            out["prefill"] = {**ptrs["prefill"], **{f: ptrs["plan"][f] for f in PREFILL_BORROWED}}
        return out

    @classmethod
    def create(cls, max_batch: int, max_qo_tokens: int, max_pages: int, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, page_size: int, *, num_levels: int = 2, prefill_tile: TileConfig | None = None,
               prefill_ctas: int | None = None, prefill_saving_us=None, flat_saving_us=None,
               prefill_min_saving_us: float = PREFILL_MIN_SAVING_US["sync"], join_levels: bool = False,
               narrow_prefill: bool = False, join_uneven: bool = False, join_unsplit: bool = False,
               **planner_kw) -> "CascadePlanner":
        """`prefill_tile` (the prefill family's TileConfig) and `prefill_ctas` (its grid):
        plan the groups the family rule picks on prefill tiles (None: all on decode);
        `prefill_saving_us`: the rule's cost test (prefill_groups), which must beat
        `prefill_min_saving_us` (PREFILL_MIN_SAVING_US of the tile's kernel); `flat_saving_us`:
        plan_shared's flat-or-levels test (flat_plan; None: always levels); `join_levels`: the
        decode kernel has its level_join build (the one-prefix plans it allows skip the fold);
        `narrow_prefill`: also a prefill planner at one CTA per SM (prefill_narrow), where the tile
        has more."""
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        bounds = (max_batch * num_levels, max_qo_tokens * num_levels, max_pages, num_qo_heads, num_kv_heads,
                  head_dim, page_size)
        planner = Planner(*bounds, max_qo_len=max_qo_tokens, **planner_kw)
        prefill = None
        if prefill_tile is not None:
            kw = {k: v for k, v in planner_kw.items() if k not in ("num_ctas", "max_rows", "tile", "kernel")}
            prefill = Planner(*bounds, max_qo_len=max_qo_tokens, tile=prefill_tile, num_ctas=prefill_ctas, **kw)
        narrow = None
        if prefill is not None and narrow_prefill and prefill_tile.ctas_per_sm > 1:
            narrow = Planner(*bounds, max_qo_len=max_qo_tokens, tile=replace(prefill_tile, ctas_per_sm=1), **kw)
        return cls(planner, max_batch, max_qo_tokens, num_levels, prefill, prefill_saving_us, flat_saving_us,
                   prefill_min_saving_us, join_levels, narrow, join_uneven, join_unsplit)

    @property
    def num_ctas(self) -> int:
        return self.planner.num_ctas

    def plan(self, levels, out=None, *, causal: bool = False, num_pages: int | None = None) -> CascadeInfo:
        """Plan one step. `levels`: Level tuples (qo_indptr, kv_indptr, kv_indices,
        kv_last_page_len), the last one the requests. `causal` refuses requests whose queries
        reach past their last level (the mask itself is the kernel's)."""
        union = union_batch(levels, self.page_size, num_pages=num_pages, causal=causal,
                            max_levels=self.num_levels)
        if union.num_qo_tokens > self.max_qo_tokens:
            raise ValueError(f"{union.num_qo_tokens} query tokens exceed max_qo_tokens={self.max_qo_tokens}")
        if union.req_qo_indptr.shape[0] - 1 > self.max_batch:
            raise ValueError(f"batch {union.req_qo_indptr.shape[0] - 1} exceeds max_batch={self.max_batch}")
        return self.plan_union(union, out)

    def plan_shared(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, out=None, *, causal: bool = False,
                    num_pages: int | None = None) -> CascadeInfo:
        """Plan one step from plain page tables, the levels found from shared leading pages
        (rtattn.plan.prefix_tree). qo_indptr None: decode, one query per request."""
        B = len(kv_indptr) - 1
        batch = validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                               num_pages=num_pages, max_batch=self.max_batch, max_qo_tokens=self.max_qo_tokens)
        lcp = None   # (one_shared_prefix's answer, where asked: prefix_union then does not ask again)
        if batch.qo_max == 1 and batch.qo_indptr.item(-1) == B:
            lcp = one_shared_prefix(batch, self.num_levels)
            # (a decode query sits in its own last page, never shared: causal holds); the prefix
            # goes to the family plan_union's rule would give it
            if lcp:   # (joined, the prefill level saves the fold kernel too)
                need = self.prefill_min_saving_us - (JOIN_SAVING_US if self.join_levels else 0.0)
                on_prefill = self.prefill is not None and prefill_group(B, lcp * self.page_size, self.planner.tile_q,
                                                                        self.prefill_saving_us, need)
                if not on_prefill and self.flat_plan(batch, lcp * self.page_size):
                    return self._plan_flat(batch, out)
                return self._plan_one_prefix(batch, lcp, on_prefill, out)
        union = prefix_union(batch, self.num_levels, lcp)
        if lcp is not None and self.flat_saving_us is not None and _one_prefix_union(union, B):
            # decode requests over one prefix with suffixes of unequal page counts: the flat-or-levels
            # rule as on the one-prefix path, where plan_union's family rule keeps the prefix on decode
            P = union.batch.kv_len.item(0)
            on_prefill = self.prefill is not None and prefill_group(B, P, self.planner.tile_q, self.prefill_saving_us,
                                                                    self.prefill_min_saving_us)
            if not on_prefill and self.flat_plan(batch, P):
                return self._plan_flat(batch, out)
        if causal:
            R = union.req_qo_indptr.shape[0] - 1
            check_causal(union.batch.qo_len[-R:] if R else union.batch.qo_len[:0], union.batch.kv_len[-R:] if R else
                         union.batch.kv_len[:0])
        return self.plan_union(union, out)

    def flat_plan(self, batch: Batch, prefix_tokens: int) -> bool:
        """The flat-or-levels rule for decode requests over one shared prefix that stays on
        decode tiles: flat (each request's whole page list, one level, rtattn's single format)
        where `flat_saving_us` predicts it faster (rtattn.families.choice.flat_saving_us: its
        extra prefix reads from L2 against the levels' per-query states and fold) and the
        requests' pages fit max_pages (the flat plan lists a shared page once per request)."""
        return (self.flat_saving_us is not None and batch.kv_indptr.item(-1) <= self.planner.bounds.max_pages
                and self.flat_saving_us(batch.batch, prefix_tokens, self.planner.tile_q) > 0)

    def _plan_flat(self, batch: Batch, out=None) -> CascadeInfo:
        """The flat plan: the decode family's own plan of the requests (split rows merged by the
        merge kernel, the rest written through to the output: no fold) in the plan set's decode
        part, with each query's position (kv_offset 0: every request is its own group)."""
        buf = out if out is not None else self.planset.allocate()
        v = self._views.get(buf)
        info = self.planner.plan_batch(batch, buf, v["plan"])
        B, N = info.batch, info.num_qo_tokens
        own, j = _repeat_index(batch.qo_len, self._ar)   # each query row's request, its index there
        v["q_pos"][:N] = (batch.kv_len - batch.qo_len).take(own) + j
        v["kv_offset"][:B] = 0
        v["fold_info"][:3] = (N, 0, 1)
        return CascadeInfo(info, np.zeros(B, np.int32), 1, N, info.num_partial_rows, batch.kv_indptr.item(-1), v,
                           flat=True)

    def plan_union(self, union: Union, out=None) -> CascadeInfo:
        """Plan the pseudo-batch of all levels into the plan set (plain numpy on small
        arrays, kept to few calls: this is on the per-step host path)."""
        buf = out if out is not None else self.planset.allocate()
        v = self._views.get(buf)
        pb, N, L = union.batch, union.num_qo_tokens, union.num_levels
        nnz = pb.kv_indptr.item(-1)
        if nnz > self.planner.bounds.max_pages:
            raise ValueError(f"the levels hold {nnz} pages, exceeding max_pages={self.planner.bounds.max_pages} "
                             f"(a page counts once per level group that holds it)")
        real0 = pb.qo_indptr[:-1] - union.row_shift          # each group's first real query row
        on_prefill = None
        if self.prefill is not None and pb.qo_max > self.planner.tile_q:
            on_prefill = prefill_groups(pb.qo_len, pb.kv_len, self.planner.tile_q, self.prefill_saving_us,
                                        self.prefill_min_saving_us)
            if not on_prefill.any():
                on_prefill = None
        dec_groups = None if on_prefill is None else np.flatnonzero(~on_prefill)
        joinable = self._union_joinable(union, on_prefill, real0)
        d_it, d_res = self._decode_items(pb, real0, dec_groups, unsplit=joinable and self.join_unsplit)
        R = _state_rows(d_it, 0)
        parts = [(d_it, d_res, self.planner, v["plan"])]
        join = None
        if self.prefill is not None:
            pg = self._ar[:0] if on_prefill is None else np.flatnonzero(on_prefill)
            p_it, p_res, tmpl, p_rows = self._prefill_items(pb.qo_len.take(pg), pb.kv_len.take(pg), pg,
                                                            real0.take(pg))
            if joinable and tmpl is not None and d_it.shape[1] == N and p_it.shape[1] * self.prefill.tile_q <= \
                    self.max_state_rows:   # one item per suffix row: it joins the prefix's states (no fold)
                P = pb.kv_len.item(0)
                p_rows, join = self._joined(p_it, N, P, tmpl.shape[1], self.prefill.num_ctas)
                d_it[5], d_it[6], R = -1, d_it[1], 0
            else:
                p_it[5] += R
            R += p_rows
            parts.append((p_it, p_res, self.prefill, v["prefill"]))
        if R > self.max_state_rows:
            raise ValueError(f"plan needs {R} state rows, exceeding {self.max_state_rows}")
        Bp = pb.batch
        pv = v["plan"]
        pv["req_qo_start"][:Bp] = real0
        pv["req_qo_len"][:Bp] = pb.qo_len
        pv["req_kv_page_start"][:Bp] = pb.kv_indptr[:Bp]
        pv["req_kv_len"][:Bp] = pb.kv_len
        pv["kv_indices"][:nnz] = pb.kv_indices[:nnz]
        for it, _, _, _ in parts:
            it[7] = pb.kv_indptr.take(it[0])
        infos = self._write_parts(buf, parts, R, Bp, N)
        if join is not None:   # row r's c prefix states: rows start + k * tile_q (_join_rows), as _plan_one_prefix
            pv["merge_indptr"][:N + 1] = join[1]
            pv["merge_partial_start"][:N] = join[0]
            pv["merge_partial_stride"][:N] = self.prefill.tile_q
            pv["merge_qo_row"][:N] = self._ar[:N]
            v["fold_indptr"][:N + 1] = 0   # (nothing for the fold: no fold kernel runs)
        else:
            it = d_it if len(parts) == 1 or parts[1][0].shape[1] == 0 else np.concatenate([d_it, parts[1][0]], axis=1)
            self._fold_map(v, it, union.level_of, N, L, R)
        v["q_pos"][:N] = union.q_pos
        v["kv_offset"][:Bp] = union.kv_offset
        v["fold_info"][:3] = (N, R, L)
        return CascadeInfo(infos[0], union.level_of, L, N, R, nnz, v, infos[1] if len(infos) > 1 else None, union,
                           joined=join is not None, one_query=_one_query(d_it))

    def _union_joinable(self, union: Union, on_prefill, real0: np.ndarray) -> bool:
        """Whether plan_union's levels are one prefix on prefill tiles under single-query suffixes,
        which the joining decode build can serve (join_uneven: the one-prefix path's join for
        requests of unequal suffixes): two levels, group 0 on prefill tiles holding every query row
        from row 0, each other group one query on decode, at most max_merge_rows rows. (One item per
        suffix and a balanced prefix schedule are checked once the items exist.)"""
        if not (self.join_levels and self.join_uneven and on_prefill is not None):
            return False
        N = union.num_qo_tokens
        return (_one_prefix_union(union, N) and bool(on_prefill[0]) and not on_prefill[1:].any()
                and real0.item(0) == 0 and bool((real0[1:] == self._ar[:N]).all())
                and N <= self.planner.bounds.max_merge_rows)

    def _plan_one_prefix(self, batch: Batch, lcp: int, on_prefill: bool, out=None) -> CascadeInfo:
        """plan_union for the step of serving parallel samples or a system prompt, without the
        union's intermediate arrays: B decode requests over one prefix of `lcp` pages (group 0:
        on prefill tiles if `on_prefill`, else decode query tiles of tile_q requests scheduled
        with the suffixes), each with its own pages (groups 1..B, on decode). The plan set is
        byte for byte plan_union's (tests/test_cascade_plan.py) but for the grid: a prefix of at
        most NARROW_MAX_PREFIX_TOKENS on prefill tiles takes prefill_narrow's. For a prefix on
        prefill tiles the fold map is written in closed form where every row has the same prefill
        chunks and one suffix item."""
        buf = out if out is not None else self.planset.allocate()
        v = self._views.get(buf)
        B, ps, n, tq = batch.batch, self.page_size, batch.kv_indptr.item(1), self.planner.tile_q
        own, P, Bp = n - lcp, lcp * ps, B + 1
        nnz = lcp + B * own
        if nnz > self.planner.bounds.max_pages:
            raise ValueError(f"the levels hold {nnz} pages, exceeding max_pages={self.planner.bounds.max_pages} "
                             f"(a page counts once per level group that holds it)")
        T0 = 0 if on_prefill else -(-B // tq)    # the prefix's decode query tiles
        if T0:
            t_kv = np.empty(T0 + B, np.int64)
            t_kv[:T0] = P
            np.subtract(batch.kv_len, P, out=t_kv[T0:])
            d_it, d_res = self._tile_items(*self._one_prefix_tiles(B, T0), t_kv)
        else:   # every decode tile a suffix: tile b is request b's (group b + 1, row b, one query)
            t_kv = batch.kv_len - P
            d_it, d_res = self._suffix_items(t_kv)
        parts = [(d_it, d_res, self.planner, v["plan"])]
        tmpl, join, pp = None, False, self.prefill
        if self.prefill is not None:
            if on_prefill:
                if self.prefill_narrow is not None and P <= NARROW_MAX_PREFIX_TOKENS:
                    pp = self.prefill_narrow   # the decode level's CTAs beside the shared level
                p_it, p_res, tmpl, p_rows = self._prefill_items(np.array([B]), np.array([P]), self._ar[:1], None, pp)
                join = (self.join_levels and tmpl is not None and d_it.shape[1] == B   # one item per suffix
                        and B <= self.planner.bounds.max_merge_rows
                        and p_it.shape[1] * self.prefill.tile_q <= self.max_state_rows)
                if join:   # each suffix item writes its row, joining the prefix's states: none of its own
                    p_rows, merge_start = self._joined(p_it, B, P, tmpl.shape[1], pp.num_ctas)
                    if not d_res.get("join_rows"):   # (_unsplit_suffixes' items hold them already)
                        d_it[5], d_it[6] = -1, d_it[1]
                    R = 0
            else:   # plan_union's empty prefill part
                p_it, p_res, _, p_rows = self._prefill_items(self._ar[:0], self._ar[:0], self._ar[:0], self._ar[:0])
            if not join:
                R = _state_rows(d_it, 0)
                p_it[5] += R
            t0, R = R, R + p_rows          # t0: the template's first state row
            parts.append((p_it, p_res, pp, v["prefill"]))
        else:
            R = _state_rows(d_it, 0)
        if R > self.max_state_rows:
            raise ValueError(f"plan needs {R} state rows, exceeding {self.max_state_rows}")
        pv = v["plan"]
        pv["req_qo_start"][0] = 0
        pv["req_qo_start"][1:Bp] = self._ar[:B]
        pv["req_qo_len"][0] = B
        pv["req_qo_len"][1:Bp] = 1
        pv["req_kv_page_start"][0] = 0
        pv["req_kv_page_start"][1:Bp] = self._suffix_pages(B, own, lcp)
        pv["req_kv_len"][0] = P
        pv["req_kv_len"][1:Bp] = t_kv[T0:]
        m = batch.kv_indices[:n * B].reshape(B, n)
        ids = pv["kv_indices"]
        ids[:lcp] = m[0, :lcp]
        ids[lcp:nnz].reshape(B, own)[:] = m[:, lcp:]
        d_it[7] = pv["req_kv_page_start"].take(d_it[0])
        if on_prefill:
            p_it[7] = 0                    # the prefix's pages come first
        infos = self._write_parts(buf, parts, R, Bp, B)
        level_of = self._level01[:Bp]
        if join:   # row r's c prefix states: rows start + k * tile_q (_join_rows), in the decode part's merge map
            pv["merge_indptr"][:B + 1] = merge_start[1]
            pv["merge_partial_start"][:B] = merge_start[0]
            pv["merge_partial_stride"][:B] = self.prefill.tile_q
            pv["merge_qo_row"][:B] = self._ar[:B]
            v["fold_indptr"][:B + 1] = 0   # (nothing for the fold: no fold kernel runs)
        elif tmpl is not None and d_it.shape[1] == B:   # c prefill chunks per row, then its one suffix item
            c = tmpl.shape[1]
            fr = v["fold_rows"][:R].reshape(B, c + 1)
            np.add(tmpl, t0, out=fr[:, :c])
            fr[:, c][d_it[1]] = d_it[5]
            np.multiply(self._ar[:B + 1], c + 1, out=v["fold_indptr"][:B + 1], casting="unsafe")
        else:
            self._fold_map(v, np.concatenate([p[0] for p in parts], axis=1), level_of, B, 2, R)
        v["q_pos"][:B] = batch.kv_len - 1   # (cheaper than a casting subtract into int32)
        v["kv_offset"][0] = 0
        v["kv_offset"][1:Bp] = P
        struct.pack_into("=3i", v["fold_info"], 0, B, R, 2)
        return CascadeInfo(infos[0], level_of, 2, B, R, nnz, v, infos[1] if len(infos) > 1 else None, joined=join,
                           one_query=not T0 or _one_query(d_it))   # (suffix tiles hold one query each)

    def _joined(self, p_it: np.ndarray, B: int, P: int, c: int, grid: int):
        """The join's numbering of one prefix's prefill items (_join_rows, into p_it) and the
        merge map it gives: (state rows, (merge_partial_start [B], merge_indptr [B + 1])).
        Remembered by (B, P, the prefill grid), as the items themselves (_prefill_items): steady
        decode steps keep both."""
        hit = self._tiles_memo.get(("join", B, P, grid))
        if hit is None:
            tq, r = self.prefill.tile_q, self._ar[:B]
            rows = _join_rows(p_it, tq)
            start = ((r // tq) * (c * tq) + r % tq).astype(np.int32)
            hit = self._remember(("join", B, P, grid), (p_it[5].copy(), rows, (start, self._ar[:B + 1] * c)))
        p_it[5] = hit[0]   # (item_merge is -1 already: _prefill_items' _state_rows)
        return hit[1], hit[2]

    def _one_prefix_tiles(self, B: int, T0: int):
        """(group, first real row, rows) of each decode query tile, as _decode_items makes them
        for one prefix: its T0 tiles of tile_q requests (group 0), then each request's suffix
        (group b + 1). Remembered: they depend only on B and T0."""
        hit = self._tiles_memo.get((B, T0))
        if hit is None:
            tq, T = self.planner.tile_q, T0 + B
            t_grp, t_row, t_len = (np.empty(T, np.int64) for _ in range(3))
            t_grp[:T0], t_grp[T0:] = 0, self._ar[1:B + 1]
            t_row[:T0], t_row[T0:] = self._ar[:T0] * tq, self._ar[:B]
            t_len[:T0], t_len[T0:] = tq, 1
            if T0:
                t_len[T0 - 1] = B - (T0 - 1) * tq   # the prefix's last tile holds the rest
            hit = self._remember((B, T0), (t_grp, t_row, t_len))
        return hit

    def _remember(self, key, value):
        """`value`, kept in _tiles_memo under `key` (cleared when full: serving loops keep to a
        few batch shapes)."""
        if len(self._tiles_memo) >= PREFILL_MEMO:
            self._tiles_memo.clear()
        self._tiles_memo[key] = value
        return value

    def _write_parts(self, buf, parts, R: int, Bp: int, N: int) -> list[PlanInfo]:
        """Each family's items, queues and header into its plan part."""
        infos = []
        for it, res, planner, part in parts:
            n, C = it.shape[1], planner.num_ctas
            part["_items"][:, :n] = it
            wi = part["work_indptr"]
            wi[0] = 0
            wi[1:C + 1] = res["wi"] if "wi" in res else np.add.accumulate(res["counts"])   # (cumsum casting into int32 out= is slower)
            part["merge_indptr"][0] = 0
            F.write_info(part, n, 0, R, Bp, planner.tile_q, self.page_size, C, N, 0)
            infos.append(PlanInfo(n, 0, R, Bp, N, C, planner.tile_q, self.page_size, res["L"], res["split_tiles"],
                                  res["loads"], buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8),
                                  part, res["mode"]))
        return infos

    def _fold_map(self, v: dict, it: np.ndarray, level_of: np.ndarray, N: int, L: int, R: int) -> None:
        """The fold map: each query row's state rows in (level, KV start) order. State rows are
        numbered in item order (decode's items, then prefill's), so expanded element e (item
        owner[e], row j[e]) IS state row e, and the fold's order is the argsort of the keys
        (row * L + level, KV start)."""
        owner, j = _repeat_index(it[2], self._ar)
        row = it[1].take(owner) + j
        item_key = level_of.take(it[0]).astype(np.int64) << 31
        item_key += it[3]
        key = row * (L << 31)
        key += item_key.take(owner)
        v["fold_rows"][:R] = key.argsort(kind="stable")   # distinct keys: any sort; stable is the fastest on int64
        fi = v["fold_indptr"]
        fi[0] = 0
        np.cumsum(np.bincount(row, minlength=N), out=fi[1:N + 1])

    def _decode_items(self, pb: Batch, real0: np.ndarray, groups: np.ndarray | None, unsplit: bool = False):
        """The decode family's items for `groups` (None: all): their query tiles (tile_q real
        query rows each) scheduled as one-query requests -- Algorithm 1 only needs each tile's
        KV (the cost model's per-query term is noise next to a shared prefix), and the decode
        form is the planner's fast path -- then written for the real tiles, in queue order.
        `unsplit`: no tile's KV split (one item each: join_unsplit's joinable suffixes)."""
        tq = self.planner.tile_q
        qo_len = pb.qo_len if groups is None else pb.qo_len.take(groups)
        if qo_len.shape[0] == 0 or qo_len.item(qo_len.argmax()) <= tq:   # one tile per group
            t_grp = self._ar[:pb.batch] if groups is None else groups
            t_row, t_len = real0.take(t_grp), qo_len
        else:
            t_g, t_j = _repeat_index((qo_len + (tq - 1)) // tq, self._ar)
            t_grp = t_g if groups is None else groups.take(t_g)
            t_j *= tq
            t_row = real0.take(t_grp) + t_j
            t_len = np.minimum(qo_len.take(t_g) - t_j, tq)
        return self._tile_items(t_grp, t_row, t_len, pb.kv_len.take(t_grp), unsplit)

    def _suffix_items(self, t_kv):
        """_tile_items for decode tiles that are the B suffixes alone (tile b: group b + 1, real
        row b, one query): the schedule's items of one-query requests already hold the row and
        query count (item_qo_start = the tile, item_qo_len = 1), so only the group is left.
        Where no suffix splits, the schedule is the plain planner's one-tile fast path
        (tile_table._balanced: the same LPT, bounds and queue order as Planner._schedule, in
        fewer numpy calls; tests/test_cascade_plan.py holds the plans to plan_union's bytes)."""
        res = self._unsplit_suffixes(t_kv)
        if res is not None:
            return res["items"].take(res["final"], axis=1), res
        res = self.planner._schedule(Batch(self._ar32[:t_kv.shape[0] + 1], None, None, None,
                                           self._ones[:t_kv.shape[0]], t_kv, self.page_size, 1), partials=False)
        it = res["items"].copy() if res["final"] is None else res["items"].take(res["final"], axis=1)
        it[0] += 1
        return it, res

    def _suffix_pages(self, B: int, own: int, lcp: int) -> np.ndarray:
        """Each suffix's first page in the plan's page list (after the prefix's lcp): lcp + b own.
        Remembered: steady decode steps keep B, own and lcp."""
        hit = self._tiles_memo.get(("pages", B, own, lcp))
        if hit is None:
            hit = self._remember(("pages", B, own, lcp), (self._ar[:B] * own + lcp).astype(np.int32))
        return hit

    def _unsplit_suffixes(self, t_kv):
        """Planner._schedule's result for one-query tiles of KV `t_kv` where Algorithm 1 splits
        none of them (auto or balanced, LPT queue order), through tile_table._balanced; None
        where it would split one, auto weighs the contiguous partition, or the mode differs."""
        p, T = self.planner, t_kv.shape[0]
        if p.mode not in ("auto", "balanced") or p.chunk_runs or p.queue_order != "lpt" or not T:
            return None
        f = COST_ALPHA + COST_GAMMA
        kv_total = int(_ADD(t_kv))
        L = tile_table.chunk_bound(p, kv_total)
        kvmax = t_kv.item(t_kv.argmax())
        if L >= tile_table.SAFE_KV_TOKENS or not tile_table.one_chunk(kvmax, L):   # (some tile splits)
            return None
        tile_table.tiles(p)   # (_balanced's scratch)
        # (costs within [f, kvmax + f]: every suffix has KV >= 0)
        res = tile_table._balanced(p, t_kv + f, kv_total + f * T, L, lambda: None, None, (kvmax + f, f))
        if res is None:   # (auto asked for the contiguous partition: the general path decides)
            return None
        it = self._suffix_rows(T)
        it[4] = t_kv
        return dict(n=T, L=res["L"], loads=res["loads"], wi=res["wi"], items=it, final=res["order"], merge_rows=0,
                    partial_rows=0, split_tiles=0, mode="balanced", queue_order="lpt", join_rows=True)
        # (wi: work_indptr[1:]; join_rows: item_partial -1 and item_merge the row, the join's)

    def _suffix_rows(self, T: int) -> np.ndarray:
        """Item rows of T suffix tiles in tile order but the KV end: group b + 1, row b, one query,
        KV from 0, and the join's item_partial -1 / item_merge b (rewritten where the plan folds).
        Remembered per T (a view of it is filled each step)."""
        hit = self._tiles_memo.get(("suffix", T))
        if hit is None:
            hit = self._remember(("suffix", T), np.zeros((8, T), np.int32))
            hit[0] = self._ar[1:T + 1]
            hit[1] = hit[6] = self._ar[:T]
            hit[2], hit[5] = 1, -1
        return hit

    def _tile_items(self, t_grp, t_row, t_len, t_kv, unsplit: bool = False):
        """Decode query tiles (group, first real row, rows, KV tokens each) scheduled as
        one-query requests, then the items written for the real tiles, in queue order.
        `unsplit`: Algorithm 1's chunk bound raised to the longest tile (one item per tile)."""
        T = t_grp.shape[0]
        floor = self.planner.min_chunk
        if unsplit and T:   # (the planner's chunk floor, for this schedule only)
            self.planner.min_chunk = max(floor, -(-t_kv.item(t_kv.argmax()) // self.page_size) * self.page_size)
        try:
            res = self.planner._schedule(Batch(self._ar32[:T + 1], None, None, None, self._ones[:T], t_kv,
                                               self.page_size, 1), partials=False)
        finally:
            self.planner.min_chunk = floor
        it = res["items"] if res["final"] is None else res["items"].take(res["final"], axis=1)
        tile = it[0]
        grp = t_grp.take(tile)
        it[2] = t_len.take(tile)
        it[1] = t_row.take(tile)           # (before it[0], which `tile` views, is overwritten)
        it[0] = grp
        return it, res

    def _prefill_items(self, qo_len: np.ndarray, kv_len: np.ndarray, groups: np.ndarray, row0: np.ndarray | None,
                       planner: Planner | None = None):
        """The prefill family's items for `groups` (pseudo-requests of qo_len queries from real
        row row0, over kv_len KV tokens): each group one request of its real query count (tiles
        of the prefill tile_q), no causal horizon (the kernel masks with the levels' positions),
        KV split by Algorithm 1 over the grid of `planner` (None: the prefill planner; or its
        narrow one). `row0` None: the one group is pseudo-request 0 from row 0. Returns (items,
        schedule, template, state rows): item_partial counts the state rows from the part's
        first; for one group whose every row has the same number c of states, template [rows, c]
        is each row's state rows (counted the same way) in KV order, else None.

        The schedule depends only on the groups' query and KV lengths and the grid, which
        consecutive decode steps keep (a shared prefix does not grow; requests joining or leaving
        change it): the last few are remembered (`PREFILL_MEMO` entries, keyed by the grid too)
        and a step with the same shared groups on the same grid reuses its schedule -- the same
        items it would compute."""
        planner = planner or self.prefill
        key = (planner.num_ctas, qo_len.tobytes() + kv_len.tobytes())
        hit = self._prefill_memo.get(key)
        if hit is None:
            G = groups.shape[0]
            qo_indptr = np.zeros(G + 1, np.int64)
            np.cumsum(qo_len, out=qo_indptr[1:])
            res = planner._schedule(Batch(qo_indptr, None, None, None, qo_len, kv_len, self.page_size,
                                               qo_len.item(qo_len.argmax()) if G else 0), partials=False)
            it = res["items"] if res["final"] is None else res["items"].take(res["final"], axis=1)
            it[1] -= qo_indptr.take(it[0])   # rows relative to the group's first
            rows = _state_rows(it, 0)         # state rows from the part's first
            if len(self._prefill_memo) >= PREFILL_MEMO:
                self._prefill_memo.clear()
            tmpl = _fold_template(it, qo_len, self.prefill.tile_q) if G == 1 else None
            hit = self._prefill_memo[key] = (it, res, tmpl, rows)
        it, res, tmpl, rows = hit[0].copy(), hit[1], hit[2], hit[3]
        if row0 is not None:   # (None: the items say so already)
            grp = groups.take(it[0])
            it[1] += row0.take(it[0])
            it[0] = grp
        return it, res, tmpl, rows


def _tile_kv_order(it: np.ndarray) -> np.ndarray:
    """The order of one group's prefill items by query tile (first row), then by KV start."""
    return (it[1].astype(np.int64) << 31 | it[3]).argsort(kind="stable")


def _fold_template(it: np.ndarray, qo_len: np.ndarray, tile_q: int):
    """One group's items (rows relative to its first, state rows in it[5] from 0): [rows, c],
    each row's state rows in KV order, where every query tile has the same c chunks (balanced
    plans of one group: its tiles read the same KV); else None."""
    N, n = int(qo_len[0]), it.shape[1]
    T = -(-N // tile_q)
    if n % T:
        return None
    c = n // T
    order = _tile_kv_order(it)
    if not (it[1].take(order).reshape(T, c) == (np.arange(T) * tile_q)[:, None]).all():
        return None
    base = it[5].take(order).reshape(T, c)   # state row of each tile's chunks at its first row
    r = np.arange(N)
    return base[r // tile_q] + (r % tile_q)[:, None]


def _join_rows(it: np.ndarray, tile_q: int) -> int:
    """One group's prefill items (balanced: every tile the same c chunks) numbered for the
    decode kernel's join: chunk k of tile T writes state rows (T * c + k) * tile_q + j, so row
    r's states are start + k * tile_q. Returns the rows spanned (tiles * c * tile_q)."""
    it[5][_tile_kv_order(it)] = np.arange(it.shape[1]) * tile_q
    return it.shape[1] * tile_q


def _one_prefix_union(union: Union, B: int) -> bool:
    """Whether `union` is one shared prefix (group 0: all B single-query requests' rows) over each
    request's own suffix (groups 1..B) -- two levels."""
    pb = union.batch
    return (union.num_levels == 2 and pb.batch == B + 1 and union.num_qo_tokens == B and pb.qo_len.item(0) == B
            and bool((pb.qo_len[1:] == 1).all()))


def _one_query(d_it: np.ndarray) -> bool:
    """Whether every decode item holds one query row (item rows it[2] <= 1)."""
    return d_it.shape[1] == 0 or bool(d_it[2].max() <= 1)


def _state_rows(it: np.ndarray, first: int) -> int:
    """Number the items' state rows from `first` in item order (each item writes its own rows;
    nothing merges in the kernel: the fold does): item_partial, and item_merge = -1. Returns
    the next free row."""
    ql = it[2]
    it[6] = -1
    if not ql.shape[0]:
        return first
    ends = np.add.accumulate(ql)   # (np.cumsum's wrapper costs more than the sum at these sizes)
    np.subtract(ends, ql, out=it[5])
    if first:
        it[5] += first
    return first + ends.item(-1)

def execute_cascade(info: CascadeInfo, q, k_cache, v_cache, var=None, kv_layout: str = "NHD"):
    """Run a cascade plan in float64 the way the kernels do (rtattn.plan.executor for each
    family's items, with level positions; then the fold in the plan's order). Returns (O, LSE)."""
    from .executor import execute_plan, merge_sigmoid, merge_states
    from .reference import Variant
    var = var or Variant()
    v = info.views
    pv = v["plan"]
    q_pos, kv_off = v["q_pos"], v["kv_offset"]

    def q_index(b, rows):   # LevelPositions::base_qo_idx
        start = int(pv["req_qo_start"][b])
        shift = int(pv["req_kv_len"][b]) - int(pv["req_qo_len"][b]) + int(kv_off[b])
        return q_pos[start + rows].astype(np.int64) - shift

    if info.flat:   # the decode family's own plan: merged or written through, no fold
        return execute_plan(pv, q, k_cache, v_cache, var, kv_layout, q_index=q_index)
    merge = merge_sigmoid if var.sigmoid else merge_states
    if info.joined:   # the decode kernel's join: each row's prefill states (its merge entry), then its own
        pre: dict = {}
        execute_plan(info.prefill.views, q, k_cache, v_cache, var, kv_layout, q_index=q_index, partials=pre)
        O, LSE = execute_plan(pv, q, k_cache, v_cache, var, kv_layout, q_index=q_index)
        mi, start, step = pv["merge_indptr"], pv["merge_partial_start"], pv["merge_partial_stride"]
        for t in range(info.num_qo_tokens):
            o, lse = np.zeros(q.shape[1:]), np.full(q.shape[1], -np.inf)
            for k in range(int(mi[t + 1] - mi[t])):
                r = int(start[t]) + k * int(step[t])
                o, lse = merge(o, lse, pre["o"][r], pre["lse"][r])
            O[t], LSE[t] = merge(o, lse, O[t], LSE[t])
        return O, LSE
    states_o = states_lse = None
    for part in info._parts():   # each family's kernel writes its own items' state rows
        parts: dict = {}
        execute_plan(part.views, q, k_cache, v_cache, var, kv_layout, q_index=q_index, partials=parts)
        if states_o is None:
            states_o, states_lse = parts["o"], parts["lse"]
        else:
            mine = ~np.isnan(parts["lse"][:, 0])
            states_o[mine], states_lse[mine] = parts["o"][mine], parts["lse"][mine]
    N, H, D = q.shape
    O = np.full((N, H, D), np.nan)
    LSE = np.full((N, H), np.nan)
    fi, rows = v["fold_indptr"], v["fold_rows"]
    for t in range(info.num_qo_tokens):
        ids = rows[int(fi[t]):int(fi[t + 1])]
        o, lse = np.zeros((H, D)), np.full(H, -np.inf)
        for r in ids:
            o, lse = merge(o, lse, states_o[r], states_lse[r])
        O[t], LSE[t] = o, lse
    return O, LSE
