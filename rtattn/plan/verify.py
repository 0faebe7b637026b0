"""Structural checks of a plan against its batch (tests, the CLI, kernel tests).

`verify_plan` raises AssertionError with a reason unless:
* CTA queues partition the items; every item fits tile_q and its request;
* for every query row the items covering it have KV ranges that partition
  [start, horizon) exactly once (horizon = the request's KV, or for causal plans
  the tile's last-row horizon; start = 0, or with a sliding window the tile's first
  row's q_pos - window_left rounded down to a page), chunk starts page aligned -- with the grid's
  kv-head axis and head-group fusion this is "every (row, head, KV position)
  exactly once";
* writethrough rows and merge rows partition the query rows;
* partial rows are written exactly once and each merge entry lists exactly the
  partial rows of its query row, in ascending KV order;
* chunk runs (plan_info chunk_tokens C > 0): items start C-multiples past their tile's first
  visible token and a split item writes one partial row per chunk.
"""
from __future__ import annotations

import numpy as np

from .executor import plan_header
from .fields import merge_partials


def _fail(msg):
    raise AssertionError(msg)


def verify_plan(views: dict, qo_len, kv_len, *, tile_q: int, page_size: int,
                causal: bool = False, window_left: int | None = None) -> dict:
    h = plan_header(views)
    qo_len = np.asarray(qo_len, np.int64)
    kv_len = np.asarray(kv_len, np.int64)
    B, n, C = qo_len.shape[0], h["num_items"], h["num_ctas"]
    if h["batch"] != B:
        _fail(f"plan_info batch {h['batch']} != {B}")
    qo_start = np.concatenate(([0], np.cumsum(qo_len)))
    T = int(qo_start[-1])
    wi = views["work_indptr"][:C + 1].astype(np.int64)
    if wi[0] != 0 or wi[-1] != n or (np.diff(wi) < 0).any():
        _fail(f"work_indptr {wi.tolist()} does not partition {n} items")
    req = views["item_request"][:n].astype(np.int64)
    qs = views["item_qo_start"][:n].astype(np.int64)
    ql = views["item_qo_len"][:n].astype(np.int64)
    ks = views["item_kv_start"][:n].astype(np.int64)
    ke = views["item_kv_end"][:n].astype(np.int64)
    part = views["item_partial"][:n].astype(np.int64)
    if ((req < 0) | (req >= B)).any():
        _fail("item_request out of range")
    if (views["item_kv_page_start"][:n] != views["req_kv_page_start"][req]).any():
        _fail("item_kv_page_start disagrees with its request's req_kv_page_start")
    if ((ql < 1) | (ql > tile_q)).any():
        _fail("item_qo_len outside [1, tile_q]")
    if ((qs < qo_start[req]) | (qs + ql > qo_start[req] + qo_len[req])).any():
        _fail("item rows outside their request")
    ct = h["chunk_tokens"]
    if (ks % page_size).any():
        _fail("item_kv_start not page aligned")

    # Horizon of the item's tile (its last row).
    last_row = qs + ql - 1 - qo_start[req]
    hor = kv_len[req] - qo_len[req] + last_row + 1 if causal else kv_len[req]
    if ((ke < ks) | (ke > hor) | ((ke == ks) & (hor > 0))).any():
        _fail("item KV range empty or beyond its horizon")
    # KV coverage: per tile (qs unique per tile), chunks tile [0, horizon).
    o = np.lexsort((ks, qs))
    s_qs, s_ks, s_ke, s_ql = qs[o], ks[o], ke[o], ql[o]
    first = np.ones(n, bool)
    first[1:] = s_qs[1:] != s_qs[:-1]
    lastm = np.ones(n, bool)
    lastm[:-1] = first[1:]
    start = np.zeros(n, np.int64)
    if window_left is not None:   # the tile's first row's window, down to a page boundary
        q0 = kv_len[req] - qo_len[req] + (qs - qo_start[req])
        start = np.minimum(np.maximum(q0 - window_left, 0) // page_size * page_size, hor)
    if (s_ks[first] != start[o][first]).any():
        _fail("a tile's first chunk does not start at its first visible KV page")
    if ct and ((ks - start) % ct).any():
        _fail(f"an item does not start on a chunk boundary of its tile (chunk_tokens={ct})")
    if (s_ks[~first] != s_ke[np.flatnonzero(~first) - 1]).any():
        _fail("a tile's KV chunks have a gap or overlap")
    if (s_ke[lastm] != hor[o][lastm]).any():
        _fail("a tile's KV chunks do not reach its horizon")
    if (s_ql[~first] != s_ql[np.flatnonzero(~first) - 1]).any():
        _fail("chunks of one tile disagree on item_qo_len")
    # Row coverage: tiles partition the query rows.
    t_qs, t_ql = s_qs[first], s_ql[first]
    if t_qs.size and (t_qs[0] != 0 or (t_qs[1:] != (t_qs + t_ql)[:-1]).any()
                      or t_qs[-1] + t_ql[-1] != T):
        _fail("tiles do not partition the query rows")
    if not t_qs.size and T:
        _fail("no items for a non-empty batch")
    # Split tiles: the items of a tile are either all writethrough (one chunk) or
    # all partial.
    nchunks = np.diff(np.append(np.flatnonzero(first), n))
    split_tile = np.repeat(nchunks > 1, nchunks)
    if ((part[o] >= 0) != split_tile).any():
        _fail("writethrough flag disagrees with the tile being split")
    P, M = h["num_partial_rows"], h["num_merge_rows"]
    # A split item's states: one (chunk runs: one per chunk), each writing rows part + j * ql + r.
    states = np.maximum(-(-(ke - ks) // ct), 1) if ct else np.ones(n, np.int64)
    pr = np.repeat(part >= 0, states)
    j = np.arange(int(states.sum())) - np.repeat(np.cumsum(states) - states, states)
    s_item = np.repeat(np.arange(n), states)[pr]
    s_part = part[s_item] + j[pr] * ql[s_item]
    s_ks = ks[s_item] + j[pr] * ct
    prow = (s_part[:, None] + np.arange(tile_q)[None]).ravel()
    valid = (np.arange(tile_q)[None] < ql[s_item][:, None]).ravel()
    prow = prow[valid]
    if prow.size != P or (P and not np.array_equal(np.sort(prow), np.arange(P))):
        _fail("partial rows are not written exactly once / not dense 0..P-1")
    # Merge map.
    mi = views["merge_indptr"][:M + 1].astype(np.int64) if M else np.zeros(1, np.int64)
    mrow = views["merge_qo_row"][:M].astype(np.int64)
    mp = merge_partials(views, M)
    if mi[0] != 0 or mi[-1] != P or (np.diff(mi) < 2).any():
        _fail("merge_indptr malformed (each entry needs >= 2 partials)")
    # expected: for each partial row, its (global row, kv_start)
    g_row = (qs[s_item][:, None] + np.arange(tile_q)[None]).ravel()[valid]
    g_kv = np.repeat(s_ks, tile_q).reshape(-1, tile_q).ravel()[valid]
    row_of = np.empty(P, np.int64)
    kv_of = np.empty(P, np.int64)
    row_of[prow] = g_row
    kv_of[prow] = g_kv
    owner = np.repeat(np.arange(M), np.diff(mi))
    if (row_of[mp] != mrow[owner]).any():
        _fail("a merge entry lists a partial row of another query row")
    same = owner[1:] == owner[:-1]
    if (kv_of[mp][1:][same] <= kv_of[mp][:-1][same]).any():
        _fail("a merge entry is not in ascending KV order")
    # item_merge: -1 for writethrough; else entries e0 .. e0 + rows - 1 are the item's rows,
    # and each lists the item's partial row for it.
    im = views["item_merge"][:n].astype(np.int64)
    if ((im >= 0) != (part >= 0)).any():
        _fail("item_merge set for a writethrough item or missing for a split one")
    if pr.any():
        e = (im[s_item][:, None] + np.arange(tile_q)[None]).ravel()[valid]
        if ((e < 0) | (e >= M)).any() or (mrow[e] != g_row).any():
            _fail("item_merge entries are not the item's rows")
        pos_of = np.empty(P, np.int64)
        pos_of[mp] = np.arange(P)
        if (owner[pos_of[prow]] != e).any():
            _fail("an item's merge entry does not list the item's partial row")
    wt = part < 0
    wt_rows = (qs[wt][:, None] + np.arange(tile_q)[None]).ravel()[
        (np.arange(tile_q)[None] < ql[wt][:, None]).ravel()]
    allrows = np.concatenate((wt_rows, mrow))
    if allrows.size != T or (T and not np.array_equal(np.sort(allrows), np.arange(T))):
        _fail("writethrough rows and merge rows do not partition the query rows")
    return h
