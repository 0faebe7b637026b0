"""The planner: Algorithm 1 of the FlashInfer paper, written into fixed offsets.

Work item = (request, query tile of <= tile_q tokens, KV chunk [kv_start, kv_end)).
The kernel grid is fixed: (num_ctas, num_kv_heads); CTA (c, h) runs queue c for
KV head h and all g query heads of that group.  So the plan does not depend on
the head counts except through num_ctas.

Modes
  balanced         chunk bound L = ceil(sum_t kv_t / num_ctas), floored at
                   max(page_size, min_chunk_tokens) and rounded up to a page
                   multiple (chunks start on page boundaries: kernels load whole
                   pages); longest-first (stable) + min-heap on (load, cta id).
  naive            one item per (request, tile), no split, round-robin in order.
  batch-invariant  fixed chunk C at absolute KV positions 0, C, 2C, ...; a
                   request's items and merge order do not depend on the batch.
                   Assignment as in balanced.

Cost of an item (integer, so ties and loads are exact):
  COST_ALPHA * query_tokens + COST_BETA * kv_tokens + COST_GAMMA
  BETA = 1: the unit is one KV token (K+V row load + its dot products for all
  rows of the tile).  ALPHA = 4: a query token loads q and stores o for g
  heads, ~ a few KV rows' worth of traffic.  GAMMA = 64: fixed per-item cost
  (queue read, pipeline fill, and for split items the partial write + merge).

Causal (planner built with causal=True): tile t of request b only needs KV
[0, kv_b - qo_b + last_row_of_tile + 1); the tile's KV is clipped to that
horizon (positions beyond are masked for every row of the tile).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from . import fields as F
from .devices import get_device
from .layout import Batch, check_heads, indptr_from_lengths, validate_batch
from .tiles import TileConfig, num_ctas_for, select_tile

COST_ALPHA = 4
COST_BETA = 1
COST_GAMMA = 64
AUTO_IMBALANCE = 1.06  # mode "auto": slowest CTA / mean load above which contiguous is tried
MIN_CHUNK_TOKENS = 128
DEFAULT_CHUNK_TOKENS = 2048   # batch-invariant chunk


@dataclass
class PlanInfo:
    """What plan() made.  `views` alias `buffer`; entries past the counts are
    unspecified (stale from earlier plans) and never read by the kernels."""

    num_items: int
    num_merge_rows: int
    num_partial_rows: int
    batch: int
    num_qo_tokens: int
    num_ctas: int
    tile_q: int
    page_size: int
    chunk_tokens: int          # the KV chunk bound L used (0: no split, naive)
    num_split_tiles: int
    cta_loads: np.ndarray      # int64[num_ctas], summed item cost per CTA
    buffer: np.ndarray
    views: dict = field(repr=False)

    @property
    def max_load(self) -> int:
        return int(self.cta_loads.max()) if self.cta_loads.size else 0


def item_cost(qo_len, kv_len):
    return COST_ALPHA * qo_len + COST_BETA * kv_len + COST_GAMMA


_MAX = np.maximum.reduce
_ADD = np.add.reduce
_ACC = np.add.accumulate


def _repeat_index(counts: np.ndarray, ar: np.ndarray, ends: np.ndarray | None = None):
    """For counts c_i: (owner index of each of the sum(c) elements, position
    within its owner).  `ar` is a cached arange at least sum(c) long; `ends`
    the inclusive cumsum of counts if the caller has it."""
    if ends is None:
        ends = _ACC(counts, dtype=np.int64)
    n = int(ends[-1]) if ends.shape[0] else 0
    owner = np.repeat(ar[:counts.shape[0]], counts)
    pos = ar[:n] - (ends - counts)[owner]
    return owner, pos


def lpt_assign(cost_sorted: np.ndarray, num_ctas: int, ar: np.ndarray):
    """Longest-processing-time assignment of costs sorted descending (int64).
    Least-loaded CTA first, ties by CTA id.  Returns (cta of each item, load of
    each CTA).

    Key = (load << shift) | cta as one Python int, so heapq compares plain ints
    and the loop body is two C calls.  The first num_ctas items land on CTAs
    0, 1, ... (all loads are 0 then), so the heap starts from them."""
    n = cost_sorted.shape[0]
    m = min(n, num_ctas)
    shift = num_ctas.bit_length()
    mask = (1 << shift) - 1
    heap = ((cost_sorted[:m] << shift) | ar[:m]).tolist()
    heapq.heapify(heap)
    tops = []
    push = heapq.heapreplace
    append = tops.append
    for c in (cost_sorted[m:] << shift).tolist():
        top = heap[0]
        push(heap, top + c)
        append(top)
    cta = np.empty(n, dtype=np.int64)
    cta[:m] = ar[:m]
    cta[m:] = tops
    cta[m:] &= mask
    fin = np.array(heap, dtype=np.int64)
    loads = np.zeros(num_ctas, dtype=np.int64)
    loads[fin & mask] = fin >> shift
    return cta, loads


class Planner:
    """Build once per serving configuration; call plan() once per step.

    Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads,
            head_dim, page_size, device="h200", mode="auto", ...)
    """

    def __init__(self, max_batch: int, max_qo_tokens: int, max_pages: int,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 device="h200", mode: str = "auto", causal: bool = False,
                 tile: TileConfig | None = None, kernel: str = "decode",
                 max_rows: int | None = None, max_qo_len: int | None = None,
                 num_ctas: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 min_chunk_tokens: int = MIN_CHUNK_TOKENS, num_pages_pool: int | None = None):
        self.group = check_heads(num_qo_heads, num_kv_heads)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = get_device(device)
        self.page_size = int(page_size)
        self.causal = bool(causal)
        self.mode = mode
        mql = int(max_qo_len) if max_qo_len else int(max_qo_tokens)
        self.tile = tile or select_tile(self.device, num_qo_heads, num_kv_heads, head_dim,
                                        mql, kernel=kernel, max_rows=max_rows)
        if self.tile.tile_q * self.group > self.tile.max_rows:
            raise ValueError(f"tile_q={self.tile.tile_q} x g={self.group} rows exceed "
                             f"max_rows={self.tile.max_rows}")
        self.num_ctas = int(num_ctas) if num_ctas else num_ctas_for(self.device, self.tile,
                                                                   num_kv_heads)
        if mode == "batch-invariant":
            ct = -(-int(chunk_tokens) // self.page_size) * self.page_size
        else:
            ct = 0
        self.bounds = F.PlanBounds(int(max_batch), int(max_qo_tokens), int(max_pages),
                                   self.num_ctas, self.tile.tile_q, mode, self.page_size, ct,
                                   mql)
        self.layout = F.PlanLayout(self.bounds)
        floor = max(self.page_size, int(min_chunk_tokens))
        self.min_chunk = -(-floor // self.page_size) * self.page_size
        self.num_pages_pool = num_pages_pool
        b = self.bounds
        if b.max_kv_tokens >= 2**31:
            raise ValueError(f"max_pages * page_size = {b.max_kv_tokens} does not fit int32")
        # one cached arange serves every "0..n-1" the scheduler needs
        self._ar = np.arange(max(b.max_items, b.max_partial_rows, b.max_tiles, b.max_batch,
                                 b.max_merge_rows) + 1, dtype=np.int64)
        self._vcache = {}   # id(out buffer) -> (buffer, views): callers reuse a few pinned buffers

    # convenience ---------------------------------------------------------------
    @property
    def tile_q(self) -> int:
        return self.tile.tile_q

    def workspace_bytes(self) -> int:
        return self.layout.workspace_bytes(self.num_qo_heads, self.head_dim)

    def plan_lengths(self, qo_lens, kv_lens, out=None) -> PlanInfo:
        """Plan from lengths alone (identity page ids) -- CLI, benchmarks."""
        from .layout import paged_kv
        kv_indptr, kv_indices, last = paged_kv(kv_lens, self.page_size)
        return self.plan(indptr_from_lengths(qo_lens), kv_indptr, kv_indices, last, out=out)

    # the step ------------------------------------------------------------------
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, out=None) -> PlanInfo:
        b = self.bounds
        batch = validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                               self.page_size, num_pages=self.num_pages_pool,
                               causal=self.causal, max_batch=b.max_batch,
                               max_qo_tokens=b.max_qo_tokens, max_pages=b.max_pages,
                               max_qo_len=b.max_qo_len)
        items = self._schedule(batch)
        if out is None:
            buf = self.layout.allocate()
            views = self.layout.views(buf)
        elif id(out) in self._vcache and self._vcache[id(out)][0] is out:
            buf, views = out, self._vcache[id(out)][1]   # a (pinned) buffer seen before
        else:
            buf, views = out, self.layout.views(out)
            if len(self._vcache) >= 4:
                self._vcache.clear()
            self._vcache[id(out)] = (out, views)
        self._write(views, batch, items)
        return PlanInfo(items["n"], items["merge_rows"], items["partial_rows"], batch.batch,
                        int(batch.qo_indptr[-1]), self.num_ctas, self.tile_q, self.page_size,
                        items["L"], items["split_tiles"], items["loads"],
                        buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8),
                        views)

    def _schedule(self, bt: Batch) -> dict:
        """Tiles -> chunks -> items, LPT assignment, partial rows, merge map.
        Plain numpy on small arrays: every call here is ~0.5-1.5 us, so the code
        keeps the call count low (ufunc methods directly, one 2-D item array,
        fast paths for pure decode and for unsplit plans)."""
        tq, C, mode, B = self.tile_q, self.num_ctas, self.mode, bt.batch
        qo_len, kv_len, qo_indptr = bt.qo_len, bt.kv_len, bt.qo_indptr
        decode = int(qo_indptr[-1]) == B and (B == 0 or bt.qo_max == 1)
        if decode:   # every request is one 1-token tile
            t_req = self._ar[:B]
            t_off = None
            t_qlen = qo_len
            t_qs = qo_indptr[:B]
            t_kv = kv_len
        else:
            t_req, tj = _repeat_index(np.floor_divide(qo_len + (tq - 1), tq), self._ar)
            t_off = tj * tq
            t_qlen = np.minimum(qo_len[t_req] - t_off, tq)
            t_qs = qo_indptr[t_req] + t_off
            t_kv = kv_len[t_req]
            if self.causal:   # clip to the horizon of the tile's last row
                t_kv = t_kv - qo_len[t_req] + t_off + t_qlen
        T = t_req.shape[0]
        # Chunk bound L (tokens, page multiple) and chunks per tile.
        if mode == "naive" or T == 0:
            L, maxc = 0, 1
        else:
            if mode == "batch-invariant":
                L = self.bounds.chunk_tokens
            else:
                L = max(-(-int(_ADD(t_kv, dtype=np.int64)) // C), self.min_chunk)
                L = -(-L // self.page_size) * self.page_size
            nchunk = np.floor_divide(t_kv + (L - 1), L)
            np.maximum(nchunk, 1, out=nchunk)
            maxc = int(_MAX(nchunk))
        if mode == "contiguous" and T > 0:
            return self._contiguous(decode, t_req, t_qs, t_qlen, t_kv)
        # Items: rows request, qo_start, qo_len, kv_start, kv_end, partial, merge.
        if maxc == 1:
            n = T
            it = np.empty((7, n), dtype=np.int32)
            it[0], it[1], it[2], it[3], it[4], it[5:] = t_req, t_qs, t_qlen, 0, t_kv, -1
            i_tile = i_chunk = None
        else:
            ends = _ACC(nchunk, dtype=np.int64)
            n = int(ends[-1])
            if n > self.bounds.max_items:
                raise ValueError(f"plan needs {n} work items, exceeding max_items="
                                 f"{self.bounds.max_items} (mode={mode})")
            i_tile, i_chunk = _repeat_index(nchunk, self._ar, ends)
            it = np.empty((7, n), dtype=np.int32)
            if decode:   # t_req is the identity, every tile has one row
                it[0] = i_tile
                it[1] = qo_indptr[i_tile]
                it[2] = 1
            else:
                it[0] = t_req[i_tile]
                it[1] = t_qs[i_tile]
                it[2] = t_qlen[i_tile]
            np.multiply(i_chunk, L, out=it[3])
            np.minimum(it[3] + L, t_kv[i_tile], out=it[4])
        cost = np.subtract(it[4], it[3], dtype=np.int64)
        if decode:
            cost += COST_ALPHA + COST_GAMMA
        else:
            cost += COST_ALPHA * it[2] + COST_GAMMA
        # Assignment: naive = round robin in item order; else LPT.
        if mode == "naive":
            order, cs = None, cost
        else:
            order = np.argsort(-cost, kind="stable")
            cs = cost[order]
        if n <= C:   # one item per CTA at most: queue order is the sorted order
            final = self._ar[:n] if order is None else order
            counts = np.zeros(C, dtype=np.int64)
            counts[:n] = 1
            loads = np.zeros(C, dtype=np.int64)
            loads[:n] = cs
        else:
            if mode == "naive" or cs[0] == cs[n - 1]:   # round robin (== LPT if all equal)
                cta = self._ar[:n] % C
                loads = None
            else:
                cta, loads = lpt_assign(cs, C, self._ar)
            q = np.argsort(cta, kind="stable")     # queue order: (cta, assignment order)
            final = q if order is None else order[q]
            counts = np.bincount(cta, minlength=C)
            if loads is None:
                loads = np.bincount(cta, weights=cs, minlength=C).astype(np.int64)
        if mode == "auto" and n > C:
            # LPT over Algorithm 1's chunks leaves one CTA a chunk above the mean when chunks
            # barely outnumber CTAs (n <= C: one chunk <= L per CTA, nothing to gain). Past
            # AUTO_IMBALANCE the contiguous partition (every CTA within a page of the mean, more
            # split rows) was faster on the H200 (docs/perf-log.md): take it if it is lighter.
            # Decided on the loads alone, before this plan's partial rows are laid out.
            top = int(_MAX(loads))
            if top * C > AUTO_IMBALANCE * int(_ADD(loads)):
                con = self._contiguous(decode, t_req, t_qs, t_qlen, t_kv)
                if int(_MAX(con["loads"])) < top:
                    return con
        res = dict(n=n, L=int(L), loads=loads, counts=counts, items=it, final=final,
                   merge_rows=0, partial_rows=0, split_tiles=0)
        if maxc > 1:
            self._partials(res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode)
        return res

    def _contiguous(self, decode, t_req, t_qs, t_qlen, t_kv) -> dict:
        """Contiguous cost partition: lay the tiles end to end on one cost axis (each tile's
        fixed cost, then its KV tokens) and give CTA c the slice [c*w, (c+1)*w), w = total/C,
        cutting tiles at page boundaries. Every CTA's load is within a page (plus one item's
        fixed cost) of the mean -- LPT over Algorithm 1's chunks is only within one chunk,
        which at ~1 chunk per CTA doubles the slowest CTA. Cuts never exceed C - 1, so the
        balanced bounds hold: items <= T + C - 1, split tiles <= C - 1."""
        C, ps, T = self.num_ctas, self.page_size, t_req.shape[0]
        fixed = COST_ALPHA * t_qlen.astype(np.int64) + COST_GAMMA
        length = fixed + COST_BETA * t_kv
        ends = _ACC(length)
        total = int(ends[-1])
        w = max(-(-total // C), self.min_chunk * COST_BETA)
        start = ends - length
        c0 = np.minimum(start // w, C - 1)
        c1 = np.minimum((ends - 1) // w, C - 1)
        i_tile, k = _repeat_index(c1 - c0 + 1, self._ar)
        kv_i = t_kv[i_tile]
        cta = c0[i_tile] + k
        cut = cta * w - start[i_tile] - fixed[i_tile]   # cost -> token offset
        np.maximum(cut, 0, out=cut)
        np.minimum(cut, kv_i, out=cut)
        cut -= cut % ps
        cut[k == 0] = 0
        kv_end = np.empty_like(cut)        # the next piece's cut, or the tile's end for its last
        kv_end[:-1] = cut[1:]
        last = k[1:] == 0
        kv_end[:-1][last] = kv_i[:-1][last]
        kv_end[-1] = kv_i[-1]
        keep = (kv_end > cut) | ((k == 0) & (kv_i == 0))   # empty KV: one item
        i_tile, cut, kv_end, cta = i_tile[keep], cut[keep], kv_end[keep], cta[keep]
        n = i_tile.shape[0]
        if n > self.bounds.max_items:
            raise ValueError(f"plan needs {n} work items, exceeding max_items={self.bounds.max_items}")
        nchunk = np.bincount(i_tile, minlength=T)
        first = _ACC(nchunk) - nchunk
        i_chunk = self._ar[:n] - first[i_tile]
        it = np.empty((7, n), dtype=np.int32)
        it[0], it[1], it[2], it[3], it[4], it[5:] = t_req[i_tile], t_qs[i_tile], t_qlen[i_tile], cut, kv_end, -1
        cost = (kv_end - cut) * COST_BETA + fixed[i_tile]
        res = dict(n=n, L=int(w), loads=np.bincount(cta, weights=cost, minlength=C).astype(np.int64),
                   counts=np.bincount(cta, minlength=C), items=it, final=self._ar[:n],
                   merge_rows=0, partial_rows=0, split_tiles=0)
        if int(_MAX(nchunk)) > 1:
            self._partials(res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode)
        return res

    def _partials(self, res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode):
        """Partial rows: split tile t owns rows pbase[t] .. + n_t * qo_t, chunk j
        writes pbase[t] + j * qo_t + r for its row r.  Merge entry (t, r) lists
        those n_t rows in chunk (= ascending KV) order; a split tile's entries are
        consecutive from its item_merge."""
        split = nchunk >= 2
        rows_t = nchunk * split if decode else nchunk * t_qlen * split
        pend = _ACC(rows_t)
        P = int(pend[-1])
        if P > self.bounds.max_partial_rows:
            raise ValueError(f"plan needs {P} partial rows, exceeding "
                             f"max_partial_rows={self.bounds.max_partial_rows}")
        # pbase = -1 for unsplit tiles: their only item has chunk 0, so the item's
        # partial index comes out as -1 (writethrough) with no extra select.
        pbase = np.where(split, pend - rows_t, -1)
        part = pbase[i_tile]
        part += i_chunk if decode else i_chunk * it[2]
        it[5] = part
        st = split.nonzero()[0]
        if decode:   # one row per tile: entries are the split tiles, partials 0..P-1
            M = st.shape[0]
            self._check_merge(M)
            cnt = nchunk[st]
            m_row = t_qs[st]
            m_start, m_stride = pbase[st], np.ones(M, dtype=np.int64)
            t_entry = self._ar[:M]
        else:
            qst = t_qlen[st]
            M = int(_ADD(qst, dtype=np.int64))
            self._check_merge(M)
            e_tile_i, e_r = _repeat_index(qst, self._ar)
            e_tile = st[e_tile_i]
            cnt = nchunk[e_tile]
            m_row = t_qs[e_tile] + e_r
            m_start, m_stride = pbase[e_tile] + e_r, t_qlen[e_tile]
            t_entry = _ACC(qst) - qst
        entry = np.full(split.shape[0], -1, dtype=np.int64)
        entry[st] = t_entry
        it[6] = entry[i_tile]
        m_indptr = np.zeros(M + 1, dtype=np.int64)
        _ACC(cnt, out=m_indptr[1:])
        res.update(m_indptr=m_indptr, m_row=m_row, m_start=m_start, m_stride=m_stride,
                   merge_rows=M, partial_rows=P, split_tiles=int(st.shape[0]))

    def _check_merge(self, M):
        if M > self.bounds.max_merge_rows:
            raise ValueError(f"plan needs {M} merge rows, exceeding "
                             f"max_merge_rows={self.bounds.max_merge_rows}")

    def _write(self, v: dict, batch: Batch, it: dict) -> None:
        B, n, C = batch.batch, it["n"], self.num_ctas
        v["req_qo_start"][:B] = batch.qo_indptr[:B]
        v["req_qo_len"][:B] = batch.qo_len
        v["req_kv_page_start"][:B] = batch.kv_indptr[:B]
        v["req_kv_len"][:B] = batch.kv_len
        nnz = int(batch.kv_indptr[-1])
        v["kv_indices"][:nnz] = batch.kv_indices[:nnz]
        wi = v["work_indptr"]
        wi[0] = 0
        _ACC(it["counts"], out=wi[1:C + 1])
        v["_items"][:, :n] = it["items"][:, it["final"]]
        np.take(batch.kv_indptr, v["item_request"][:n], out=v["item_kv_page_start"][:n])
        m = it["merge_rows"]
        v["merge_indptr"][0] = 0
        if m:
            v["merge_indptr"][:m + 1] = it["m_indptr"]
            v["merge_qo_row"][:m] = it["m_row"]
            v["merge_partial_start"][:m] = it["m_start"]
            v["merge_partial_stride"][:m] = it["m_stride"]
        v["plan_info"][:] = (n, m, it["partial_rows"], B, self.tile_q,
                             self.page_size, C, int(batch.qo_indptr[-1]))
