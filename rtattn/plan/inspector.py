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


def _repeat_index(counts: np.ndarray):
    """For counts c_i: (owner index per element, position within owner, starts)."""
    n = int(counts.sum())
    starts = np.zeros(counts.shape[0], dtype=np.int64)
    if counts.shape[0] > 1:
        np.cumsum(counts[:-1], out=starts[1:])
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    pos = np.arange(n) - starts[owner]
    return owner, pos, starts


def lpt_assign(cost_sorted: list, num_ctas: int) -> np.ndarray:
    """Longest-processing-time assignment of already sorted (descending) costs.
    Least-loaded CTA first, ties by CTA id.  Returns the CTA of each item.

    Key = (load << shift) | cta in one Python int, so heapq compares plain ints.
    The first num_ctas items land on CTAs 0, 1, ... (all loads are 0 then)."""
    n = len(cost_sorted)
    m = min(n, num_ctas)
    out = np.empty(n, dtype=np.int32)
    out[:m] = np.arange(m, dtype=np.int32)
    if n <= num_ctas:
        return out
    shift = num_ctas.bit_length()
    mask = (1 << shift) - 1
    heap = [(cost_sorted[c] << shift) | c for c in range(m)]
    heapq.heapify(heap)
    rest = []
    push = heapq.heapreplace
    append = rest.append
    for c in cost_sorted[m:]:
        top = heap[0]
        push(heap, top + (c << shift))
        append(top & mask)
    out[m:] = rest
    return out


class Planner:
    """Build once per serving configuration; call plan() once per step.

    Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads,
            head_dim, page_size, device="h200", mode="balanced", ...)
    """

    def __init__(self, max_batch: int, max_qo_tokens: int, max_pages: int,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 device="h200", mode: str = "balanced", causal: bool = False,
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
        buf = out if out is not None else self.layout.allocate()
        views = self.layout.views(buf)
        self._write(views, batch, items)
        return PlanInfo(items["n"], items["merge_rows"], items["partial_rows"], batch.batch,
                        int(batch.qo_indptr[-1]), self.num_ctas, self.tile_q, self.page_size,
                        items["L"], items["split_tiles"], items["loads"],
                        buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8),
                        views)

    def _schedule(self, batch: Batch) -> dict:
        tq, C, mode = self.tile_q, self.num_ctas, self.mode
        qo_len = batch.qo_len.astype(np.int64)
        kv_len = batch.kv_len.astype(np.int64)
        # Tiles: (request, j-th tile of tq tokens).
        ntile = -(-qo_len // tq)
        if tq == 1 and (qo_len == 1).all():   # pure decode fast path: tile == request
            t_req = np.arange(batch.batch)
            t_off = np.zeros(batch.batch, dtype=np.int64)
            t_qlen = qo_len
        else:
            t_req, tj, _ = _repeat_index(ntile)
            t_off = tj * tq
            t_qlen = np.minimum(tq, qo_len[t_req] - t_off)
        t_kv = kv_len[t_req]
        if self.causal:   # clip to the horizon of the tile's last row
            t_kv = t_kv - qo_len[t_req] + t_off + t_qlen
        T = t_req.shape[0]
        # Chunk bound.
        if mode == "naive":
            L = 0
            nchunk = np.ones(T, dtype=np.int64)
        else:
            if mode == "batch-invariant":
                L = self.bounds.chunk_tokens
            else:
                L = -(-int(t_kv.sum()) // C) if T else 0
                L = max(L, self.min_chunk)
                L = -(-L // self.page_size) * self.page_size
            nchunk = np.maximum(1, -(-t_kv // L))
        if T and int(nchunk.max()) == 1:
            i_tile = np.arange(T)
            i_chunk = np.zeros(T, dtype=np.int64)
        else:
            i_tile, i_chunk, _ = _repeat_index(nchunk)
        n = i_tile.shape[0]
        if n > self.bounds.max_items:
            raise ValueError(f"plan needs {n} work items, exceeding max_items="
                             f"{self.bounds.max_items} (mode={mode})")
        kv_s = i_chunk * L if L else np.zeros(n, dtype=np.int64)
        kv_e = np.minimum(kv_s + L, t_kv[i_tile]) if L else t_kv[i_tile]
        q_len = t_qlen[i_tile]
        cost = COST_ALPHA * q_len + COST_BETA * (kv_e - kv_s) + COST_GAMMA
        # Assignment.
        if mode == "naive":
            order = np.arange(n)
            cta_sorted = (order % C).astype(np.int32)
        else:
            order = np.argsort(-cost, kind="stable")
            cs = cost[order]
            if n <= C or cs[0] == cs[-1]:
                # all items equal (or fewer than CTAs): LPT == round-robin
                cta_sorted = (np.arange(n) % C).astype(np.int32)
            else:
                cta_sorted = lpt_assign(cs.tolist(), C)
        q = np.argsort(cta_sorted, kind="stable")   # queue order: (cta, assignment order)
        final = order[q]
        counts = np.bincount(cta_sorted, minlength=C)
        loads = np.bincount(cta_sorted, weights=cost[order], minlength=C).astype(np.int64)
        # Partials and merge map.
        split = nchunk >= 2
        res = dict(n=n, L=int(L), loads=loads, counts=counts, final=final,
                   i_req=t_req[i_tile], i_qo=batch.qo_indptr[t_req[i_tile]] + t_off[i_tile],
                   i_qlen=q_len, i_kvs=kv_s, i_kve=kv_e, split_tiles=int(split.sum()))
        if res["split_tiles"]:
            st = np.flatnonzero(split)
            rows_per = nchunk[st] * t_qlen[st]
            pbase = np.zeros(T, dtype=np.int64)
            pbase[st] = np.concatenate(([0], np.cumsum(rows_per)[:-1]))
            part = np.where(split[i_tile], pbase[i_tile] + i_chunk * q_len, -1)
            e_tile_i, e_r, _ = _repeat_index(t_qlen[st])
            e_tile = st[e_tile_i]
            e_cnt = nchunk[e_tile]
            m_indptr = np.zeros(e_tile.shape[0] + 1, dtype=np.int64)
            np.cumsum(e_cnt, out=m_indptr[1:])
            p_owner, p_j, _ = _repeat_index(e_cnt)
            m_part = pbase[e_tile][p_owner] + p_j * t_qlen[e_tile][p_owner] + e_r[p_owner]
            res.update(part=part, m_indptr=m_indptr,
                       m_row=batch.qo_indptr[t_req[e_tile]] + t_off[e_tile] + e_r,
                       m_part=m_part, merge_rows=int(e_tile.shape[0]),
                       partial_rows=int(rows_per.sum()))
        else:
            res.update(part=None, merge_rows=0, partial_rows=0)
        bb = self.bounds
        if res["merge_rows"] > bb.max_merge_rows:
            raise ValueError(f"plan needs {res['merge_rows']} merge rows, exceeding "
                             f"max_merge_rows={bb.max_merge_rows}")
        if res["partial_rows"] > bb.max_partial_rows:
            raise ValueError(f"plan needs {res['partial_rows']} partial rows, exceeding "
                             f"max_partial_rows={bb.max_partial_rows}")
        return res

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
        np.cumsum(it["counts"], out=wi[1:C + 1])
        f = it["final"]
        v["item_request"][:n] = it["i_req"][f]
        v["item_qo_start"][:n] = it["i_qo"][f]
        v["item_qo_len"][:n] = it["i_qlen"][f]
        v["item_kv_start"][:n] = it["i_kvs"][f]
        v["item_kv_end"][:n] = it["i_kve"][f]
        if it["part"] is None:
            v["item_partial"][:n] = -1
        else:
            v["item_partial"][:n] = it["part"][f]
            m = it["merge_rows"]
            v["merge_indptr"][:m + 1] = it["m_indptr"]
            v["merge_qo_row"][:m] = it["m_row"]
            v["merge_partial"][:it["partial_rows"]] = it["m_part"]
        if it["part"] is None and self.layout.capacity["merge_indptr"] >= 1:
            v["merge_indptr"][0] = 0
        v["plan_info"][:] = (n, it["merge_rows"], it["partial_rows"], B, self.tile_q,
                             self.page_size, C, int(batch.qo_indptr[-1]))

