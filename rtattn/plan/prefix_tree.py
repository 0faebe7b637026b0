"""Cascade levels from plain page tables: shared leading pages found as a prefix tree.

Requests that share a prefix (a system prompt, the prompt of parallel samples or beams) hold
the same leading page ids. Between neighbours in batch order the shared run is the longest
common prefix (LCP) of their page lists; the LCP array of the batch is the prefix tree of
adjacent runs (an LCP-interval tree): a node is a maximal run of >= 2 consecutive requests
sharing its first `lcp` pages, its children narrower runs sharing more. Level k of the cascade
holds the nodes at depth k, each node's own pages (those past its parent's); the last level
holds what each request has past its deepest node. Requests that share a prefix but are not
neighbours share it only within runs of neighbours: order a batch so that requests of one
prompt are adjacent (`prefix_order` gives such an order).

A request's last page is never shared (another request may still be writing into its copy of
a partial page), so every shared level holds whole pages and every request keeps at least
one page of its own.
"""
from __future__ import annotations

import numpy as np

from .layout import Batch, _int32
from .levels import Level, Union, union_batch


def adjacent_lcp(kv_indptr: np.ndarray, kv_indices: np.ndarray) -> np.ndarray:
    """Pages request i shares with request i+1 from the start, excluding each one's last
    page: int64[batch - 1]."""
    n = np.diff(kv_indptr).astype(np.int64)
    B = n.shape[0]
    if B < 2:
        return np.zeros(0, np.int64)
    sh = np.maximum(n - 1, 0)
    m = np.minimum(sh[:-1], sh[1:])
    s = kv_indptr[:-1].astype(np.int64)
    out = np.zeros(B - 1, np.int64)
    if m[m.argmax()] == 0:
        return out
    first = kv_indices[np.minimum(s[:-1], kv_indices.shape[0] - 1)] == \
        kv_indices[np.minimum(s[1:], kv_indices.shape[0] - 1)]
    if not (first & (m > 0)).any():
        return out
    end = int(s[B - 1])                   # positions of requests 0 .. B-2
    a = kv_indices[:end]
    if n[n.argmin()] == n[n.argmax()]:    # equal page counts: the neighbour is one shift away
        diff = a != kv_indices[n.item(0):end + n.item(0)]
    else:
        shift = np.arange(end, dtype=np.int64)
        shift += n[:-1].repeat(n[:-1])
        diff = a != kv_indices.take(shift, mode="clip")
    miss = np.flatnonzero(diff)
    at = np.searchsorted(miss, s[:-1])    # first mismatch at or after each request's start
    first_miss = np.append(miss, end)[at]
    np.minimum(first_miss - s[:-1], m, out=out)
    return out


def _lcp_tree(h: list[int]) -> list:
    """Nodes (lcp, first, last, children) of the LCP-interval tree of h (one stack pass)."""
    stack = [[0, 0, []]]
    for i, cur in enumerate(h + [0]):
        lb, carried = i, []
        while cur < stack[-1][0]:
            lcp, b, ch = stack.pop()
            node = (lcp, b, i, ch)
            lb = b
            (stack[-1][2] if cur <= stack[-1][0] else carried).append(node)
        if cur > stack[-1][0]:
            stack.append([cur, lb, carried])
    return stack[0][2]


def share_prefixes(kv_indptr, kv_indices, kv_last_page_len, page_size: int, qo_indptr=None, *,
                   max_levels: int = 2) -> list[Level]:
    """Levels (at most `max_levels`, the last the requests' own suffixes) for a batch given as
    one page table per request. Nodes deeper than max_levels - 1 stay in their requests'
    suffixes. A batch without shared pages gives one level: the batch itself."""
    kv_indptr = _int32("kv_indptr", kv_indptr)
    kv_indices = _int32("kv_indices", kv_indices)
    last = _int32("kv_last_page_len", kv_last_page_len)
    B = kv_indptr.shape[0] - 1
    if qo_indptr is None:
        qo_indptr = np.arange(B + 1, dtype=np.int32)
    qo_indptr = _int32("qo_indptr", qo_indptr)
    if qo_indptr.shape[0] != B + 1:
        raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries, kv_indptr {B + 1}")
    whole = Level(qo_indptr, kv_indptr, kv_indices, last)
    if max_levels < 1:
        raise ValueError(f"max_levels must be >= 1, got {max_levels}")
    h = adjacent_lcp(kv_indptr, kv_indices)
    if max_levels == 1 or not h.any():
        return [whole]
    if h[h.argmin()] == h[h.argmax()]:    # one prefix shared by the whole batch
        roots = [(int(h[0]), 0, B - 1, [])]
    else:
        roots = _lcp_tree(h.tolist())
    depth = np.zeros(B, np.int64)          # pages of each request in the shared levels
    levels, frontier = [], [(0, r) for r in roots]
    for _ in range(max_levels - 1):
        if not frontier:
            break
        qo, kvp, idx, lastp = [0], [0], [], []
        row = 0
        for parent_lcp, (lcp, b, e, _) in frontier:
            if qo_indptr[b] > row:        # requests without a node here: one empty group
                qo.append(int(qo_indptr[b]))
                kvp.append(kvp[-1])
                lastp.append(page_size)
            s = int(kv_indptr[b])
            idx.append(kv_indices[s + parent_lcp:s + lcp])
            qo.append(int(qo_indptr[e + 1]))
            kvp.append(kvp[-1] + lcp - parent_lcp)
            lastp.append(page_size)
            depth[b:e + 1] = lcp
            row = int(qo_indptr[e + 1])
        if row < qo_indptr[-1]:
            qo.append(int(qo_indptr[-1]))
            kvp.append(kvp[-1])
            lastp.append(page_size)
        levels.append(Level(np.array(qo, np.int32), np.array(kvp, np.int32),
                            np.concatenate(idx).astype(np.int32, copy=False), np.array(lastp, np.int32)))
        frontier = [(lcp, c) for lcp, _, _, ch in (f[1] for f in frontier) for c in ch]
    n = np.diff(kv_indptr).astype(np.int64)
    own = n - depth
    sp = np.zeros(B + 1, np.int64)
    np.cumsum(own, out=sp[1:])
    pos = np.arange(sp.item(-1), dtype=np.int64)
    pos += (kv_indptr[:-1] + depth - sp[:-1]).repeat(own)
    levels.append(Level(qo_indptr, sp.astype(np.int32), kv_indices.take(pos), last))
    return levels


def prefix_order(kv_indptr, kv_indices) -> np.ndarray:
    """A stable batch order that puts requests with equal leading pages next to each other
    (sorted by their page lists), so share_prefixes finds every shared prefix."""
    kv_indptr = np.asarray(kv_indptr, np.int64)
    lists = [tuple(kv_indices[kv_indptr[b]:kv_indptr[b + 1] - 1].tolist()) for b in range(len(kv_indptr) - 1)]
    return np.array(sorted(range(len(lists)), key=lambda b: lists[b]), np.int64)


def prefix_union(batch: Batch, max_levels: int = 2, lcp: int | None = None) -> Union:
    """The cascade of a validated batch (rtattn.plan.layout.validate_batch) as one pseudo-batch:
    share_prefixes + union_batch, with a fast path for the common step of serving parallel
    samples or a system prompt (`one_shared_prefix`; `lcp`: its answer where the caller has
    it already, None: asked here)."""
    if lcp is None:
        lcp = one_shared_prefix(batch, max_levels)
    if lcp:
        B, n = batch.batch, batch.kv_indptr.item(1)
        return _one_prefix(batch, batch.kv_indices[:n * B].reshape(B, n), lcp)
    return union_batch(share_prefixes(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, batch.page_size,
                                      batch.qo_indptr, max_levels=max_levels), batch.page_size)


def one_shared_prefix(batch: Batch, max_levels: int = 2) -> int:
    """Pages of the one prefix every request shares, when that is the batch's whole prefix tree
    (equal page counts, nothing shared deeper), else 0: touches each page id once (a 2-D view,
    request i against request i+1)."""
    B, kv_indptr, ids = batch.batch, batch.kv_indptr, batch.kv_indices
    if max_levels < 2 or B < 2 or kv_indptr.item(1) < 2:
        return 0
    n, kv = kv_indptr.item(1), batch.kv_len
    # equal page counts: (validated) counts >= 0 summing to n B, the largest (from the longest
    # KV, ceil(kv / page_size) pages) n -- so every one n
    if kv_indptr.item(B) != n * B or -(-kv.item(kv.argmax()) // batch.page_size) != n:
        return 0
    nnz = n * B
    diff = (ids[n:nnz] != ids[:nnz - n]).reshape(B - 1, n)   # request i+1 vs request i, page by page
    f = diff.argmax(axis=1)   # each pair's first differing page (0 also where none differs)
    first = f.item(f.argmin())   # (along rows: ~4x cheaper than any(axis=0) over the columns)
    if first == 0:   # a pair differing at page 0, or one not differing at all
        cols = diff.any(axis=0)
        first = int(cols.argmax()) if cols.any() else n - 1
    lcp = min(first, n - 1)   # pages every request shares
    # one prefix and nothing deeper: every neighbour pair differs right after it
    if not lcp or lcp == n - 1:
        return lcp
    col = diff[:, lcp]
    return lcp if col[col.argmin()] else 0   # (every pair differs there: argmin finds a False, if any)


def _one_prefix(batch: Batch, m: np.ndarray, lcp: int) -> Union:
    """Two levels: the first `lcp` pages of every request, then each one's own pages."""
    B, ps, qo = batch.batch, batch.page_size, batch.qo_indptr
    N = qo.item(-1)
    own = m.shape[1] - lcp
    prefix_tokens = lcp * ps
    pq = np.empty(B + 2, np.int32)
    pq[0] = 0
    np.add(qo, N, out=pq[1:])
    pk = np.empty(B + 2, np.int32)
    pk[0] = 0
    pk[1:] = np.arange(B + 1, dtype=np.int32) * own + lcp
    ids = np.empty(lcp + B * own, np.int32)
    ids[:lcp] = m[0, :lcp]
    ids[lcp:].reshape(B, own)[:] = m[:, lcp:]
    last = np.empty(B + 1, np.int32)
    last[0] = ps
    last[1:] = batch.kv_last_page_len
    qo_len = np.empty(B + 1, np.int32)
    qo_len[0] = N
    qo_len[1:] = batch.qo_len
    kv_len = np.empty(B + 1, np.int32)
    kv_len[0] = prefix_tokens
    np.subtract(batch.kv_len, prefix_tokens, out=kv_len[1:])
    level = np.ones(B + 1, np.int32)
    level[0] = 0
    if batch.qo_max == 1 and N == B:   # decode: one query per request, at its last position
        q_pos = batch.kv_len - 1
    else:
        owner = np.repeat(np.arange(B), batch.qo_len)
        q_pos = (batch.kv_len - batch.qo_len)[owner] + (np.arange(N) - qo[:-1][owner])
    pseudo = Batch(pq, pk, ids, last, qo_len, kv_len, ps, max(N, batch.qo_max))
    return Union(pseudo, 2, N, level, level * N, level * prefix_tokens, q_pos.astype(np.int32, copy=False),
                 qo, batch.kv_len.astype(np.int64))

