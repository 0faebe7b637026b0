"""Cascade levels: several page-table views of one batch, and their union as one pseudo-batch.

A cascade splits each request's KV into levels (FlashInfer's MultiLevelCascadeAttention
conventions): level 0 holds the most widely shared prefixes, deeper levels narrower ones, the
last level each request's own suffix. Level l is a page table over *groups*: group g owns the
query rows qo_indptr[g] .. qo_indptr[g+1] (contiguous, whole requests) and attends the KV
pages kv_indices[kv_indptr[g] : kv_indptr[g+1]]. The last level's groups are the requests.

Attending every level and folding the states (⊕, level order) equals attending each request's
concatenated KV. Positions are absolute: a group's first KV token sits at the sum of its
requests' KV in the earlier levels (the same for all of them, or the levels do not nest), and
query row t at q_pos[t] = (request KV over all levels) - qo_len + (t's index in the request).

`union_batch` lays all levels end to end as one batch of pseudo-requests (the groups, level
major), so one plan -- and one persistent kernel launch -- covers every level: pseudo row
l * N + t is query row t as seen by level l (every level covers all N query rows).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .layout import Batch, validate_batch


class Level(NamedTuple):
    qo_indptr: np.ndarray         # [groups + 1] query rows of each group
    kv_indptr: np.ndarray         # [groups + 1] into kv_indices
    kv_indices: np.ndarray        # page ids
    kv_last_page_len: np.ndarray  # [groups], in [1, page_size] (ignored for a group with no pages)


class Union(NamedTuple):
    """All levels as one batch (pseudo-request = a level's group, level major)."""
    batch: Batch                  # validated pseudo batch; its qo rows are pseudo rows
    num_levels: int
    num_qo_tokens: int            # N: query rows of the real batch
    level_of: np.ndarray          # int32[pseudo requests]
    row_shift: np.ndarray         # int32[pseudo requests]: pseudo row - real row (= level * N)
    kv_offset: np.ndarray         # int32[pseudo requests]: absolute position of its first KV token
    q_pos: np.ndarray             # int32[N]: absolute position of each query row
    req_qo_indptr: np.ndarray     # the requests (= last level's groups)
    req_kv_len: np.ndarray        # int64[requests]: KV tokens over all levels


def union_batch(levels, page_size: int, *, num_pages: int | None = None, causal: bool = False,
                max_levels: int | None = None) -> Union:
    """Validate the levels against each other and lay them out as one pseudo-batch. Refuses
    (ValueError naming the level and index) groups that split a request, levels that cover
    different query rows, groups whose requests reach them at different positions and, for
    causal attention, a request with more queries than its last level has KV (its queries'
    own positions must be in the last level)."""
    levels = [Level(*lv) for lv in levels]
    L = len(levels)
    if L < 1:
        raise ValueError("a cascade needs at least one level")
    if max_levels is not None and L > max_levels:
        raise ValueError(f"{L} levels exceed num_levels={max_levels}")
    bats = []
    for l, lv in enumerate(levels):
        try:
            bats.append(validate_batch(*lv, page_size, num_pages=num_pages))
        except (ValueError, TypeError) as e:
            raise type(e)(f"level {l}: {e}") from None
    last = bats[-1]
    N = last.qo_indptr.item(-1)
    req_rows = last.qo_indptr.astype(np.int64)
    R = last.batch
    has_q = last.qo_len > 0
    req_kv = np.zeros(R, np.int64)       # KV of each request in the levels before the current one
    kv_offset, level_of = [], []
    for l, bt in enumerate(bats):
        if bt.qo_indptr.item(-1) != N:
            raise ValueError(f"level {l} covers {bt.qo_indptr.item(-1)} query rows "
                             f"(qo_indptr[-1]), the last level {N}: every level covers every query")
        starts = bt.qo_indptr.astype(np.int64)
        at = np.searchsorted(req_rows, starts)      # first request boundary >= each group boundary
        bad = req_rows[np.minimum(at, R)] != starts
        if bad.any():
            g = int(np.flatnonzero(bad)[0])
            r = int(np.searchsorted(req_rows, starts[g], "right")) - 1
            raise ValueError(f"level {l}: group {g} starts at query row {starts[g]} (qo_indptr[{g}]), "
                             f"inside request {r} (rows {req_rows[r]}..{req_rows[r + 1] - 1}): a group "
                             f"holds whole requests")
        # group of each request (requests without queries belong to no group that matters)
        grp = np.searchsorted(starts, req_rows[:-1], "right") - 1
        grp = np.minimum(grp, bt.batch - 1)
        if bt.batch:
            off = req_kv                                           # per request, this level
            first = np.full(bt.batch, -1, np.int64)
            members = np.flatnonzero(has_q)
            g_of = grp[members]
            lead = np.ones(g_of.shape[0], bool)                    # each group's first member
            lead[1:] = g_of[1:] != g_of[:-1]
            first[g_of[lead]] = off[members[lead]]
            clash = has_q & (off != first[grp]) & (bt.kv_len[grp] > 0)   # an empty group has no positions
            if clash.any():
                r = int(np.flatnonzero(clash)[0])
                g = int(grp[r])
                raise ValueError(f"level {l}: group {g}'s requests reach it at different positions "
                                 f"(request {r} after {off[r]} KV tokens of the earlier levels, its first "
                                 f"request after {first[g]}): the levels do not nest")
            kv_offset.append(np.maximum(first, 0))
            req_kv = req_kv + np.where(has_q, bt.kv_len[grp], 0)
        else:
            kv_offset.append(np.zeros(0, np.int64))
        level_of.append(np.full(bt.batch, l, np.int32))
    if causal:
        check_causal(last.qo_len, last.kv_len)
    q_pos = np.zeros(N, np.int64)
    if N:
        owner = np.repeat(np.arange(R), last.qo_len)
        q_pos = req_kv[owner] - last.qo_len[owner] + (np.arange(N) - req_rows[owner])
    pq = np.zeros(sum(b.batch for b in bats) + 1, np.int64)
    pq[1:] = np.concatenate([b.qo_indptr[1:].astype(np.int64) + l * N for l, b in enumerate(bats)])
    pk = np.zeros_like(pq)
    nnz = [b.kv_indptr.item(-1) for b in bats]
    base = np.cumsum([0] + nnz[:-1])
    pk[1:] = np.concatenate([b.kv_indptr[1:].astype(np.int64) + base[l] for l, b in enumerate(bats)])
    ids = np.concatenate([b.kv_indices[:n] for b, n in zip(bats, nnz)])
    lastp = np.concatenate([b.kv_last_page_len for b in bats])
    lvl = np.concatenate(level_of)
    pseudo = Batch(pq.astype(np.int32), pk.astype(np.int32), ids.astype(np.int32, copy=False),
                   lastp.astype(np.int32, copy=False), np.diff(pq).astype(np.int32),
                   np.concatenate([b.kv_len for b in bats]).astype(np.int32), page_size,
                   max((b.qo_max for b in bats), default=0))
    return Union(pseudo, L, N, lvl, (lvl * N).astype(np.int32), np.concatenate(kv_offset).astype(np.int32),
                 q_pos.astype(np.int32), last.qo_indptr, req_kv)


def check_causal(qo_len: np.ndarray, last_level_kv_len: np.ndarray) -> None:
    """Causal attention masks a query's own position and what follows; that position must be
    in the last level (the shared levels all come before every query)."""
    bad = qo_len > last_level_kv_len
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(f"causal: request {r} has {qo_len[r]} queries but its last level holds "
                         f"{last_level_kv_len[r]} KV tokens: a query's own position must be in the last level")


def check_against_requests(levels, kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> None:
    """Refuse levels whose pages disagree with the requests' own page tables: request r's pages
    over all levels, in level order, must be exactly its page list, every level but the last
    holding whole pages, and the shared levels no longer than the request."""
    levels = [Level(*lv) for lv in levels]
    req = validate_batch(levels[-1].qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
    rows = req.qo_indptr.astype(np.int64)
    for r in range(req.batch):
        own = req.kv_indices[req.kv_indptr[r]:req.kv_indptr[r + 1]]
        pos = 0
        for l, lv in enumerate(levels):
            g = int(np.searchsorted(lv.qo_indptr, rows[r], "right")) - 1
            pages = lv.kv_indices[lv.kv_indptr[g]:lv.kv_indptr[g + 1]]
            n = len(pages)
            if pos + n > len(own):
                raise ValueError(f"request {r}: the levels up to {l} hold {pos + n} pages, the request "
                                 f"has {len(own)}: a prefix longer than the request")
            if not np.array_equal(pages, own[pos:pos + n]):
                j = int(np.flatnonzero(pages != own[pos:pos + n])[0])
                raise ValueError(f"request {r}: level {l} group {g} page {j} is {pages[j]}, the request's "
                                 f"page {pos + j} is {own[pos + j]}")
            pos += n
            is_last = l == len(levels) - 1
            if n and not is_last and lv.kv_last_page_len[g] != page_size and pos < len(own):
                raise ValueError(f"request {r}: level {l} group {g} ends in a partial page "
                                 f"(kv_last_page_len {lv.kv_last_page_len[g]}) but the request continues")
        if pos != len(own):
            raise ValueError(f"request {r}: the levels hold {pos} of its {len(own)} pages")
        if len(own) and levels[-1].kv_indptr[r + 1] > levels[-1].kv_indptr[r] and \
                levels[-1].kv_last_page_len[r] != req.kv_last_page_len[r]:
            raise ValueError(f"request {r}: last level kv_last_page_len {levels[-1].kv_last_page_len[r]} "
                             f"!= the request's {req.kv_last_page_len[r]}")
