"""The cascade planner: every level of a step in one plan set, folded in a fixed order.

All levels are planned together, as one batch of pseudo-requests (rtattn.plan.levels), by one
Planner: Algorithm 1 balances the shared prefixes' chunks and the suffixes' items over the
same CTAs, and one persistent kernel launch runs them all. A shared group is a pseudo-request
whose queries are all its requests' queries, so its KV is read once per query tile (tile_q
queries) instead of once per request.

After planning, the plan is rewritten for the fold: every item writes a float32 state row
(levels share query rows, so nothing writes the output directly), items read the real query
rows, and the fold map lists each query row's state rows in (level, KV) order; the fold
kernel combines them with ⊕ into the output and LSE. The positions the variants need
(absolute query positions, each group's first KV position) sit next to the plan.

Plan set parts: "plan" (the PlanLayout of the union), "q_pos" [max_qo_tokens],
"kv_offset" [pseudo-requests], "fold_indptr" [max_qo_tokens + 1], "fold_rows" [state rows],
"fold_info" [FOLD_INFO_LEN] = (query rows, state rows, levels).

Prefill hook: the shared groups (pseudo-requests with many queries and long KV) are what
tensor-core prefill tiles are for; today the decode family plans every group. With a prefill
family, `plan_union` splits the union's groups by family (shared groups, union.batch.qo_len
> tile_q, to prefill), the plan set gains a second part ("prefill": its PlanLayout), each part
gets its own schedule and kernel, and the state rows of the second part start after the
first's; the positions, the fold map and the fold kernel stay as they are.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from . import fields as F
from .inspector import Planner, PlanInfo, _repeat_index
from .layout import Batch, validate_batch
from .prefix_tree import prefix_union
from .levels import Union, check_causal, union_batch
from .planset import PlanSet

FOLD_INFO_LEN = 4


@dataclass
class CascadeInfo:
    plan: PlanInfo          # the union plan (its counts are for pseudo-requests)
    union: Union
    num_levels: int
    num_qo_tokens: int
    num_state_rows: int
    views: dict

    def _item_levels(self) -> np.ndarray:
        return self.union.level_of.take(self.plan.views["item_request"][:self.plan.num_items])

    @property
    def level_items(self) -> np.ndarray:
        """int64[levels]: work items of each level."""
        return np.bincount(self._item_levels(), minlength=self.num_levels)

    @property
    def level_kv_tokens(self) -> np.ndarray:
        """int64[levels]: KV tokens each level's items read (per KV head; a shared prefix once
        per query tile)."""
        pv, n = self.plan.views, self.plan.num_items
        kv = pv["item_kv_end"][:n].astype(np.int64) - pv["item_kv_start"][:n]
        return np.bincount(self._item_levels(), weights=kv, minlength=self.num_levels).astype(np.int64)


class CascadePlanner:
    """Plans cascades of up to `num_levels` levels over up to `max_batch` requests and
    `max_qo_tokens` query rows with `planner`, a Planner built for the union: bounds
    (max_batch * num_levels, max_qo_tokens * num_levels, max_pages). `max_pages` bounds
    the pages of all levels together (a shared page counts once). `create` builds both."""

    def __init__(self, planner: Planner, max_batch: int, max_qo_tokens: int, num_levels: int = 2):
        b = planner.bounds
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        if b.max_batch < max_batch * num_levels or b.max_qo_tokens < max_qo_tokens * num_levels:
            raise ValueError("the cascade's planner needs bounds for every level's groups "
                             f"(max_batch >= {max_batch * num_levels}, max_qo_tokens >= {max_qo_tokens * num_levels})")
        # Query tiles are scheduled as one-query requests (plan_union): no causal horizon may
        # clip them; a causal variant masks in the kernel, with the levels' real positions.
        planner.causal = False
        self.planner, self.num_levels = planner, num_levels
        self.max_batch, self.max_qo_tokens, self.page_size = max_batch, max_qo_tokens, planner.page_size
        self.max_state_rows = b.max_partial_rows + b.max_qo_tokens
        self.planset = PlanSet({
            "plan": planner.layout, "q_pos": max_qo_tokens, "kv_offset": b.max_batch,
            "fold_indptr": max_qo_tokens + 1, "fold_rows": self.max_state_rows, "fold_info": FOLD_INFO_LEN})
        self._views = F.ViewCache(self.planset.views)
        self._ar = np.arange(max(self.max_state_rows, b.max_tiles, b.max_batch) + 1, dtype=np.int64)
        self._ar32 = np.arange(b.max_tiles + 1, dtype=np.int32)
        self._ones = np.ones(b.max_tiles, np.int32)

    @classmethod
    def create(cls, max_batch: int, max_qo_tokens: int, max_pages: int, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, page_size: int, *, num_levels: int = 2, **planner_kw) -> "CascadePlanner":
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        planner = Planner(max_batch * num_levels, max_qo_tokens * num_levels, max_pages, num_qo_heads,
                          num_kv_heads, head_dim, page_size, max_qo_len=max_qo_tokens, **planner_kw)
        return cls(planner, max_batch, max_qo_tokens, num_levels)

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
        if qo_indptr is None:
            qo_indptr = self._ar32[:B + 1] if B < self._ar32.shape[0] else np.arange(B + 1, dtype=np.int32)
        batch = validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                               num_pages=num_pages, max_batch=self.max_batch, max_qo_tokens=self.max_qo_tokens)
        union = prefix_union(batch, self.num_levels)
        if causal:
            R = union.req_qo_indptr.shape[0] - 1
            check_causal(union.batch.qo_len[-R:] if R else union.batch.qo_len[:0], union.batch.kv_len[-R:] if R else
                         union.batch.kv_len[:0])
        return self.plan_union(union, out)

    def plan_union(self, union: Union, out=None) -> CascadeInfo:
        """Plan the pseudo-batch of all levels into the plan set (plain numpy on small
        arrays, kept to few calls: this is on the per-step host path)."""
        buf = out if out is not None else self.planset.allocate()
        v = self._views.get(buf)
        pv = v["plan"]
        pb, N, L = union.batch, union.num_qo_tokens, union.num_levels
        tq, ps, C, Bp = self.planner.tile_q, self.page_size, self.num_ctas, pb.batch
        # Query tiles of every group (tile_q real query rows each), scheduled as one-query
        # requests: Algorithm 1 only needs each tile's KV (the cost model's per-query term
        # is noise next to a shared prefix), and the decode form is the planner's fast path.
        # The items are then written for the real tiles, every one to its own state rows.
        nnz = pb.kv_indptr.item(-1)
        if nnz > self.planner.bounds.max_pages:
            raise ValueError(f"the levels hold {nnz} pages, exceeding max_pages={self.planner.bounds.max_pages} "
                             f"(a page counts once per level group that holds it)")
        real0 = pb.qo_indptr[:-1] - union.row_shift          # each group's first real query row
        if pb.qo_max <= tq:                                    # one tile per group
            t_grp, t_row, t_len = self._ar[:Bp], real0, pb.qo_len
        else:
            t_grp, t_j = _repeat_index((pb.qo_len + (tq - 1)) // tq, self._ar)
            t_j *= tq
            t_row = real0[t_grp] + t_j
            t_len = np.minimum(pb.qo_len[t_grp] - t_j, tq)
        T = t_grp.shape[0]
        res = self.planner._schedule(Batch(self._ar32[:T + 1], None, None, None, self._ones[:T],
                                           pb.kv_len.take(t_grp), ps, 1), partials=False)
        n = res["n"]
        it = res["items"] if res["final"] is None else res["items"].take(res["final"], axis=1)
        tile = it[0]
        grp = t_grp.take(tile)
        ql = t_len.take(tile)
        it[1] = t_row.take(tile)           # (before it[0], which `tile` views, is overwritten)
        ends = np.cumsum(ql)
        R = ends.item(-1) if n else 0
        if R > self.max_state_rows:
            raise ValueError(f"plan needs {R} state rows, exceeding {self.max_state_rows}")
        it[0] = grp
        it[2] = ql
        it[5] = ends - ql                  # every item writes its own state rows, in queue order
        it[6] = -1                         # nothing merges in the kernel: the fold does
        it[7] = pb.kv_indptr.take(grp)
        pv["_items"][:, :n] = it
        wi = pv["work_indptr"]
        wi[0] = 0
        np.cumsum(res["counts"], out=wi[1:C + 1])
        pv["req_qo_start"][:Bp] = real0
        pv["req_qo_len"][:Bp] = pb.qo_len
        pv["req_kv_page_start"][:Bp] = pb.kv_indptr[:Bp]
        pv["req_kv_len"][:Bp] = pb.kv_len
        pv["kv_indices"][:nnz] = pb.kv_indices[:nnz]
        pv["merge_indptr"][0] = 0
        struct.pack_into("=8i", pv["plan_info"], 0, n, 0, R, Bp, tq, ps, C, N)
        # The fold map: each query row's state rows in (level, KV start) order. State rows are
        # numbered in item order, so expanded element e (item owner[e], row j[e]) IS state
        # row e, and the fold's order is the argsort of the keys (row * L + level, KV start).
        owner, j = _repeat_index(ql, self._ar, ends)
        row = it[1].take(owner) + j
        item_key = union.level_of.take(grp).astype(np.int64) << 31
        item_key += it[3]
        key = row * (L << 31)
        key += item_key.take(owner)
        v["fold_rows"][:R] = key.argsort()               # distinct keys: any sort is stable
        fi = v["fold_indptr"]
        fi[0] = 0
        np.cumsum(np.bincount(row, minlength=N), out=fi[1:N + 1])
        v["q_pos"][:N] = union.q_pos
        v["kv_offset"][:Bp] = union.kv_offset
        v["fold_info"][:3] = (N, R, L)
        info = PlanInfo(n, 0, R, Bp, N, C, tq, ps, res["L"], res["split_tiles"], res["loads"],
                        buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8), pv)
        return CascadeInfo(info, union, L, N, R, v)

def execute_cascade(info: CascadeInfo, q, k_cache, v_cache, var=None, kv_layout: str = "NHD"):
    """Run a cascade plan in float64 the way the kernels do (rtattn.plan.executor for the
    items, with level positions; then the fold in the plan's order). Returns (O, LSE)."""
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

    parts: dict = {}
    execute_plan(pv, q, k_cache, v_cache, var, kv_layout, q_index=q_index, partials=parts)
    N, H, D = q.shape
    O = np.full((N, H, D), np.nan)
    LSE = np.full((N, H), np.nan)
    merge = merge_sigmoid if var.sigmoid else merge_states
    fi, rows = v["fold_indptr"], v["fold_rows"]
    for t in range(info.num_qo_tokens):
        ids = rows[int(fi[t]):int(fi[t + 1])]
        o, lse = np.zeros((H, D)), np.full(H, -np.inf)
        for r in ids:
            o, lse = merge(o, lse, parts["o"][r], parts["lse"][r])
        O[t], LSE[t] = o, lse
    return O, LSE
