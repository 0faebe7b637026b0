"""Planner.plan() for small batches, in plain Python ints.

A batch-1 decode plan was ~60 numpy calls of ~1 us each on a few dozen numbers. Up to
`Planner.small_tiles` query tiles and `small_tokens` query tokens (modes auto, balanced and
contiguous), plan() takes this path (after rtattn.plan.tile_table, which takes one-tile batches of
tile_table.MIN_BATCH requests or more and several-tile batches past small_tokens): the schedule of rtattn.plan.inspector's numpy path
(tiles, Algorithm 1's chunks, auto's choice of the contiguous partition, LPT, partial rows,
the merge map) on lists, written into the same views with the same writes, so plan bytes and
PlanInfo are identical (tests/test_small_plan.py compares both paths on fuzzed batches). What this path does not take
(a larger batch, another mode, input its quick checks do not accept, an exceeded bound) goes
the numpy way, whose validation names what is wrong: errors have one source. A balanced plan of at
most one item per CTA keeps its layout (every row but the last KV ends and the pages) per
(qo_indptr, chunk counts, queue order): the next steps of a serving loop copy it (Layout;
docs/perf-log.md "Host path v9").
"""
from __future__ import annotations

import heapq
from itertools import accumulate
from operator import itemgetter

import numpy as np

from .costs import AUTO_IMBALANCE, COST_ALPHA, COST_BETA, COST_GAMMA, TAIL_FRACTION
from .fields import write_merge_and_info, write_requests

# Crossovers with the numpy path on the development machine (docs/perf-log.md "Host path v3"): the
# Python cost grows with items, and with query rows (a split tile's merge entries and partial rows).
SMALL_TILES = 8
SMALL_TOKENS = 32
MODES = ("auto", "balanced", "contiguous")
_I32 = np.dtype(np.int32)
_I32_MAX = 2**31 - 1
LAYOUTS = 64   # balanced layouts (and keys seen once) a planner keeps (Planner._small_layouts; cleared when full)


class _Numpy(Exception):
    """This batch goes the numpy way (a check or bound this path leaves to it)."""


def lpt_deal(heap: list, keys: list, mask: int) -> list:
    """LPT's greedy steps: each key (cost << shift) in turn onto the least-loaded CTA of `heap`
    ((load << shift) | cta, ties by CTA id); the CTA of each."""
    heapq.heapify(heap)
    rep = heapq.heapreplace
    return [rep(heap, heap[0] + k) & mask for k in keys]


def plan(p, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, window_left, out):
    """PlanInfo if this path takes the batch (written into p._buffer(out), made once the batch is
    planned, as the numpy path does), else None (nothing written)."""
    if (p.mode not in MODES or type(kv_indptr) is not np.ndarray or kv_indptr.dtype is not _I32
            or kv_indptr.ndim != 1 or kv_indptr.shape[0] > p.small_tiles + 1   # (a request has a tile at least)
            or (qo_indptr is not None and (type(qo_indptr) is not np.ndarray or qo_indptr.dtype is not _I32
                                           or qo_indptr.ndim != 1 or qo_indptr.shape[0] == 0
                                           or qo_indptr.item(-1) > p.small_tokens))):
        return None
    try:
        qo, qo_len, kp, kv_len, nnz = _batch(p, qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        res = _schedule(p, qo, qo_len, kv_len, window_left)
    except _Numpy:
        return None
    buf, views = p._buffer(out)
    lay = res.get("layout")
    if lay is not None:
        lay.write(views, kv_indptr, kv_len, nnz, kv_indices, res["t_kv"])
        res.update(merge_rows=lay.M, partial_rows=lay.P, split_tiles=lay.S)
    else:
        _write(p, views, qo, qo_len, kp, kv_len, nnz, kv_indices, res)
        key = res.get("key")
        if key is not None:   # a key seen once is marked; seen again, its layout is kept
            known = p._small_layouts
            if key in known:
                known[key] = Layout(views, res, qo, qo_len, key)
            else:
                if len(known) >= LAYOUTS:
                    known.clear()
                known[key] = None
    loads = np.zeros(p.num_ctas, dtype=np.int64)   # (CTAs past the list's end carry nothing)
    loads[:len(res["loads"])] = res["loads"]
    res["loads"] = loads
    return p._info(res, len(qo_len), qo[-1], buf, views)


class Layout:
    """A balanced small plan of at most one item per CTA as its key decides it -- the query
    rows (qo_indptr), each tile's chunk count, L where tiles split, the queue order: every item
    row but the tiles' last KV ends and the pages, work_indptr, the merge map, the header, copied
    from the second plan written with it (a key seen once is only marked: a batch whose
    composition never repeats pays ~nothing). Serving loops replan one batch composition every step
    with KV a few tokens longer, which seldom changes a chunk count or the order of the costs
    (the key is compared exactly: a plan is always the plan of its inputs)."""

    __slots__ = ("items", "lastpos", "req", "wi", "merge", "header", "qo_start", "qo_len", "M", "P", "S")

    def __init__(self, v, res, qo, qo_len, key):
        n, M = res["n"], res["merge_rows"]
        nchunk, order = key[2], key[3]
        pos = [0] * n     # each item's queue position; a tile's last chunk ends at its KV
        for q, i in enumerate(order):
            pos[i] = q
        lastpos = [pos[e - 1] for e in accumulate(nchunk)]
        self.items = v["_items"][:, :n].copy()
        self.req = self.items[0].astype(np.intp)   # (item_request: its page start is kv_indptr's)
        self.lastpos = np.array(lastpos, dtype=np.intp)   # queue position of each tile's last chunk
        self.wi = v["work_indptr"].copy()
        self.merge = (v["merge_indptr"][:M + 1].copy(), v["_merge"][:, :M].copy()) if M else None
        self.header = v["plan_info"].copy()
        B = len(qo_len)
        self.qo_start, self.qo_len = np.array(qo[:B], dtype=np.int32), np.array(qo_len, dtype=np.int32)
        self.M, self.P, self.S = M, res["partial_rows"], res["split_tiles"]

    def write(self, v, kv_indptr, kv_len, nnz, kv_indices, t_kv) -> None:
        """This layout's plan for KV lengths `kv_len` (tiles' KV `t_kv`) and these pages into
        the views `v`: the bytes _write writes."""
        write_requests(v, self.qo_len.shape[0], self.qo_start, self.qo_len, kv_indptr, kv_len, nnz, kv_indices)
        v["work_indptr"][:] = self.wi
        it = v["_items"][:, :self.items.shape[1]]
        it[...] = self.items
        it[4][self.lastpos] = t_kv
        kv_indptr.take(self.req, out=it[7], mode="clip")   # (requests < B: clip is the unchecked take)
        if self.merge is not None:
            M = self.M
            v["merge_indptr"][:M + 1], v["_merge"][:, :M] = self.merge
        else:
            v["merge_indptr"][0] = 0
        v["plan_info"][:] = self.header


def _ints(a) -> list:
    """The values of what plan() is given every step (a 1-D int32 ndarray); else _Numpy."""
    if type(a) is np.ndarray and a.dtype is _I32 and a.ndim == 1:
        return a.tolist()
    raise _Numpy


def _batch(p, qo_indptr, kv_indptr, kv_indices, last):
    """validate_batch's rules as quick checks on lists: (qo_indptr, qo_len, kv_indptr, kv_len,
    pages read) of a batch they accept; _Numpy for anything else (validate_batch decides).
    The indptrs are 1-D int32 ndarrays (plan() checked)."""
    kp, la = kv_indptr.tolist(), _ints(last)
    B = len(kp) - 1
    qo = list(range(B + 1)) if qo_indptr is None else qo_indptr.tolist()
    b, ps = p.bounds, p.page_size
    if (type(kv_indices) is not np.ndarray or kv_indices.dtype is not _I32 or kv_indices.ndim != 1
            or B < 1 or len(qo) != B + 1 or len(la) != B or B > b.max_batch or qo[0] or kp[0]):
        raise _Numpy
    qo_len = [y - x for x, y in zip(qo, qo[1:])]
    pages = [y - x for x, y in zip(kp, kp[1:])]
    nnz = kp[-1]
    if (min(qo_len) < 0 or min(pages) < 0 or nnz * ps > _I32_MAX or kv_indices.shape[0] < nnz
            or nnz > b.max_pages or qo[-1] > b.max_qo_tokens or max(qo_len) > b.max_qo_len):
        raise _Numpy
    if nnz:
        ids = kv_indices[:nnz]
        pool = p.num_pages_pool
        if ids.item(ids.argmin()) < 0 or (pool is not None and ids.item(ids.argmax()) >= pool):
            raise _Numpy
    kv_len = []
    for n, last_len in zip(pages, la):
        if n and not 1 <= last_len <= ps:
            raise _Numpy
        kv_len.append((n - 1) * ps + last_len if n else 0)
    if p.causal and any(q > k for q, k in zip(qo_len, kv_len)):
        raise _Numpy
    return qo, qo_len, kp, kv_len, nnz


def _schedule(p, qo, qo_len, kv_len, window_left) -> dict:
    """inspector.Planner._schedule (modes auto / balanced / contiguous) on lists."""
    tq, C, mode, ps = p._tq, p.num_ctas, p.mode, p.page_size
    B = len(qo_len)
    decode = qo[-1] == B and max(qo_len) == 1
    if (B if decode else sum(-(-n // tq) for n in qo_len)) > p.small_tiles:
        raise _Numpy
    if decode:   # every request is one 1-token tile
        t_req, t_qs, t_qlen, t_kv = list(range(B)), qo[:B], qo_len, kv_len
        q0 = [k - 1 for k in kv_len]
    else:
        t_req, t_qs, t_qlen, t_kv, q0 = [], [], [], [], []
        for r in range(B):
            n, s, kv = qo_len[r], qo[r], kv_len[r]
            for off in range(0, n, tq):
                ql = min(n - off, tq)
                t_req.append(r), t_qs.append(s + off), t_qlen.append(ql), q0.append(kv - n + off)
                t_kv.append(kv - n + off + ql if p.causal else kv)   # causal: the tile's last row's horizon
    T = len(t_req)
    if T == 0:
        raise _Numpy
    t_k0 = None
    if window_left is not None:   # the tile spans [t_k0, t_kv): nothing below q0 - window_left
        t_k0 = []
        for x, k in zip(q0, t_kv):
            k0 = max(x - window_left, 0)
            t_k0.append(min(k0 - k0 % ps, k))
        t_kv = [k - k0 for k, k0 in zip(t_kv, t_k0)]
    kv_total = sum(t_kv)
    L = max(-(-kv_total // C), p.min_chunk)
    L = -(-L // ps) * ps
    tail = L // TAIL_FRACTION
    nchunk = [max((k + L - 1 - tail) // L, 1) for k in t_kv]
    fixed = _fixed(decode, t_qlen)
    if mode == "contiguous":
        return _shift(_contiguous(p, decode, _cost_axis(p, fixed, t_kv), t_req, t_qs, t_qlen, t_kv), t_k0)
    if max(nchunk) == 1:
        n, i_tile = T, None
        it = [t_req, t_qs, t_qlen, [0] * T, list(t_kv)]
        cost = [e - s + f for s, e, f in zip(it[3], it[4], fixed)]
    else:
        n = sum(nchunk)
        if n > p.bounds.max_items:
            raise _Numpy
        it = None   # the chunks' items: laid out once auto has not taken the contiguous partition
        # each tile's chunks: L tokens, the last up to its end; plus the tile's fixed cost
        cost = []
        for c, kv, f in zip(nchunk, t_kv, fixed):
            cost += [L + f] * (c - 1)
            cost.append(kv - (c - 1) * L + f)
    neg = [-x for x in cost]
    order = sorted(range(n), key=neg.__getitem__)   # longest first, stable
    cs = [cost[i] for i in order]
    key = None
    if n <= C and t_k0 is None:   # one item per CTA in sorted order: the layout follows from the key
        key = (tuple(qo), L if it is None else 0, tuple(nchunk), tuple(order))   # (unsplit: L unread)
        lay = p._small_layouts.get(key)
        if lay is not None:
            return dict(n=n, L=L, loads=cs, layout=lay, t_kv=t_kv, mode="balanced" if mode == "auto" else mode)
    con_top, auto = None, mode == "auto" and n > C
    if auto:   # the contiguous partition if lighter (inspector: the same bound, then LPT's loads;
        total = sum(cost)   # its loads alone decide: its items are laid out only when it is taken)
        bound = max(cs[0], cs[C - 1] + cs[C], -(-total // C))
        if bound * C > AUTO_IMBALANCE * total:
            axis = _cost_axis(p, fixed, t_kv)
            con_top = _contiguous_top(p, axis, t_kv)
            if con_top < bound:
                return _shift(_contiguous(p, decode, axis, t_req, t_qs, t_qlen, t_kv), t_k0)
    if it is None:
        i_tile, i_chunk, ks, ke = [], [], [], []
        for t, c in enumerate(nchunk):
            i_tile += [t] * c
            i_chunk += range(c)
            ks += range(0, c * L, L)
            ke += range(L, c * L, L)
            ke.append(t_kv[t])   # a tile's last chunk ends at its end
        it = [[t_req[t] for t in i_tile], [t_qs[t] for t in i_tile], [t_qlen[t] for t in i_tile], ks, ke]
    if n <= C:   # one item per CTA at most: queue order is the sorted order
        final, counts, loads = order, None, cs   # (None: the first n CTAs one item each; the rest none)
    else:
        if cs[0] == cs[-1]:
            cta = [i % C for i in range(n)]
        else:
            cta = lpt(cs, C)
        loads = [0] * C
        for c, x in zip(cta, cs):
            loads[c] += x
        if auto:
            top = max(loads)
            if top * C > AUTO_IMBALANCE * total:
                if con_top is None:
                    axis = _cost_axis(p, fixed, t_kv)
                    con_top = _contiguous_top(p, axis, t_kv)
                if con_top < top:
                    return _shift(_contiguous(p, decode, axis, t_req, t_qs, t_qlen, t_kv), t_k0)
        q = sorted(range(n), key=cta.__getitem__)   # queue order: (cta, assignment order)
        final = [order[i] for i in q]
        counts = [0] * C
        for c in cta:
            counts[c] += 1
    res = dict(n=n, L=L, loads=loads, counts=counts, items=it, final=final, merge_rows=0, partial_rows=0,
               split_tiles=0, mode="balanced" if mode == "auto" else mode, i_tile=i_tile)
    if i_tile is not None:
        _partials(p, res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode)
    if key is not None:   # (no layout yet: plan() marks or keeps one once the plan is written)
        res["key"] = key
    return _shift(res, t_k0)


def lpt(cs: list, C: int) -> list:
    """inspector.lpt_assign on a list of costs sorted descending: the CTA of each."""
    n, c0 = len(cs), cs[0]
    run = n if c0 == cs[-1] else next(i for i, x in enumerate(cs) if x != c0)
    m = max(run, min(n, C))
    shift = C.bit_length()
    if m > C:   # the leading run of equal costs dealt round robin: k or k + 1 on every CTA
        k, r = divmod(m, C)
        heap = [((k + (i < r)) * c0 << shift) | i for i in range(C)]
    else:
        heap = [(cs[i] << shift) | i for i in range(m)]
    return [i % C for i in range(m)] + lpt_deal(heap, [c << shift for c in cs[m:]], (1 << shift) - 1)


def _fixed(decode, t_qlen) -> list:
    """Each tile's fixed cost (COST_ALPHA per query token, COST_GAMMA per item)."""
    return [COST_ALPHA + COST_GAMMA] * len(t_qlen) if decode else [COST_ALPHA * q + COST_GAMMA for q in t_qlen]


def _cost_axis(p, fixed, t_kv):
    """The contiguous partition's cost axis: (each tile's fixed cost, each tile's end on the
    axis, the slice width w of one CTA); made once per plan, for _contiguous_top and _contiguous."""
    ends = list(accumulate(COST_BETA * k + f for k, f in zip(t_kv, fixed)))
    return fixed, ends, max(-(-ends[-1] // p.num_ctas), p.min_chunk * COST_BETA)


def _contiguous_top(p, axis, t_kv) -> int:
    """The heaviest CTA load of _contiguous's partition (the same cuts and kept pieces, no items
    laid out): what auto compares against the balanced layout before it takes either."""
    ps = p.page_size
    fixed, ends, w = axis
    loads = [0] * p.num_ctas
    for e, kv, f in zip(ends, t_kv, fixed):
        base = e - kv
        c0 = c = (base - f) // w
        prev = 0   # the piece's first token (cuts never decrease)
        for c1 in range(c0 + 1, -(e // -w)):
            cut = c1 * w - base
            cut = cut - cut % ps if cut > 0 else 0
            if cut > prev or (kv == 0 and c == c0):   # kept (an empty tile keeps its first piece)
                loads[c] += cut - prev + f
            c, prev = c1, cut
        if kv > prev or (kv == 0 and c == c0):
            loads[c] += kv - prev + f
    return max(loads)


def _contiguous(p, decode, axis, t_req, t_qs, t_qlen, t_kv) -> dict:
    """inspector.Planner._contiguous on lists: tiles end to end on one cost axis, CTA c takes
    [c w, (c + 1) w), cut on page boundaries, empty pieces dropped (an empty tile keeps one)."""
    C, ps, T = p.num_ctas, p.page_size, len(t_req)
    fixed, ends, w = axis
    i_tile, i_chunk, nchunk, ctas, ks, ke = [], [], [], [], [], []
    for t in range(T):
        e, kv = ends[t], t_kv[t]
        base = e - kv                  # cost offset of the tile's KV token 0
        c0 = c = (base - fixed[t]) // w
        prev, kept = 0, 0              # piece [prev, cut) of CTA c; cuts never decrease
        for c1 in range(c0 + 1, -(e // -w)):
            cut = c1 * w - base
            cut = cut - cut % ps if cut > 0 else 0
            if cut > prev or (kv == 0 and c == c0):   # kept (an empty tile keeps its first piece)
                i_tile.append(t), i_chunk.append(kept), ctas.append(c), ks.append(prev), ke.append(cut)
                kept += 1
            c, prev = c1, cut
        if kv > prev or (kv == 0 and c == c0):
            i_tile.append(t), i_chunk.append(kept), ctas.append(c), ks.append(prev), ke.append(kv)
            kept += 1
        nchunk.append(kept)
    n = len(i_tile)
    if n > p.bounds.max_items:
        raise _Numpy
    it = [[t_req[t] for t in i_tile], [t_qs[t] for t in i_tile], [t_qlen[t] for t in i_tile], ks, ke]
    loads, counts = [0] * C, [0] * C
    for c, s, e, t in zip(ctas, ks, ke, i_tile):
        loads[c] += e - s + fixed[t]
        counts[c] += 1
    res = dict(n=n, L=w, loads=loads, counts=counts, items=it, final=None, merge_rows=0, partial_rows=0,
               split_tiles=0, mode="contiguous", i_tile=i_tile)
    if max(nchunk) > 1:
        _partials(p, res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode)
    return res


def _partials(p, res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode) -> None:
    """inspector.Planner._partials on lists: split tile t owns partial rows pbase[t] ..
    + n_t * qo_t (state j, row r: pbase[t] + j * qo_t + r); its merge entries are consecutive."""
    st = [t for t, c in enumerate(nchunk) if c >= 2]
    T, b = len(nchunk), p.bounds
    pbase, entry = [-1] * T, [-1] * T   # -1 for unsplit tiles: their item writes through
    if decode:   # one row per tile: the merge entries are the split tiles, pbase = merge_indptr
        m_indptr = [0, *accumulate(nchunk[t] for t in st)]
        for k, t in enumerate(st):
            pbase[t], entry[t] = m_indptr[k], k
        M = len(st)
        P = m_indptr[M]
        m_row, m_start, m_stride = st, m_indptr[:M], [1] * M
    else:
        P = 0
        m_row, m_start, m_stride, cnt = [], [], [], []
        for t in st:
            ql = t_qlen[t]
            pbase[t], entry[t] = P, len(m_row)
            P += nchunk[t] * ql
            m_row += range(t_qs[t], t_qs[t] + ql)
            m_start += range(pbase[t], pbase[t] + ql)
            m_stride += [ql] * ql
            cnt += [nchunk[t]] * ql
        M = len(m_row)
        m_indptr = [0, *accumulate(cnt)]
    if P > b.max_partial_rows or M > b.max_merge_rows:
        raise _Numpy
    it.append([pbase[t] + j * q for t, j, q in zip(i_tile, i_chunk, it[2])])
    it.append([entry[t] for t in i_tile])
    res.update(m_indptr=m_indptr, m_row=m_row, m_start=m_start, m_stride=m_stride,
               merge_rows=M, partial_rows=P, split_tiles=len(st))


def _shift(res: dict, t_k0) -> dict:
    """Items laid out on span lengths -> absolute KV positions of their tile (window)."""
    if t_k0 is not None:
        it, i_tile = res["items"], res["i_tile"]
        off = t_k0 if i_tile is None else [t_k0[t] for t in i_tile]
        it[3] = [x + o for x, o in zip(it[3], off)]
        it[4] = [x + o for x, o in zip(it[4], off)]
    return res


def _write(p, v, qo, qo_len, kp, kv_len, nnz, kv_indices, res) -> None:
    """inspector.Planner._write from lists: the same arrays, the same extents."""
    B, n, C = len(qo_len), res["n"], p.num_ctas
    write_requests(v, B, qo, qo_len, kp, kv_len, nnz, kv_indices)
    wi = v["work_indptr"]
    wi[0] = 0
    counts = res["counts"]
    if counts is None:   # one item on each of the first n CTAs: 1, 2, .., n, then n
        wi[1:n + 1] = p._ar[1:n + 1]
        wi[n + 1:C + 1] = n
    else:
        wi[1:C + 1] = list(accumulate(counts))
    it = res["items"]
    if len(it) == 5:   # no split: every item writes through
        it += [[-1] * n, [-1] * n]
    it.append([kp[r] for r in it[0]])   # item_kv_page_start
    final = res["final"]
    if final is not None and n > 1:   # queue order
        pick = itemgetter(*final)
        it = [pick(row) for row in it]
    v["_items"][:, :n] = it
    write_merge_and_info(v, res, (n, res["merge_rows"], res["partial_rows"], B, p._tq, p.page_size, C, qo[-1],
                                  p._fold_chunk))
