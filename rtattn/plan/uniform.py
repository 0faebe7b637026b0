"""tile_table's one-tile batches whose requests all have the same query length qu (decode's one
token; multi-token verification: a few draft tokens per request, every step), where the plan is the contiguous
partition (mode contiguous, or auto's early choice at a few chunks per CTA) or one item per tile
(LPT: tile_table._balanced): laid out and written straight into the plan with fewer numpy calls
than the table path (docs/perf-log.md "Host path v8").

With one query length every tile has the same fixed cost f = 4 qu + 64, tile t's query rows are
[qu t, qu t + qu), and a split tile's partial rows and merge entries are runs of qu, so the item
rows, partial rows and merge map are products of item, tile and row numbers (cached qu x 0..n-1
per qu) instead of columns laid out in the table and copied. Of a contiguous plan, everything but
the cuts' KV positions and the loads follows from each tile's first CTA and piece count: a Layout
made once per (qu, those two) and reused while a serving loop replans the same composition
(docs/perf-log.md "Host path v9"). The arithmetic keeps to one dtype
(int64) with 0-d constants: a Python int operand or a cast in a ufunc costs ~2x the call. The
slices a plan reads and writes are kept too (a view costs ~0.1 us, a plan took ~25): per batch
size (BatchViews), per plan buffer and batch size (PlanViews), per layout and buffer
(Layout.views); each keeps the arrays it views, so a hit is always the same memory. The
schedule is the table path's decision for decision (the chunk bound, auto's early contiguous
choice, the same cuts, loads, partial rows and merge map): the bytes are
(tests/test_tile_table_plan.py). Tiles split into Algorithm 1's chunks are rtattn.plan.uniform_chunks'
(balanced, or auto's contiguous choice). What neither plans (short tiles whose chunk count is
clamped, bounds exceeded) goes back to the table path with nothing written.
(tile_table.plan recognises such a qo_indptr by its bytes.)
"""
from __future__ import annotations

from bisect import bisect_left

import numpy as np

from . import inspector, tile_table, uniform_chunks   # (PlanInfo, _balanced, plan: all import this module: read at call time)
from .costs import AUTO_IMBALANCE, COST_ALPHA, COST_GAMMA, TAIL_FRACTION
from .fields import PLAN_INFO_LEN, request_rows, write_info, write_requests

_ACC = np.add.accumulate
# np.bincount's C function where numpy exposes it (tile_table's too): the dispatcher's
# __array_function__ step costs ~0.2 us a call
_bincount = getattr(np.bincount, "_implementation", np.bincount)
LAYOUTS = 64   # contiguous layouts a planner keeps (Scratch.layout; cleared when full)


class Scratch:
    """A planner's buffers and constants for this path (made on its first uniform plan)."""

    def __init__(self, b):
        self.kv = np.zeros(b.max_batch, dtype=np.int64)
        self.kv_rows = np.zeros((2, b.max_items + 1), dtype=np.int64)   # [KV start, end] of item j - 1
        self.ar32 = np.arange(max(b.max_items, b.max_merge_rows) + 1, dtype=np.int32)
        # f, L - 1 - tail, L, w, w - 1 - f (each its own: _contiguous's w must not replace auto's L)
        self.c = [np.zeros((), dtype=np.int64) for _ in range(5)]
        self.f = self.L = self.w = 0   # the f, L and w that c holds
        self.cost = np.zeros(b.max_batch + 1, dtype=np.int64)   # [f, each tile's cost]: its running sum
        # is each tile's KV token 0 on the cost axis (then the tile's end + f)
        self.rows = {}   # qu -> Rows
        # the tiles' item rows for unsplit plans (inspector's order, int32): request, first query row
        # (qu t), qu, KV start 0 and end, partial and merge -1, first page; one take in queue order
        # lays out every row of the items
        # (stored tile-major: taking whole tiles of 32 bytes, then one transposed copy into the
        # plan's rows, is cheaper than taking along the rows)
        self.tiles_by_tile = np.zeros((b.max_batch, 8), dtype=np.int32)
        self.tiles = self.tiles_by_tile.T
        self.taken = np.zeros((max(b.max_batch, b.max_items), 8), dtype=np.int32)   # tiles taken per item
        self.tiles[0] = self.ar32[:b.max_batch]
        self.tiles[5:7] = -1
        self.headers = {}   # (B, qu) -> an unsplit plan's header (int32: one copy beats packing it)
        self.tiles_qu = 0   # the qu rows 1 and 2 hold
        self.key = np.zeros(2 * b.max_batch, dtype=np.int64)   # _contiguous's c0 and pieces
        self.acc = np.zeros(b.max_batch + 1, dtype=np.int64)   # the running sum of cost
        self.layouts = {}   # (qu, key bytes) -> Layout
        self.chunks = {}    # (B, qu, L, chunk counts' bytes) -> uniform_chunks.Chunks
        self.batches = {}   # B -> BatchViews (a view costs ~0.1 us: a plan takes a dozen)
        self.planned = {}   # (id(plan views), B) -> PlanViews

    def plan_views(self, v, B: int) -> "PlanViews":
        pv = self.planned.get((id(v), B))
        if pv is None or pv.v is not v:
            if len(self.planned) >= 8:
                self.planned.clear()
            pv = self.planned[id(v), B] = PlanViews(v, B, self)
        return pv

    def batch(self, B: int) -> "BatchViews":
        bv = self.batches.get(B)
        if bv is None:
            bv = self.batches[B] = BatchViews(self, B)
        return bv

    def tiles_for(self, qu: int) -> np.ndarray:
        if self.tiles_qu != qu:
            self.tiles[1] = self.rows_of(qu).q32[:self.tiles.shape[1]]
            self.tiles[2] = qu
            self.tiles_qu = qu
        return self.tiles

    def layout(self, p, qu: int, key, c0, pieces):
        """A new Layout of tiles with first CTAs c0 and `pieces` pieces (`key`: both, one array),
        kept in `layouts` (_contiguous looks it up first); None where a bound is exceeded."""
        k = (qu, key.tobytes())
        b, T = p.bounds, c0.shape[0]
        pend = _ACC(pieces)
        n = pend.item(-1)
        if n > b.max_items:
            return None
        if pieces.item(pieces.argmin()) > 1:     # every tile split
            st, S = None, T
        elif pieces.item(pieces.argmax()) > 1:
            st = (pieces > 1).nonzero()[0]
            S = st.shape[0]
        else:
            st, S = None, 0
        M, P = S * qu, (qu * (n - (T - S)) if S else 0)   # (a split tile's pieces: qu partial rows each)
        if P > b.max_partial_rows or M > b.max_merge_rows:
            return None
        if len(self.layouts) >= LAYOUTS:
            self.layouts.clear()
        lay = self.layouts[k] = Layout(p, qu, c0, pieces, pend, n, S, st, M, P, self.kv_rows)
        return lay

    def rows_of(self, qu: int):
        r = self.rows.get(qu)
        if r is None:
            r = self.rows[qu] = Rows(self.ar32, qu)
        return r


class BatchViews:
    """The scratch views a uniform plan of B tiles reads and writes (made once per B)."""

    __slots__ = ("kv64", "cost", "costx", "acc", "base", "tail", "key", "c0", "pieces")

    def __init__(self, sc, B: int):
        self.kv64 = sc.kv[:B]
        self.cost = sc.cost[1:B + 1]   # each tile's length on the cost axis: its unsplit cost
        self.costx = sc.cost[:B + 1]   # [f, cost]
        self.acc = sc.acc[:B + 1]      # its running sum: f + the tiles' ends before each
        self.base = self.acc[:B]       # each tile's KV token 0 on the axis
        self.tail = self.acc[1:]       # each tile's end + f
        self.key = sc.key[:2 * B]      # _contiguous's [c0 | pieces]: the layout's key, as bytes
        self.c0, self.pieces = self.key[:B], self.key[B:]


class PlanViews:
    """The views a uniform plan of B tiles writes in the plan views `v` (made once per buffer
    and B): the request rows, and an unsplit plan's item rows, work_indptr[1:] and tiles' rows."""

    __slots__ = ("v", "requests", "items", "wi", "kv", "page", "taken", "taken_rows")

    def __init__(self, v, B: int, sc):
        self.v, self.requests = v, request_rows(v, B)
        self.items, self.wi = v["_items"][:, :B], v["work_indptr"][1:]
        self.kv, self.page = sc.tiles[4, :B], sc.tiles[7, :B]   # (the tiles' KV end and first page)
        self.taken = sc.taken[:B]
        self.taken_rows = self.taken.T


class Rows:
    """What depends on the query length qu alone: qu x 0, 1, ... (an item's partial rows when every
    tile is split), and per merge entry e its split tile e // qu and row e % qu."""

    def __init__(self, ar32, qu: int):
        self.q32 = ar32 * np.int32(qu)
        self.q64 = self.q32.astype(np.int64)
        self.tile = ar32.astype(np.int64) // qu
        self.row32 = ar32 % np.int32(qu)
        self.qu = np.array(qu, dtype=np.int64)


def plan(p, tl, out, qo, qu, kv, kp, ids, B, nnz, nq, kv_least, safe_kv):
    """The PlanInfo of a uniform one-tile batch (validated by tile_table.plan: kv the int32 KV
    lengths, every tile with pages, kv_least a lower bound of them) if this path plans it,
    written into `out` (None: a new buffer, as Planner._buffer); else None with nothing written."""
    C, mode = p.num_ctas, p.mode
    sc = tl.uniform
    if sc is None:
        sc = tl.uniform = Scratch(p.bounds)
    F, K, L0 = sc.c[:3]
    f = COST_ALPHA * qu + COST_GAMMA
    if sc.f != f:
        F.fill(f)
        sc.cost[0] = f
        sc.f, sc.w = f, 0
    bv = sc.batch(B)
    kv64, cost, acc = bv.kv64, bv.cost, bv.acc
    kv64[...] = kv
    np.add(kv64, F, out=cost)
    _ACC(bv.costx, out=acc)            # f + the tiles' ends before each: tile t's KV token 0 at acc[t]
    total = acc.item(-1) - f
    if mode != "contiguous":
        kv_total = total - f * B
        L = tile_table.chunk_bound(p, kv_total)
        tail = L // TAIL_FRACTION
        if L >= safe_kv:
            return None
        k = L - 1 - tail
        kvmax = kv.item(kv.argmax())
        if sc.L != L:
            K.fill(k)
            L0.fill(L)
            sc.L = L
        if kvmax + k < 2 * L:   # unsplit: every tile one item
            return _unsplit(p, tl, sc, out, qo, qu, kv, bv, kp, ids, B, nnz, nq, kv_least, cost,
                            total, L, (kvmax + f, kv_least + f))
        if kv_least <= tail:   # (short tiles: their chunk count is clamped)
            return None
        # Algorithm 1's chunks per tile (kv + k) // L; the remainders of kv + k (each tile's last
        # chunk, less k) only where auto's early bound reads them (divmod costs ~2x floor_divide)
        kvk = kv64 + K
        nch = kvk // L0
        n = _ACC(nch).item(-1)
        if n > p.bounds.max_items:
            return None
        total2 = kv_total + n * f

        def split(con=None, bounded=False):   # the chunks' plan: balanced, or auto's choice on their costs
            return uniform_chunks.plan(p, tl, sc, out, qo, qu, kv, bv, kp, ids, B, nnz, nq, kv_least, total,
                                       total2, L, k, nch, con, bounded)
        if mode == "balanced" or not C < n <= 2 * C:   # (auto's early bound: C < n <= 2C only)
            return split()
        # auto's early choice on b0, tile_table._balanced's first bound on the chunks' costs (the
        # largest chunk, the C-th and (C+1)-th largest together, the mean) or a part of it: if it is
        # over AUTO_IMBALANCE and the contiguous plan's heaviest CTA under it, auto takes the
        # contiguous plan without the chunks' schedule; else that schedule decides, on its whole bound
        x = np.remainder(kvk, L0, out=kvk)
        b0 = max(L + f + max(x.item(x.argmax()) - k, 0), -(-total2 // C))   # (some tile has a full chunk)
        if b0 * C <= AUTO_IMBALANCE * total2:   # the pair, only where the rest leaves it open
            b0 = max(b0, 2 * (L + f - k) + _pair(x, k, n, B, C))
            if b0 * C <= AUTO_IMBALANCE * total2:   # (b0 is _balanced's whole first bound now)
                return split(bounded=True)
    con = _contiguous(p, tl, sc, qu, bv, total, kv_least)
    if con is None:
        return None
    if mode == "auto" and con[0] >= b0:
        return split(con)
    return _keep(p, out, sc, con, qo, qu, kv, kp, ids, B, nnz, nq)


def _pair(x, k, n, B, C) -> int:
    """The C-th and (C+1)-th largest of a split batch's n chunks (C < n <= 2C) together, each less
    L + f - k (full chunks then weigh k, tile t's last one its remainder x[t]): the (d+1)-th and
    d-th smallest, d = n - C, of the n - B full chunks merged with the B last ones."""
    xs = sorted(x.tolist())
    a, z = bisect_left(xs, k), n - B   # (last chunks lighter than a full one; full chunks)
    pair = 0
    for i in (n - C - 1, n - C):   # (a loop: a list comprehension's frame costs ~0.3 us more)
        pair += xs[i] if i < a else k if i < a + z else xs[i - z]
    return pair


def _weigh(p, tl, sc, qu, bv, total, kv_least, cost, cost_total, L, span, con=None, bounded=False):
    """tile_table._balanced on the items' `cost` (summing to `cost_total`) with uniform's contiguous
    partition as auto's alternative (`con` if made already, else made when a bound asks for it;
    `bounded`: as _balanced's): (the schedule dict or None, the contiguous plan if made or None)."""
    held = [con]

    def contiguous():
        if held[0] is None:
            held[0] = _contiguous(p, tl, sc, qu, bv, total, kv_least)
        return None if held[0] is None else dict(top=held[0][0], mode="contiguous")
    res = tile_table._balanced(p, cost, cost_total, L, contiguous, None if con is None else contiguous(), span,
                               bounded)
    return res, held[0]


def _keep(p, out, sc, con, qo, qu, kv, kp, ids, B, nnz, nq):
    """The contiguous plan `con` written into the plan buffer: its PlanInfo."""
    buf, v = p._buffer(out)
    _write(p, v, sc, con, qo, qu, kv, kp, ids, B, nnz, nq)
    top, w, loads, lay = con
    return inspector.PlanInfo(lay.n, lay.M, lay.P, B, nq, p.num_ctas, p._tq, p.page_size, w, lay.S, loads,
                              buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8), v, "contiguous")


def _unsplit(p, tl, sc, out, qo, qu, kv, bv, kp, ids, B, nnz, nq, kv_least, cost, total, L, span):
    """Every tile one item (modes auto and balanced): tile_table._balanced's schedule (LPT on the
    tiles' costs; auto weighs the contiguous partition when its bound asks), laid out here."""
    res, con = _weigh(p, tl, sc, qu, bv, total, kv_least, cost, total, L, span)
    if res is None:   # (a bound exceeded: the table path raises)
        return None
    if res["mode"] == "contiguous":
        return _keep(p, out, sc, con, qo, qu, kv, kp, ids, B, nnz, nq)
    buf, v = p._buffer(out)
    n, C = B, p.num_ctas
    pv = sc.plan_views(v, B)
    write_requests(v, B, qo, qu, kp, kv, nnz, ids, pv.requests)
    v["work_indptr"][0] = 0
    pv.wi[...] = res["wi"]
    sc.tiles_for(qu)
    pv.kv[...] = kv
    pv.page[...] = kp[:B]
    sc.tiles_by_tile.take(res["order"], axis=0, out=pv.taken, mode="clip")   # (the tiles in queue order)
    pv.items[...] = pv.taken_rows
    v["merge_indptr"][0] = 0
    hdr = sc.headers.get((B, qu))
    if hdr is None:
        hdr = sc.headers[B, qu] = np.zeros(PLAN_INFO_LEN, dtype=np.int32)
        write_info({"plan_info": hdr}, n, 0, 0, B, p._tq, p.page_size, C, nq, p._fold_chunk)
    v["plan_info"][:] = hdr
    return inspector.PlanInfo(n, 0, 0, B, nq, C, p._tq, p.page_size, res["L"], 0, res["loads"],
                              buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8), v, "balanced")


def _contiguous(p, tl, sc, qu, bv, total, kv_least):
    """tile_table._contiguous on a uniform one-tile batch (`bv`: its views, the running sum
    uniform.plan made), into scratch: (top, w, loads, Layout),
    or None where a bound is exceeded. The cuts' KV positions and the loads are this plan's; the
    rest follows from each tile's first CTA and piece count, which repeat from plan to plan while
    a batch's composition does (cached: Scratch.layout)."""
    C = p.num_ctas
    F, W, W1 = sc.c[0], sc.c[3], sc.c[4]
    w = max(-(-total // C), p.min_chunk)
    if sc.w != w:
        W.fill(w)
        W1.fill(w - 1 - sc.f)          # (acc[t + 1] is tile t's end + f)
        sc.w = w
    base, key, c0, pieces = bv.base, bv.key, bv.c0, bv.pieces
    np.add(base, tl.ps_less1, out=c0)  # the CTA whose slice ends past the tile's first page, and
    np.add(bv.tail, W1, out=pieces)    # one past the CTA of the tile's last piece: one division
    key //= W
    if kv_least < p.page_size:         # a tile shorter than a page is its last piece alone
        np.minimum(c0, pieces - tl.one, out=c0)
    pieces -= c0
    lay = sc.layouts.get((qu, key.tobytes()))
    if lay is None:
        lay = sc.layout(p, qu, key, c0, pieces)
        if lay is None:
            return None
    cut, kv_end, kv_mid, cut_next, kv_tail, _ = lay.kv   # (sc.kv_rows)
    np.multiply(lay.cta, W, out=cut)   # the piece's first token: its CTA's slice start, on a page
    cut -= base[lay.rep]
    np.maximum(cut, tl.zero, out=cut)
    cut &= tl.page_mask
    kv_mid[...] = cut_next             # a piece ends where the next piece of its tile starts
    kv_end[lay.pend] = bv.kv64         # ... the last at its tile's KV
    c = kv_tail - cut
    c += F
    loads = lay.loads(c, C)
    return loads.item(loads.argmax()), w, loads, lay


class Layout:
    """A contiguous plan's items as far as its tiles' first CTAs c0 and piece counts decide them
    (with qu and the planner): each item's tile (`rep`) and CTA, work_indptr, and -- copied from
    the first plan written with it -- the item rows but the KV and page rows, the merge map and
    the header. Serving loops replan one batch composition every step with KV a few tokens
    longer, which moves the cuts but seldom a tile's first CTA or piece count, so this is made
    once per (qu, c0, pieces) and later plans take it from Scratch.layouts (the key is compared
    exactly: a plan is always the plan of its inputs). A layout seen once costs its plan little
    more than planning without it: the first write is the direct one."""

    __slots__ = ("n", "M", "P", "S", "rep", "pend", "cta", "wi", "starts", "uses", "items", "merge", "header",
                 "_split", "_written", "kv", "_views")

    def __init__(self, p, qu, c0, pieces, pend, n, S, st, M, P, kv_rows):
        C, T, ar = p.num_ctas, c0.shape[0], p._ar
        self.n, self.M, self.P, self.S, self.pend = n, M, P, S, pend
        first = pend - pieces
        rep = self.rep = ar[:T].repeat(pieces)   # each item's tile
        cta = c0 - first                  # an item's CTA: its tile's first CTA + its piece index
        cta = self.cta = cta[rep]
        cta += ar[:n]
        wi = self.wi = np.zeros(C + 1, dtype=np.int32)
        wi[1:] = cta.searchsorted(ar[:C], "right")
        # A layout seen once is planned as without it (bincount for the loads, the item rows and
        # merge map written directly); one seen again keeps what the plans after it copy
        self.starts, self.uses, self._written = None, 0, 0
        self.items = self.merge = self.header = None   # (the second plan written with it fills them)
        self._split = (first, st, pieces.copy())
        # the views _contiguous computes the cuts in (kv_rows: [KV start, end] of item j - 1):
        # cut, kv_end, kv_end[1:n], cut[1:], kv_end[1:], and both rows of the items
        kvr = kv_rows[:, :n + 1]
        cut, kv_end = kvr[0, 1:], kvr[1]
        self.kv = (cut, kv_end, kv_end[1:n], cut[1:], kv_end[1:], kv_rows[:, 1:n + 1])
        self._views = {}   # id(plan views) -> (those views, the items' views _write writes)

    def views(self, v) -> tuple:
        """The item rows [:n], their KV rows and page row, and the merge map's views [:M + 1] /
        [:M] in the plan views `v` (kept for the few buffers a planner writes into)."""
        hit = self._views.get(id(v))
        if hit is not None and hit[0] is v:
            return hit
        n, M = self.n, self.M
        it = v["_items"][:, :n]
        hit = (v, it, it[3:5], it[7], v["merge_indptr"][:M + 1], v["_merge"][:, :M])
        if len(self._views) >= 4:
            self._views.clear()
        self._views[id(v)] = hit
        return hit

    def loads(self, c, C) -> np.ndarray:
        """Each CTA's load (a new array: PlanInfo keeps it) from the items' costs `c`: from the
        second use on, np.add.reduceat over the CTAs' runs of items (CTAs ascend with the items)
        where every CTA has some (the contiguous partition's rule)."""
        s = self.starts
        if s is not None:
            return np.add.reduceat(c, s)
        if self.uses == 1:   # (decided once, on the second use)
            wi = self.wi
            if wi[-1] == self.n and (wi[1:] > wi[:-1]).all():
                self.starts = s = wi[:-1].astype(np.intp)
                return np.add.reduceat(c, s)
        self.uses += 1
        return _bincount(self.cta, weights=c, minlength=C).astype(tile_table._I64)


def _write(p, v, sc, con, qo, qu, kv, kp, ids, B, nnz, nq) -> None:
    """The plan of a contiguous schedule `con` (_contiguous) into the views `v`: what
    tile_table._write writes, the item rows but KV and pages from the layout (after its first two
    plans: _write_first)."""
    lay = con[3]
    n, M = lay.n, lay.M
    write_requests(v, B, qo, qu, kp, kv, nnz, ids, sc.plan_views(v, B).requests)
    v["work_indptr"][:] = lay.wi
    if lay.items is None:
        _write_first(p, v, sc, lay, qo, qu, kp, B)
        return
    _, it, it_kv, it_page, mi, mg = lay.views(v)
    it[...] = lay.items
    it_kv[...] = lay.kv[5]
    kp.take(lay.rep, out=it_page, mode="clip")   # (rep < B: clip is the unchecked take)
    if M:
        mi[...], mg[...] = lay.merge
    else:
        v["merge_indptr"][0] = 0
    v["plan_info"][:] = lay.header


def _write_first(p, v, sc, lay, qo, qu, kp, B) -> None:
    """The item rows, merge map and header of a layout's first plans, written from its tiles' rows
    (sc.tiles); the second one's copied into the layout for the plans after it."""
    n, M, P, S, rep = lay.n, lay.M, lay.P, lay.S, lay.rep
    first, st, pieces = lay._split
    tt = sc.tiles_for(qu)
    r = sc.rows_of(qu)
    tt[7, :B] = kp[:B]
    # Partial rows: item j's first is z[tile] + qu j, z = qu (split tiles before - tile) for a split
    # tile (its start, qu x the split tiles' pieces before it, less qu first) and -1 - qu first
    # for the others (their one item: -1). Merge entries: a split tile's first is qu x the split
    # tiles before it, -1 for the others.
    if S == B:
        tt[5, :B] = 0
        tt[6, :B] = tt[1, :B]
    elif S:
        z = first * r.qu
        np.invert(z, out=z)
        x = st * r.qu
        np.subtract(r.q64[:S], x, out=x)
        z[st] = x
        tt[5, :B] = z
        mg = tt[6, :B]
        mg.fill(-1)
        mg[st] = r.q32[:S]
    it = v["_items"][:, :n]
    taken = sc.taken[:n]
    sc.tiles_by_tile.take(rep, axis=0, out=taken, mode="clip")   # (rep < B: clip is the unchecked take)
    it[...] = taken.T
    if S:
        tt[5:7, :B] = -1   # (unsplit plans read the table's -1 rows)
    it[3:5] = sc.kv_rows[:, 1:n + 1]
    v["merge_indptr"][0] = 0
    if S:
        it[5] += r.q32[:n]
        et = r.tile[:M]                          # each merge entry's split tile (0..S-1)
        e = r.row32[:M]                          # ... and its row in the tile
        if S == B:
            v["merge_qo_row"][:M] = sc.ar32[:M]
            pieces_st, first_st = pieces, first
        else:
            pieces_st, first_st = pieces[st], first[st]
            np.add(qo[st][et], e, out=v["merge_qo_row"][:M])
        v["merge_indptr"][1:M + 1] = _ACC(pieces_st[et])   # entry (tile, row): the tile's pieces each
        np.add(it[5][first_st][et], e, out=v["merge_partial_start"][:M])   # the tile's first item's + row
        v["merge_partial_stride"][:M].fill(qu)
    write_info(v, n, M, P, B, p._tq, p.page_size, p.num_ctas, qu * B, p._fold_chunk)
    if lay._written:   # (its second plan: the ones after it copy these)
        lay.items = it.copy()
        lay.merge = (v["merge_indptr"][:M + 1].copy(), v["_merge"][:, :M].copy()) if M else None
        lay.header = v["plan_info"].copy()
        lay._split = None
    lay._written = 1
