"""Planner.plan() for prefill batches on one table whose columns are the query tiles: requests of
one tile each (decode's one token, multi-token verification, short chunks: 1..tile_q query tokens,
MIN_BATCH requests or more) or of several (prompts, chunked prefill over cached prefixes; past the small path's
token count), every request with KV pages; modes auto, balanced and contiguous, no window.

The numpy path spends such a plan on ~150 numpy calls of 0.3-2 us each, on a few dozen to a few
hundred numbers (docs/perf-log.md "Host path v5"). Here one table per planner holds the tiles
(int64 rows: the eight item rows in inspector's order, then the per-tile values the cuts read):
the checks and the lengths fill its rows (one-tile requests are their own tiles; several-tile
requests are laid out as inspector's tiles with one `repeat` of their rows), one `take` by each
item's tile lays out every item row at once (contiguous cuts and Algorithm 1's chunks alike),
another take of the same table the merge entries, stable sorts are one sort of unique keys, and
Python ints become 0-d arrays where a ufunc reads them repeatedly. Auto decides on costs and lays
out only the plan it keeps. The schedule is the numpy path's (the same chunk bound, auto's early
choice, bound, LPT and loads, the same cuts, partial rows and merge map), so plan bytes and
PlanInfo are identical (tests/test_tile_table_plan.py; the contiguous partition's rules are
documented at inspector.Planner._contiguous). What the quick checks do not accept (other input
forms, zero-page requests, ...) goes on to the small path (rtattn.plan.small, if it is small
enough) or the numpy way, whose validation names the error; where a bound is exceeded the numpy
path plans the validated batch and raises: errors have one source. One-tile batches whose
requests all have one query length (told apart by qo_indptr's bytes) go to rtattn.plan.uniform
first, which writes the contiguous and one-item-per-tile plans (and, by rtattn.plan.uniform_chunks,
those of tiles split into chunks) straight into the buffer.
"""
from __future__ import annotations

import numpy as np

from . import inspector   # (lpt_assign; inspector imports this module: read at call time)
from . import uniform
from .costs import AUTO_IMBALANCE, COST_ALPHA, COST_GAMMA, TAIL_FRACTION
from .fields import write_merge_and_info, write_requests
from .layout import Batch

MODES = ("auto", "balanced", "contiguous")
# Batches of fewer requests take rtattn.plan.small first (plain Python: cheaper below ~4 tiles,
# docs/perf-log.md "Host path v6").
MIN_BATCH = 4
# (dtype objects: a scalar type such as np.int64 costs a dtype argument ~0.1 us to convert each call)
_I32, _I64, _U8, _U16, _U32 = (np.dtype(t) for t in (np.int32, np.int64, np.uint8, np.uint16, np.uint32))
_ACC = np.add.accumulate
_bincount = uniform._bincount
# KV tokens (pages x page size) below this keep every per-tile sum (kv + chunk bound, kv + fixed
# cost) inside int32; larger steps go the numpy way (int64 throughout).
SAFE_KV_TOKENS = 2**30
# _balanced sorts up to this many items by numpy's stable sort (timsort; ~2x cheaper than a radix
# sort below ~200 items on the development machine)
TIMSORT_ITEMS = 192
PAST_ROUND_KEPT = 256   # Tiles.queues_past_round's entries (a few hundred bytes each; cleared when full)

# Rows of the tile table: the item rows (inspector's order; KV_START 0 and PARTIAL / MERGE -1 are
# kept between plans), then what the contiguous cuts read per item. PIECES shares KV_START's row
# while the merge entries are laid out (items overwrite their KV_START).
REQUEST, QO_START, QO_LEN, KV_START, KV_END, PARTIAL, MERGE, PAGE_START = range(8)
FIXED, BASE, CTA_OFF, FIRST = range(8, 12)
PIECES = KV_START


def _k(x) -> np.ndarray:
    """x as a 0-d int64 array: a ufunc takes one in ~0.3 us, a Python int in ~0.55 (converted
    each call)."""
    return np.array(x, dtype=np.int64)


class Tiles:
    """A planner's tile table (int64[12, max_tiles], the constant rows filled), the request
    rows that several-tile batches lay out tiles from, and the 0-d constants the arithmetic
    reads."""

    def __init__(self, max_batch: int, max_tiles: int, page_size: int):
        cols = max(max_batch, max_tiles)
        self.table = np.zeros((12, cols), dtype=np.int64)
        self.table[REQUEST] = np.arange(cols)
        self.table[PARTIAL:MERGE + 1] = -1
        self.requests_are_tiles = True   # (the REQUEST row is 0, 1, ...: one-tile batches read it so)
        # several-tile requests' rows, in the table's row numbers (REQUEST constant; FIRST: first tile)
        self.req = np.zeros((FIRST + 1, max_batch), dtype=np.int64)
        self.req[REQUEST] = np.arange(max_batch)
        ps = page_size
        self.ps32, self.page_mask, self.ps_less1 = np.array(ps, dtype=np.int32), _k(-ps), _k(ps - 1)
        self.alpha, self.gamma, self.zero, self.one = _k(COST_ALPHA), _k(COST_GAMMA), _k(0), _k(1)
        self.uniform = None   # rtattn.plan.uniform's scratch (uniform.Scratch), made on first use
        self.lpt = {}   # inspector.lpt_assign's scratch
        self.past_round = {}   # CTAs of the items past LPT's first round -> their queues (_queues)
        self.span_top = _k(0)   # _balanced's bound of the costs
        # qu -> the bytes of qu x (0, 1, .., max_batch) as int32 (qo_indptr of qu tokens per request),
        # for the query lengths of one tile (1..tile_q) that plans have used; and qu repeated
        self.uniform_bytes, self._uniform_q = {}, {}
        self.max_batch = max_batch

    def queues_past_round(self, extra: tuple, C: int, ar):
        """_queues of LPT's items past its first round by a few, on CTAs 0 .. C-1 then `extra`
        (inspector.lpt_few): kept per `extra`, read-only (a serving loop meets a few)."""
        hit = self.past_round.get(extra)
        if hit is None:
            if len(self.past_round) >= PAST_ROUND_KEPT:
                self.past_round.clear()
            hit = _queues(np.concatenate((ar[:C], extra)), C, ar)
            for a in hit:
                a.flags.writeable = False
            self.past_round[extra] = hit
        return hit

    def uniform_rows(self, qu: int) -> bytes:
        self._uniform_q[qu] = np.full(self.max_batch, qu, dtype=np.int32)
        b = self.uniform_bytes[qu] = (np.arange(self.max_batch + 1, dtype=np.int32) * np.int32(qu)).tobytes()
        return b

    def uniform_q(self, qu: int) -> np.ndarray:
        """qu per request (int32, max_batch of them: slice it)."""
        return self._uniform_q[qu]


def plan(p, qo, kp, ids, last, window_left, out):
    """PlanInfo if this path takes the batch (written into p._buffer(out)), else None (nothing
    written). `kp` is a 1-D ndarray of two entries or more (Planner.plan checks that before the
    call)."""
    nd = np.ndarray
    if (window_left is not None or p.mode not in MODES or p.chunk_runs or type(qo) is not nd
            or type(ids) is not nd or type(last) is not nd or qo.dtype is not _I32
            or kp.dtype is not _I32 or ids.dtype is not _I32 or last.dtype is not _I32
            or qo.ndim != 1 or ids.ndim != 1 or last.ndim != 1):
        return None
    B = kp.shape[0] - 1
    b, ps, tq = p.bounds, p.page_size, p._tq
    if qo.shape[0] != B + 1 or last.shape[0] != B or B > b.max_batch:
        return None
    if B < MIN_BATCH and qo.item(-1) <= B * tq:   # (one-tile, or few tokens: the small path's)
        return None
    nnz, nq = kp.item(-1), qo.item(-1)
    if (qo.item(0) or kp.item(0) or not B <= nnz <= b.max_pages or nnz * ps >= SAFE_KV_TOKENS
            or ids.shape[0] < nnz or nq > b.max_qo_tokens or B * b.max_qo_len >= 2**31 or B >= 2**20):
        return None
    # Query lengths in int32: if every difference is in [1, max_qo_len] (as wrapped), qo_indptr is
    # their exact running sum (the sums stay below B x max_qo_len < 2**31), so monotone.
    tl = tiles(p)
    qmax = qo.item(1)
    ub = tl.uniform_bytes.get(qmax)   # (qo_indptr of qmax tokens per request, as bytes; one-tile lengths only)
    if ub is None and 1 <= qmax <= min(tq, b.max_qo_len):
        ub = tl.uniform_rows(qmax)
    if ub is not None and ub.startswith(qo.tobytes()):   # (qo: B + 1 entries, checked above)
        q, qmin = None, qmax   # every request qmax tokens, one tile (qo_indptr's bytes: no difference to take)
    else:
        q = qo[1:] - qo[:-1]
        qmin, qmax = q.item(q.argmin()), q.item(q.argmax())
        if qmin < 1 or qmax > b.max_qo_len:
            return None
    if kp.item(kp.argmin()) < 0:
        return None
    multi = qmax > tq   # some request is several query tiles
    if multi and nq <= p.small_tokens:   # (few tokens: the small path's, if its tiles are few)
        return None
    if not multi and B < MIN_BATCH:
        return None
    pages = kp[1:] - kp[:-1]   # (kv_indptr >= 0: exact)
    lmin, lmax = last.item(last.argmin()), last.item(last.argmax())
    pmin = pages.item(pages.argmin())
    if pmin < 1 or lmin < 1 or lmax > ps:
        return None
    kv = pages * tl.ps32
    kv += last
    kv -= tl.ps32
    kv_least = (pmin - 1) * ps + lmin   # no tile's KV is shorter
    if p.causal and qmax > kv_least:   # (else every KV outlasts every query)
        d = kv - (qmax if q is None else q)
        if d.item(d.argmin()) < 0:
            return None
    pool = p.num_pages_pool
    u = ids[:nnz].view(_U32)   # (a negative id is >= 2**31 as unsigned)
    if u.item(u.argmax()) >= (2**31 if pool is None else min(pool, 2**31)):
        return None
    if multi:
        t = _tiles_of(p, tl, qo, q, kv, kp, B)
        if t is None:
            return None
        tlen = t[QO_LEN]
        qmin = tlen.item(tlen.argmin())   # (a request's last tile may be short)
        kv_least = t[KV_END].item(t[KV_END].argmin())
        tmax = tq
    else:
        if qmin == qmax and (info := uniform.plan(p, tl, out, qo, qmin, kv, kp, ids, B, nnz, nq,
                                                  kv_least, SAFE_KV_TOKENS)) is not None:
            return info
        if q is None:
            q = tl.uniform_q(qmax)[:B]
        if not tl.requests_are_tiles:   # (a several-tile plan left its tiles' requests there)
            tl.table[REQUEST] = p._ar[:tl.table.shape[1]]
            tl.requests_are_tiles = True
        t = tl.table[:, :B]
        t[QO_START] = qo[:B]
        t[QO_LEN] = q
        t[KV_END] = kv
        t[PAGE_START] = kp[:B]
        tmax = qmax
    T = t.shape[1]
    fixed = t[FIXED]   # each tile's fixed cost, from lo to hi
    lo, hi = COST_ALPHA * qmin + COST_GAMMA, COST_ALPHA * tmax + COST_GAMMA
    if lo == hi:
        fixed.fill(lo)
    else:
        np.multiply(t[QO_LEN], tl.alpha, out=fixed)
        fixed += tl.gamma
    res = _schedule(p, tl, t, T, nq, lo, hi, kv_least)
    buf, views = p._buffer(out)
    if res is None:   # a bound exceeded: the numpy path's error, on this batch
        batch = Batch(qo, kp, ids, last, q.astype(np.int64), kv.astype(np.int64), ps, qmax)
        return p.plan_batch(batch, buf, views)
    _write(p, views, res, qo, q, kp, ids, kv, B, nnz, nq)
    return p._info(res, B, nq, buf, views)


def tiles(p) -> Tiles:
    """The planner's tile table and scratch, made on the first plan that needs them (decode
    planners may never)."""
    tl = p._tiles
    if tl is None:
        tl = p._tiles = Tiles(p.bounds.max_batch, p.bounds.max_tiles, p.page_size)
    return tl


def chunk_bound(p, kv_total: int) -> int:
    """Algorithm 1's chunk bound L (Planner._schedule's) for kv_total KV tokens over the
    planner's CTAs: at least its min_chunk, a page multiple."""
    L = max(-(-kv_total // p.num_ctas), p.min_chunk)
    return -(-L // p.page_size) * p.page_size


def one_chunk(kvmax: int, L: int) -> bool:
    """Whether Algorithm 1 at bound L keeps every tile of at most kvmax KV tokens one chunk (a
    tail of up to L / TAIL_FRACTION joins the chunk before it)."""
    return kvmax + L - 1 - L // TAIL_FRACTION < 2 * L


def _tiles_of(p, tl, qo, q, kv, kp, B):
    """The tile table's columns for requests of several query tiles (inspector.Planner._schedule's
    tiles: request-major, tile_q rows each, a request's last tile what remains; causal tiles see
    up to their last row), or None past max_tiles (the numpy path decides)."""
    tq = p._tq
    ntile = q + (tq - 1)
    ntile //= tq
    tend = _ACC(ntile)
    T = tend.item(-1)
    if T > tl.table.shape[1] or T > p.bounds.max_tiles:
        return None
    r = tl.req[:, :B]   # the requests' rows, repeated once for their tiles
    r[QO_START], r[QO_LEN], r[PAGE_START] = qo[:B], q, kp[:B]
    if p.causal:   # a tile's KV: kv - q + its last row + 1 (the horizon of its last row)
        np.subtract(kv, q, out=r[KV_END])
    else:
        r[KV_END] = kv
    np.subtract(tend, ntile, out=r[FIRST])   # the request's first tile
    x = r.repeat(ntile, axis=1)
    t = tl.table[:, :T]
    t[REQUEST] = x[REQUEST]
    tl.requests_are_tiles = False
    off = p._ar[:T] - x[FIRST]
    off *= tq   # the tile's first query row in its request
    np.add(x[QO_START], off, out=t[QO_START])
    qlen = t[QO_LEN]
    np.subtract(x[QO_LEN], off, out=qlen)
    np.minimum(qlen, tq, out=qlen)
    if p.causal:
        np.add(x[KV_END], off, out=t[KV_END])
        t[KV_END] += qlen
    else:
        t[KV_END] = x[KV_END]
    t[PAGE_START] = x[PAGE_START]
    return t


def _schedule(p, tl, t, T, nq, lo, hi, kv_least):
    """inspector.Planner._schedule on the table's tiles (`lo`, `hi`: the least and largest
    tile's fixed cost; `kv_least`: a lower bound of every tile's KV): the schedule dict (with
    the items `it`, rows in queue order, and `wi`, work_indptr[1:]), or None where a bound is
    exceeded (the numpy path plans the batch and raises)."""
    C, mode = p.num_ctas, p.mode
    kv = t[KV_END]
    cost = t[FIXED] + kv   # each tile's length on the cost axis = its unsplit cost
    ends = _ACC(cost)
    total = ends.item(-1)
    if mode == "contiguous":
        return _contiguous(p, tl, t, ends, kv_least)
    kv_total = total - COST_ALPHA * nq - COST_GAMMA * T
    L = chunk_bound(p, kv_total)
    if L >= SAFE_KV_TOKENS:
        return None
    tail = L // TAIL_FRACTION
    kvmax = kv.item(kv.argmax())
    def contiguous():   # (auto's alternative, made when a bound asks for it)
        return _contiguous(p, tl, t, ends, kv_least)
    if one_chunk(kvmax, L):   # unsplit: every tile one item, its cost the tile's length
        res = _balanced(p, cost, total, L, contiguous, None, (kvmax + hi, kv_least + lo))
        if res is not None and res["mode"] == "balanced":
            res["it"] = t[:8].take(res.pop("order"), axis=1)
        return res
    nchunk = kv + _k(L - 1 - tail)   # Algorithm 1's chunks of L, a tail of <= L/8 in the last
    L0 = _k(L)
    nchunk //= L0
    if kv_least <= tail:   # a tile of at most the tail: still one chunk
        np.maximum(nchunk, 1, out=nchunk)
    pend = _ACC(nchunk)
    n = pend.item(-1)
    if n > p.bounds.max_items:
        return None
    # (every chunk pays its tile's fixed cost)
    total = kv_total + (n * lo if lo == hi else int(nchunk.dot(t[FIXED])))
    con = last = lay = None
    if mode == "auto" and C < n <= 2 * C:
        # inspector.Planner._auto_contiguous_first (prefill tiles): the largest chunk and the mean
        mean = -(-total // C)
        if max(L + L // TAIL_FRACTION + hi, mean) * C > AUTO_IMBALANCE * total:
            last = cost - nchunk * L0   # each tile's last chunk's cost, less L
            b0 = max(L + lo, L + last.item(last.argmax()), mean)
            if b0 * C > AUTO_IMBALANCE * total:
                con = contiguous()
                if con is None or con["top"] < b0:
                    return con
    if n <= C:   # one chunk per CTA at most: the balanced plan, no bound to weigh
        lay = _chunk_items(p, tl, t, nchunk, pend, L0)
        if lay is None:
            return None
        it = lay[0]
        c = it[KV_END] - it[KV_START]
        c += it[FIXED]
    else:   # auto may take the contiguous plan: decide on the chunks' costs, lay out what it keeps
        # (L plus the tile's fixed cost; a tile's last chunk what remains)
        c = np.full(n, L + lo, dtype=np.int64) if lo == hi else t[FIXED].repeat(nchunk) + L0
        if last is None:
            last = cost - nchunk * L0
        last += L0
        c[pend - tl.one] = last
    res = _balanced(p, c, total, L, contiguous, con)
    if res is None or res["mode"] != "balanced":
        return res
    if lay is None:
        lay = _chunk_items(p, tl, t, nchunk, pend, L0)
        if lay is None:
            return None
    it, rows = lay
    if rows is not None:
        res.update(rows)
    res["it"] = it[:8].take(res.pop("order"), axis=1)
    return res


def _chunk_items(p, tl, t, nchunk, pend, L0):
    """_chunks with the split tiles' partial rows and merge map (_split_rows): (it, that dict or
    None), or None where a bound is exceeded."""
    lay = _chunks(p, tl, t, nchunk, pend, L0)
    if lay is None:
        return None
    it, k, split = lay
    return it, (_split_rows(p, it, k, split) if split else None)


def _chunks(p, tl, t, nchunk, pend, L0):
    """Algorithm 1's chunks of L0 tokens (`nchunk` per tile, running counts `pend`) laid out in
    tile order: (it, k, split) as _pieces gives them with KV_START and KV_END filled, or None
    where a bound is exceeded."""
    lay = _pieces(p, tl, t, nchunk, pend)
    if lay is None:
        return None
    it, k, pend, split = lay
    kv_start = k * L0
    it[KV_START] = kv_start
    kv_start += L0
    kv_start[pend - tl.one] = t[KV_END]   # a tile's last chunk ends at its end
    it[KV_END] = kv_start
    return it, k, split


def _balanced(p, cost, total, L, contiguous, con, span=None, bounded=False):
    """The numpy path's balanced schedule of items of costs `cost` (in layout order, summing to
    `total`): longest first, LPT past one item per CTA, auto's bound and loads against the
    contiguous partition (`con`, or made by calling `contiguous()` when asked: a dict with its
    heaviest load `top`, or None where a bound is exceeded); `span` (hi, lo): bounds of the costs,
    if known; `bounded`: auto's first bound (the largest item, the C-th and (C+1)-th together, the
    mean) weighed by the caller and found under AUTO_IMBALANCE (uniform's b0). The schedule dict: the
    contiguous plan's if auto takes it, else the balanced one with `order`, the layout indices
    of the items in queue order (the caller lays them out); None where a bound is exceeded."""
    C, n, ar, auto = p.num_ctas, cost.shape[0], p._ar, p.mode == "auto"
    # longest first, ties in layout order: numpy's stable sort (timsort) is the cheapest on a few
    # hundred int64 costs or less, a radix sort of 16-bit keys past that
    if n <= TIMSORT_ITEMS:
        order = np.negative(cost).argsort(kind="stable")
    elif span is not None and span[0] - span[1] < 2**16:
        hi0 = p._tiles.span_top   # (a kept 0-d array: a new one costs more than the fill)
        hi0.fill(span[0])
        order = np.subtract(hi0, cost).astype(_U16).argsort(kind="stable")
    else:
        order = _sorted_keys(cost, -1, ar[:n])
    cs = cost[order]
    if n <= C:   # one item per CTA at most: queue order is the sorted order
        loads = np.zeros(C, dtype=_I64)
        loads[:n] = cs
        return _schedule_dict(n, L, loads, np.minimum(ar[1:C + 1], n), order)
    if auto and not bounded:
        bound = max(cs.item(0), cs.item(C - 1) + cs.item(C), -(-total // C))
        if bound * C > AUTO_IMBALANCE * total:
            if con is None:
                con = contiguous()
            if con is None or con["top"] < bound:
                return con
    # (a few items past the first round: their CTAs and the loads; lpt_assign's rounds past that)
    few = inspector.lpt_few(cs, C) if n <= C + inspector.LPT_FEW else None
    if few is None:
        cta = ar[:n] % C if cs.item(0) == cs.item(n - 1) else inspector.lpt_assign(cs, C, ar, p._tiles.lpt, False)
        loads = _bincount(cta, weights=cs, minlength=C).astype(_I64)
    else:
        loads = few[1]
    if auto:
        top = loads.item(loads.argmax())
        if top * C > AUTO_IMBALANCE * total:
            if con is None:
                con = contiguous()
            if con is None or con["top"] < top:
                return con
    wi, q = _queues(cta, C, ar) if few is None else p._tiles.queues_past_round(few[0], C, ar)
    return _schedule_dict(n, L, loads, wi, order[q])


def _schedule_dict(n, L, loads, wi, order) -> dict:
    """_balanced's schedule dict (no split tiles here: the caller adds their rows)."""
    return dict(n=n, L=int(L), merge_rows=0, partial_rows=0, split_tiles=0, mode="balanced", loads=loads,
                wi=wi, order=order)


def _queues(cta, C, ar):
    """work_indptr[1:] and the queue order (cta, assignment order: indices into `cta`) of items on
    CTAs `cta`; CTA ids in 8 bits sort by radix (~2.5x cheaper)."""
    q = cta.astype(_U8).argsort(kind="stable") if C <= 256 else _sorted_keys(cta, 1, ar[:cta.shape[0]])
    return _ACC(_bincount(cta, minlength=C)), q


def _sorted_keys(x, sign, index):
    """argsort(sign * x, kind="stable") for int64 x, |x| < 2**40, from one unstable sort of the
    unique keys sign * x * 2**s + index (~2x cheaper)."""
    s = index.shape[0].bit_length()
    if s > 22:
        return (x if sign > 0 else -x).argsort(kind="stable")
    key = x << s
    if sign < 0:
        np.negative(key, out=key)
    key += index
    key.sort()
    key &= (1 << s) - 1
    return key


def _pieces(p, tl, t, pieces, pend=None):
    """The items of tiles cut into `pieces` consecutive pieces each (contiguous cuts or
    Algorithm 1's chunks; `pend` their running counts if known), in tile order: (it, every row
    of the table per item with KV_START to fill and PARTIAL its tile's first partial row; each
    item's piece index k; pend; the merge entries of split tiles or None), or None where a
    bound is exceeded."""
    T, b, ar = t.shape[1], p.bounds, p._ar
    if pend is None:
        pend = _ACC(pieces)
    n = pend.item(-1)
    if n > b.max_items:
        return None
    np.subtract(pend, pieces, out=t[FIRST])
    split = None
    if pieces.item(pieces.argmax()) > 1:   # split tiles: partial rows and merge entries
        st = (pieces > tl.one).nonzero()[0]
        q_st = t[QO_LEN].take(st)
        rows = pieces.take(st)
        rows *= q_st
        pe = _ACC(rows)
        P = pe.item(-1)
        e_end = _ACC(q_st)
        M = e_end.item(-1)
        if P > b.max_partial_rows or M > b.max_merge_rows:
            return None
        part, merge = t[PARTIAL], t[MERGE]
        pe -= rows
        part[st] = pe         # the tile's first partial row
        e_end -= q_st
        merge[st] = e_end     # ... and first merge entry
        t[PIECES] = pieces
        # merge entry (tile, row r): its tile's column (rows QO_START .. MERGE)
        e = tl.table[QO_START:MERGE + 1].take(st.repeat(q_st), axis=1)
        t[KV_START] = 0       # (the table's defaults again)
        it = tl.table.take(ar[:T].repeat(pieces), axis=1)
        part[st] = -1
        merge[st] = -1
        split = (e, M, P, st.shape[0])
    else:
        it = t.copy()
    k = ar[:n] - it[FIRST]
    return it, k, pend, split


def _split_rows(p, it, k, split) -> dict:
    """Items' partial rows (their tile's first + piece k x its query rows) and the merge map of
    the split tiles (inspector.Planner._partials)."""
    e, M, P, S = split
    k = k * it[QO_LEN]
    it[PARTIAL] += k   # (unsplit tiles: -1 + 0)
    r = p._ar[:M] - e[MERGE - QO_START]
    m_indptr = np.zeros(M + 1, dtype=np.int64)
    m_indptr[1:] = _ACC(e[PIECES - QO_START])
    m_row = e[0]
    m_row += r
    m_start = e[PARTIAL - QO_START]
    m_start += r
    return dict(m_indptr=m_indptr, m_row=m_row, m_start=m_start, m_stride=e[QO_LEN - QO_START],
                merge_rows=M, partial_rows=P, split_tiles=S)


def _contiguous(p, tl, t, ends, kv_least):
    """inspector.Planner._contiguous (not chunk runs) on the table's tiles, all with KV (`kv_least`:
    a lower bound of every tile's): the schedule dict with its heaviest CTA load (`top`), or
    None where a bound is exceeded (the numpy path raises)."""
    C, ar = p.num_ctas, p._ar
    total = ends.item(-1)
    w = max(-(-total // C), p.min_chunk)   # (COST_BETA = 1)
    w0 = _k(w)
    base = t[BASE]
    np.subtract(ends, t[KV_END], out=base)   # each tile's KV token 0 on the axis
    c0 = t[CTA_OFF]   # the CTA whose slice ends past the tile's first page takes its piece at token 0
    np.add(base, tl.ps_less1, out=c0)
    c0 //= w0
    pieces = ends + (w - 1)
    pieces //= w0    # one past the CTA of the tile's last piece
    if kv_least < p.page_size:   # a tile shorter than a page is its last piece alone
        np.minimum(c0, pieces - 1, out=c0)
    pieces -= c0
    lay = _pieces(p, tl, t, pieces)
    if lay is None:
        return None
    it, k, pend, split = lay
    cta = it[CTA_OFF]
    cta += k
    cut = cta * w0       # the piece's first token: CTA cta's slice start in the tile, on a page
    cut -= it[BASE]
    cut = np.maximum(cut, tl.zero)
    cut &= tl.page_mask
    it[KV_START] = cut
    kv_end = it[KV_END]   # a piece ends where the next piece of its tile starts; the last at its KV
    kv_end[:-1] = cut[1:]
    pend -= tl.one
    kv_end[pend] = t[KV_END]
    c = kv_end - cut
    c += it[FIXED]
    loads = _bincount(cta, weights=c, minlength=C).astype(_I64)
    res = dict(n=k.shape[0], L=int(w), loads=loads, top=loads.item(loads.argmax()),
               wi=cta.searchsorted(ar[:C], "right"), it=it[:8], merge_rows=0, partial_rows=0, split_tiles=0,
               mode="contiguous")
    if split:
        res.update(_split_rows(p, it, k, split))
    return res


def _write(p, v, res, qo, q, kp, ids, kv, B, nnz, nq) -> None:
    """inspector.Planner._write: the same arrays, the same extents."""
    C, n = p.num_ctas, res["n"]
    write_requests(v, B, qo, q, kp, kv, nnz, ids)
    wi = v["work_indptr"]
    wi[0] = 0
    wi[1:C + 1] = res["wi"]
    v["_items"][:, :n] = res["it"]
    write_merge_and_info(v, res, (n, res["merge_rows"], res["partial_rows"], B, p._tq, p.page_size, C, nq,
                                  p._fold_chunk))
