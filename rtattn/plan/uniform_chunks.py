"""rtattn.plan.uniform's batches whose tiles split into Algorithm 1's chunks (a few long requests of
one query length: multi-token verification at batch 4-12 over KV ~1K splits every tile into a few
chunks of L), planned balanced or contiguous as auto decides and written straight into the plan.

Everything of such a plan but the last chunks' costs and KV ends, the items' first pages and the
schedule follows from (batch, query length qu, L, each tile's chunk count): the items' rows in
layout order, the split tiles' partial rows, the merge map and the header. A serving step whose
chunk counts repeat (KV a few tokens longer) takes them from a Chunks kept per that key (compared
exactly: a plan is always the plan of its inputs), rewrites the varying rows, sorts the chunk
costs and takes the rows in queue order. The schedule is tile_table._schedule's (the same costs,
tile_table._balanced, auto's contiguous alternative uniform's own), so the bytes are the numpy
path's (tests/test_tile_table_plan.py).
"""
from __future__ import annotations

import numpy as np

from . import inspector, uniform   # (PlanInfo; _weigh, _keep: both import this module, read at call time)
from .fields import PLAN_INFO_LEN, write_info, write_requests

_ACC = np.add.accumulate
KEPT = 64   # Chunks a planner keeps (cleared when full: serving loops keep to a few compositions)
# item rows (inspector's order)
_REQ, _QO_START, _QO_LEN, _KV_START, _KV_END, _PARTIAL, _MERGE, _PAGE = range(8)


class Chunks:
    """A uniform batch's chunks as far as (B, qu, L, chunks per tile `nch`) decide them: the item
    rows tile-major in layout order (KV ends of last chunks and first pages rewritten per plan),
    each item's tile, each tile's last item, the chunk costs (last chunks' per plan), the merge map
    and the header."""

    __slots__ = ("n", "M", "P", "S", "rep", "last", "last_off", "last_cost", "cost", "rows", "kv_end",
                 "page", "m_indptr", "merge", "header", "_views")

    def __init__(self, p, qu, B, L, f, nch, pend, st, M, P):
        ar, n, S = p._ar, pend.item(-1), st.shape[0]
        self.n, self.M, self.P, self.S = n, M, P, S
        first = pend - nch
        rep = self.rep = ar[:B].repeat(nch)    # each item's tile
        j = ar[:n] - first[rep]                # ... and its chunk in the tile
        self.last = pend - 1
        self.last_off = (nch - 1) * L          # a tile's last chunk costs its unsplit cost less this
        self.last_cost = np.zeros(B, dtype=np.int64)
        self.cost = np.full(n, L + f, dtype=np.int64)
        rows = self.rows = np.zeros((n, 8), dtype=np.int32)
        rows[:, _REQ] = rep
        rows[:, _QO_START] = rep * qu
        rows[:, _QO_LEN] = qu
        rows[:, _KV_START] = j * L
        rows[:, _KV_END] = (j + 1) * L
        # a split tile's first partial row (qu x the pieces of the split tiles before it) and first
        # merge entry (qu x the split tiles before it); -1 for the others (their one item)
        part, merge = np.full(B, -1, dtype=np.int64), np.full(B, -1, dtype=np.int64)
        pieces = nch[st]
        part[st] = (_ACC(pieces) - pieces) * qu
        merge[st] = ar[:S] * qu
        rows[:, _PARTIAL] = part[rep] + j * qu   # (j = 0 in an unsplit tile)
        rows[:, _MERGE] = merge[rep]
        self.kv_end, self.page = rows[:, _KV_END], rows[:, _PAGE]
        # merge entry e: split tile e // qu, row e % qu; its pieces, query row and first partial row
        e = ar[:M]
        s, r = e // qu, e % qu
        self.m_indptr = np.zeros(M + 1, dtype=np.int32)
        self.m_indptr[1:] = _ACC(pieces[s])
        self.merge = np.stack((st[s] * qu + r, part[st][s] + r, np.full(M, qu))).astype(np.int32)
        self.header = np.zeros(PLAN_INFO_LEN, dtype=np.int32)
        write_info({"plan_info": self.header}, n, M, P, B, p._tq, p.page_size, p.num_ctas, qu * B, p._fold_chunk)
        self._views = {}   # id(plan views) -> (those views, the items' and merge map's views)

    def views(self, v) -> tuple:
        """The item rows [:n] and the merge map's views [:M + 1] / [:M] in the plan views `v` (kept
        for the few buffers a planner writes into)."""
        hit = self._views.get(id(v))
        if hit is None or hit[0] is not v:
            if len(self._views) >= 4:
                self._views.clear()
            hit = self._views[id(v)] = (v, v["_items"][:, :self.n], v["merge_indptr"][:self.M + 1],
                                        v["_merge"][:, :self.M])
        return hit


def chunks(p, sc, qu, B, L, f, nch) -> Chunks | None:
    """The Chunks of chunk counts `nch` (kept in sc.chunks), or None where a bound is exceeded
    (the table path raises)."""
    key = (B, qu, L, nch.tobytes())
    lay = sc.chunks.get(key)
    if lay is None:
        b = p.bounds
        pend = _ACC(nch)
        st = (nch > 1).nonzero()[0]
        M, P = st.shape[0] * qu, int(nch[st].sum()) * qu
        if pend.item(-1) > b.max_items or P > b.max_partial_rows or M > b.max_merge_rows:
            return None
        if len(sc.chunks) >= KEPT:
            sc.chunks.clear()
        lay = sc.chunks[key] = Chunks(p, qu, B, L, f, nch, pend, st, M, P)
    return lay


def plan(p, tl, sc, out, qo, qu, kv, bv, kp, ids, B, nnz, nq, kv_least, total, total2, L, k, nch, con,
         bounded=False):
    """The plan of a uniform batch split into chunks of L (`k` = L - 1 - tail: every tile has more
    KV than the tail; `nch`: Algorithm 1's chunks per tile, (kv + k) // L) written into `out`
    (auto's contiguous one where it wins; `con`: uniform's contiguous plan if made; `bounded`: as
    tile_table._balanced's): its PlanInfo, or None with nothing written where a bound is exceeded."""
    lay = chunks(p, sc, qu, B, L, sc.f, nch)
    if lay is None:
        return None
    np.subtract(bv.cost, lay.last_off, out=lay.last_cost)
    lay.cost[lay.last] = lay.last_cost   # (a last chunk: L - k .. L + tail tokens, plus f)
    f, tail = sc.f, L - 1 - k
    res, con = uniform._weigh(p, tl, sc, qu, bv, total, kv_least, lay.cost, total2, L, (L + tail + f, f + tail + 1),
                              con, bounded)
    if res is None:
        return None
    if res["mode"] != "balanced":
        return uniform._keep(p, out, sc, con, qo, qu, kv, kp, ids, B, nnz, nq)
    buf, v = p._buffer(out)
    pv = sc.plan_views(v, B)
    write_requests(v, B, qo, qu, kp, kv, nnz, ids, pv.requests)
    v["work_indptr"][0] = 0
    pv.wi[...] = res["wi"]
    n, M = lay.n, lay.M
    lay.kv_end[lay.last] = kv
    lay.page[...] = kp[lay.rep]   # (a take into the strided row costs ~2x)
    taken = sc.taken[:n]
    lay.rows.take(res["order"], axis=0, out=taken, mode="clip")   # (the items in queue order)
    _, it, mi, mg = lay.views(v)
    it[...] = taken.T
    if M:
        mi[...] = lay.m_indptr
        mg[...] = lay.merge
    else:
        v["merge_indptr"][0] = 0
    v["plan_info"][:] = lay.header
    return inspector.PlanInfo(n, M, lay.P, B, nq, p.num_ctas, p._tq, p.page_size, res["L"], lay.S, res["loads"],
                              buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8), v, "balanced")
