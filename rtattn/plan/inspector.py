"""The planner: Algorithm 1 of the FlashInfer paper, written into fixed offsets.

Work item = (request, query tile of <= tile_q tokens, KV chunk [kv_start, kv_end)).
The kernel grid is fixed: (num_ctas, num_kv_heads); CTA (c, h) runs queue c for
KV head h and all g query heads of that group.  So the plan does not depend on
the head counts except through num_ctas.

Modes
  balanced         chunk bound L = ceil(sum_t kv_t / num_ctas), floored at
                   max(page_size, min_chunk_tokens) and rounded up to a page
                   multiple (chunks start on page boundaries: kernels load whole
                   pages), a tile's tail of <= L/8 joining its last chunk (one
                   item less: at 64 x 2048, g=16, L = 1008 left a 32-token third
                   chunk per request); longest-first (stable) + min-heap on
                   (load, cta id).
  naive            one item per (request, tile), no split, round-robin in order.
  batch-invariant  chunks of C tokens at fixed KV positions (0, C, 2C, ... from the
                   tile's first visible token: 0, or its window's page) whose states
                   are folded left to right: a request's bits do not depend on the
                   batch.  Decode kernel (`chunk_runs`): an item is a
                   run of whole chunks, planned as auto plans (balanced segments of
                   L rounded up to a multiple of C, or contiguous cuts on chunk
                   boundaries); the kernel folds the run's chunk states itself, a
                   split tile writes one partial row per chunk, the merge folds them
                   in chunk order with the same fold. C = run_chunk(): auto's
                   smallest split (so a small batch splits as finely as in auto),
                   and at least 32 g tokens up to 512 (a chunk's state stays 1/32 of
                   its KV; g = 32 still splits as auto splits 64 x 2048).
                   Other kernels: one item per chunk, C from the grid
                   (invariant_chunk()), assignment as in balanced.

Cost of an item (integer, so ties and loads are exact):
  COST_ALPHA * query_tokens + COST_BETA * kv_tokens + COST_GAMMA
  BETA = 1: the unit is one KV token (K+V row load + its dot products for all
  rows of the tile).  ALPHA = 4: a query token loads q and stores o for g
  heads, ~ a few KV rows' worth of traffic.  GAMMA = 64: fixed per-item cost
  (queue read, pipeline fill, and for split items the partial write + merge).

Visible KV: a tile's items cover only the KV its query rows can see.  Causal
(planner built with causal=True): tile t of request b needs KV below
kv_b - qo_b + last_row_of_tile + 1 (its last row's horizon).  Sliding window
(plan(..., window_left=w)): nothing below q_pos(first row) - w, rounded down to
a page boundary (kernels load whole pages; the kernel's mask drops the rest).
Chunks are laid out from the tile's first visible token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import fields as F
from . import order as queue_orders, small, tile_table
from .costs import AUTO_IMBALANCE, COST_ALPHA, COST_BETA, COST_GAMMA, MIN_CHUNK_TOKENS, TAIL_FRACTION
from .devices import get_device
from .layout import Batch, check_config, check_int, indptr_from_lengths, validate_batch
from .tiles import TileConfig, num_ctas_for, select_tile

# Batch-invariant chunk: the balanced chunk of a small decode batch, 16 requests x 1024 tokens,
# spread over this grid. A batch that small (or smaller, or skewed: one long request among short
# ones) is split as finely as balanced mode would split it, so it pays no tail for being
# invariant; larger batches pay only more items and partial rows, not a longer slowest CTA.
INVARIANT_REF_TOKENS = 16 * 1024


# Chunk runs: every chunk of a split row writes its state (g rows x D float32 per KV head) and
# the kernel combines its warps once per chunk, both in proportion to g / C: C >= 32 g tokens
# keeps the state writes at 1/32 of the chunk's bf16 K+V (H200, docs/perf-log.md "Batch-invariant
# v2": at C = 128, 64 x 2048 at g = 16 ran 1.53x auto, g = 4 rows 0.9-1.06x).
RUN_CHUNK_TOKENS_PER_HEAD = 32
# ... up to 512 tokens: g = 32 keeps auto's split of 64 x 2048 (497-token items, 2 CTAs per SM).
RUN_CHUNK_MAX_TOKENS = 512


def run_chunk(page_size: int, block_tokens: int, group: int = 1, min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """The chunk of a chunk-run batch-invariant plan: min_chunk_tokens (auto never splits finer)
    and at least RUN_CHUNK_TOKENS_PER_HEAD x the head group (at most RUN_CHUNK_MAX_TOKENS), rounded up to a multiple of the page
    and of the kernel's KV block (chunks start blocks). From the heads and the kernel, never the
    batch."""
    grain = math.lcm(int(page_size), int(block_tokens))
    c = max(int(min_chunk_tokens), min(RUN_CHUNK_TOKENS_PER_HEAD * int(group), RUN_CHUNK_MAX_TOKENS), 1)
    return -(-c // grain) * grain


def invariant_chunk(num_ctas: int, page_size: int, min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """The batch-invariant chunk for a grid of `num_ctas` CTAs per KV head (the device's SMs x
    resident CTAs / KV heads): INVARIANT_REF_TOKENS / num_ctas rounded up to a power of two, at
    least min_chunk_tokens, a page multiple. Depends on the device and the heads only."""
    c = max(-(-INVARIANT_REF_TOKENS // max(1, int(num_ctas))), int(min_chunk_tokens), 1)
    c = 1 << (c - 1).bit_length()
    return -(-c // page_size) * page_size


@dataclass(slots=True)
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
    mode: str = ""             # the mode that made it (what "auto" chose)
    queue_order: str = "lpt"   # the queue order it took (Planner queue_order, or LPT's: rtattn.plan.order)

    @property
    def max_load(self) -> int:
        return int(self.cta_loads.max()) if self.cta_loads.size else 0

    @property
    def planned_kv_tokens(self) -> int:
        """KV tokens the plan reads, summed over its items (per KV head)."""
        n = self.num_items
        v = self.views
        return int(np.subtract(v["item_kv_end"][:n], v["item_kv_start"][:n], dtype=np.int64).sum())


_ADD = np.add.reduce
_ACC = np.add.accumulate


def _top(a: np.ndarray) -> int:
    """Largest entry (argmax: ~4x cheaper than a ufunc reduction on small arrays)."""
    return a.item(a.argmax())


def _repeat_index(counts: np.ndarray, ar: np.ndarray, ends: np.ndarray | None = None):
    """For counts c_i: (owner index of each of the sum(c) elements, position
    within its owner).  `ar` is a cached arange at least sum(c) long; `ends`
    the inclusive cumsum of counts if the caller has it."""
    if ends is None:
        ends = _ACC(counts, dtype=np.int64)
    n = ends.item(-1) if ends.shape[0] else 0
    owner = ar[:counts.shape[0]].repeat(counts)   # the method: np.repeat adds ~0.7 us of dispatch
    pos = ar[:n] - (ends - counts)[owner]
    return owner, pos


def check_window(window_left):
    """None (no window) or a non-negative int, else ValueError naming window_left."""
    if window_left is None:
        return None
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left must be an int (KV tokens left of the query) or None, got {window_left!r}")
    if window_left < 0:
        raise ValueError(f"window_left={window_left} is negative; a window sees q_pos - window_left .. q_pos "
                         f"(None: no window)")
    if window_left >= 2**31:
        raise ValueError(f"window_left={window_left} does not fit int32 (the kernel's mask reads it)")
    return int(window_left)


def _shift(res: dict, t_k0) -> dict:
    """Items laid out on span lengths [0, len) -> absolute KV [t_k0 + ., t_k0 + .) of their tile."""
    if t_k0 is not None:
        it = res["items"]
        i_tile = res.get("i_tile")
        off = t_k0 if i_tile is None else t_k0[i_tile]
        it[3] += off
        it[4] += off
    return res


def _item_partials(it, T, st, pbase_st, entry_st, i_tile, row_off) -> None:
    """Items' partial row and merge entry (it[5:7]) from each split tile `st`'s first partial row
    and first merge entry; an item's partial row is its tile's plus `row_off`. -1 for unsplit
    tiles: their only item has chunk 0 (row_off 0), so its partial index comes out as -1
    (writethrough) with no extra select."""
    tile_pm = np.empty((2, T), dtype=np.int64)
    tile_pm.fill(-1)
    pbase, entry = tile_pm[0], tile_pm[1]   # 1-D rows: their fancy assignments are ~3x cheaper
    pbase[st] = pbase_st
    entry[st] = entry_st
    pm = tile_pm.take(i_tile, axis=1)
    pm[0] += row_off
    it[5:7] = pm


def lpt_assign(cost_sorted: np.ndarray, num_ctas: int, ar: np.ndarray, scratch: dict | None = None,
               few: bool = True) -> np.ndarray:
    """Longest-processing-time assignment of costs sorted descending (int64).
    Least-loaded CTA first, ties by CTA id.  Returns the CTA of each item
    (int64); a CTA's load is the sum of its items' costs. `scratch` (a dict the caller keeps):
    the rounds' arrays are kept there per (items, CTAs), and the result may be one of them
    (valid until the next call with that scratch). `few` False: the caller found lpt_few's
    None for these costs (not asked again).

    Key = (load << shift) | cta as one Python int, so heapq compares plain ints
    and the loop body is two C calls.  The first num_ctas items land on CTAs
    0, 1, ... (all loads are 0 then), so the heap starts from them. Where every
    item outweighs the spread of the loads, the heap's steps are whole rounds
    (_lpt_rounds): one sort per round of num_ctas items instead of a heap step each."""
    n = cost_sorted.shape[0]
    # A leading run of equal costs (full chunks: batch-invariant's are all C tokens) goes round
    # robin, exactly as the heap would deal it (all loads equal -> lowest id first); the heap
    # then starts from those loads and deals only the rest.
    # (m = max(run, min(n, C)): the run matters only when it outlasts the first round)
    c0 = cost_sorted.item(0)
    if n > num_ctas and cost_sorted.item(num_ctas) == c0:
        m = n if cost_sorted.item(n - 1) == c0 else int((cost_sorted != c0).argmax())
    else:
        m = min(n, num_ctas)
    if m == n:
        return ar[:n] % num_ctas if m > num_ctas else ar[:n].copy()
    if few and m == num_ctas and (dealt := lpt_few(cost_sorted, num_ctas)) is not None:
        cta = np.empty(n, dtype=np.int64)
        cta[:m] = ar[:m]
        cta[m:] = dealt[0]
        return cta
    shift = num_ctas.bit_length()
    mask = (1 << shift) - 1
    last = cost_sorted.item(n - 1)
    if m == num_ctas and last > max(c0 - cost_sorted.item(m - 1), cost_sorted.item(m) - last):
        # (the first round on CTAs 0 .. C-1, then rounds)
        if scratch is None:
            return _lpt_rounds(cost_sorted << shift, num_ctas, ar, mask)
        rd = scratch.get((n, num_ctas))
        if rd is None:
            if len(scratch) >= 64:   # (a few KB each: serving loops keep to a few batch sizes)
                scratch.clear()
            rd = scratch[n, num_ctas] = _Rounds(n, num_ctas, ar)
        return rd.assign(cost_sorted)
    keys = cost_sorted << shift
    if m > num_ctas:
        cta = ar[:n] % num_ctas
    else:   # (the first m items on CTAs 0 .. m-1: no modulo, ~1.3 us at 256 items)
        cta = np.empty(n, dtype=np.int64)
        cta[:m] = ar[:m]
    if m > num_ctas:   # the run dealt k or k + 1 items to every CTA
        k, r = divmod(m, num_ctas)
        loads = np.full(num_ctas, k * c0, dtype=np.int64)
        loads[:r] += c0
        heap = (loads << shift) | ar[:num_ctas]
        spread = c0 if r else 0
    else:
        heap = keys[:m] | ar[:m]
        spread = c0 - cost_sorted.item(m - 1)
    if last > max(spread, cost_sorted.item(m) - last):
        rows = _lpt_rounds(np.concatenate((heap, keys[m:])), num_ctas, ar, mask, dealt=False)
        cta[m:] = rows[num_ctas:]
    else:
        cta[m:] = small.lpt_deal(heap.tolist(), keys[m:].tolist(), mask)
    return cta


LPT_FEW = 4   # items past LPT's first round that lpt_few deals


def lpt_few(cost_sorted: np.ndarray, num_ctas: int):
    """lpt_assign of up to LPT_FEW items past the first round (a split tile's chunks at C < n: most
    plans of a few long requests), the first round not one run of equal costs (items 0 .. C-1 on
    CTAs 0 .. C-1): each later item onto the least-loaded CTA, lowest id on ties (argmin's first),
    in numpy -- the heap's lists cost ~2x at C = 66. (The CTAs of the items past the first round, a
    tuple of ints; every CTA's load), or None for other items."""
    n = cost_sorted.shape[0]
    if not num_ctas < n <= num_ctas + LPT_FEW or cost_sorted.item(num_ctas) == cost_sorted.item(0):
        return None
    loads = cost_sorted[:num_ctas].copy()
    ctas = []
    for j in range(num_ctas, n):
        i = int(loads.argmin())
        loads[i] += cost_sorted[j]
        ctas.append(i)
    return tuple(ctas), loads


def _lpt_rounds(keys: np.ndarray, C: int, ar: np.ndarray, mask: int, dealt: bool = True) -> np.ndarray:
    """LPT's heap steps when every item past the first C outweighs the spread of the CTA loads
    (all C CTAs loaded). Within a round of C items (descending) the heap then deals them onto the
    CTAs in ascending (load, id) order: a CTA served in the round weighs at least the lightest
    load plus the smallest item, more than any load not yet served. And a round leaves the loads'
    spread within max(their spread, the round's items' spread) (loads ascending + items
    descending), which the caller checked is below the smallest item: the next round qualifies
    too. `keys`: the items' costs << shift, descending, the first C on CTAs 0 .. C-1 (`dealt`)
    or, if not, the first C the CTAs' keys (load << shift | id) before the rest. One in-place
    sort per round; returns the CTA of each key (a new array)."""
    n = keys.shape[0]
    R = -(-n // C)
    rows = np.empty((R, C), dtype=np.int64)   # row r > 0: every CTA's key before round r, ascending
    rows[0] = ar[:C]                              # (row 0: the first round's CTAs)
    if dealt:
        np.bitwise_or(keys[:C], ar[:C], out=rows[1])
    else:
        rows[1] = keys[:C]
    nxt = keys[C:(R - 1) * C].reshape(R - 2, C) if R > 2 else ()
    for r in range(1, R - 1):
        row = rows[r]
        row.sort()
        np.add(row, nxt[r - 1], out=rows[r + 1])   # item r*C + j onto the j-th lightest CTA
    rows[R - 1].sort()
    cta = rows.reshape(-1)[:n]
    cta &= mask
    return cta


class _Rounds:
    """_lpt_rounds' arrays and views for n items on C CTAs, the first C dealt (kept: a view or
    an array costs ~0.1-0.2 us, the rounds a dozen), and lpt_assign's shift and mask for C as 0-d
    arrays (a Python int operand costs a ufunc ~0.25 us more)."""

    __slots__ = ("keys", "ids", "first", "heap", "steps", "last", "cta", "shift", "mask")

    def __init__(self, n: int, C: int, ar: np.ndarray):
        self.shift = np.array(C.bit_length(), dtype=np.int64)
        self.mask = np.array((1 << C.bit_length()) - 1, dtype=np.int64)
        R = -(-n // C)
        self.keys = np.empty(n, dtype=np.int64)
        rows = np.empty((R, C), dtype=np.int64)
        rows[0] = ar[:C]
        self.ids, self.first, self.heap = rows[0].copy(), self.keys[:C], rows[1]
        self.steps = [(rows[r], self.keys[r * C:(r + 1) * C], rows[r + 1]) for r in range(1, R - 1)]
        self.last, self.cta = rows[R - 1], rows.reshape(-1)[:n]

    def assign(self, cost_sorted) -> np.ndarray:
        """_lpt_rounds(cost_sorted << shift, ...) in these arrays: the CTAs (a view of them)."""
        np.left_shift(cost_sorted, self.shift, out=self.keys)
        np.bitwise_or(self.first, self.ids, out=self.heap)
        for row, nxt, out in self.steps:
            row.sort()
            np.add(row, nxt, out=out)   # item r*C + j onto the j-th lightest CTA
        self.last.sort()
        cta = self.cta
        cta &= self.mask
        return cta


ROUNDS_MIN_ITEMS_PER_CTA = 8   # batch-invariant: rounds_assign past this many items per CTA, else LPT


def rounds_assign(cost_sorted: np.ndarray, num_ctas: int, ar: np.ndarray) -> np.ndarray:
    """LPT in rounds, vectorized: the leading run of equal costs round robin (as lpt_assign),
    then each round of num_ctas items (descending) onto the CTAs in ascending load order. Close
    to LPT when items are small next to the loads (within a round LPT could revisit a CTA), a
    few numpy calls per round instead of a heap step per item: for batch-invariant plans with
    many items (hundreds of chunk remainders at large batches)."""
    n = cost_sorted.shape[0]
    run = n if cost_sorted[0] == cost_sorted[n - 1] else int((cost_sorted != cost_sorted[0]).argmax())
    cta = ar[:n] % num_ctas
    k, r = divmod(run, num_ctas)
    loads = np.full(num_ctas, k * cost_sorted.item(0), dtype=np.int64)
    loads[:r] += cost_sorted.item(0)
    for i in range(run, n, num_ctas):
        part = cost_sorted[i:i + num_ctas]
        least = loads.argsort(kind="stable")[:part.shape[0]]
        cta[i:i + part.shape[0]] = least
        loads[least] += part
    return cta


class Planner:
    """Build once per serving configuration; call plan() once per step.

    Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads,
            head_dim, page_size, device="h200", mode="auto", ...)

    `small_tiles`, `small_tokens`: plans of up to this many query tiles and tokens take the
    plain-Python path (rtattn.plan.small, byte-identical); 0 sends every plan the numpy way.
    `tile_table_path`: prefill batches (4+ one-tile requests, or requests of several query tiles)
    take rtattn.plan.tile_table (byte-identical), before the small path; False leaves them to the
    small path or the numpy way.
    `queue_order`: "lpt" (default) or "request" (rtattn.plan.order: a request's items dealt
    together, modes auto and balanced; the numpy path only, so such a planner turns the tile-table
    and small paths off; PlanInfo.queue_order says which order a plan took).
    """

    small_tiles, small_tokens = small.SMALL_TILES, small.SMALL_TOKENS
    tile_table_path = True

    def __init__(self, max_batch: int, max_qo_tokens: int, max_pages: int,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 device="h200", mode: str = "auto", causal: bool = False,
                 tile: TileConfig | None = None, kernel: str = "decode",
                 max_rows: int | None = None, max_qo_len: int | None = None,
                 num_ctas: int | None = None, chunk_tokens: int | None = None,
                 min_chunk_tokens: int = MIN_CHUNK_TOKENS, num_pages_pool: int | None = None,
                 chunk_runs: bool | None = None, queue_order: str = "lpt"):
        self.group = check_config(num_qo_heads, num_kv_heads, head_dim, page_size, num_ctas=num_ctas)
        for name, v in (("max_batch", max_batch), ("max_qo_tokens", max_qo_tokens),
                        ("max_pages", max_pages)):
            check_int(name, v)
        for name, v in (("max_qo_len", max_qo_len), ("num_pages_pool", num_pages_pool),
                        ("chunk_tokens", chunk_tokens)):   # chunk_tokens=None: from the grid
            if v is not None:
                check_int(name, v)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = get_device(device)
        self.page_size = int(page_size)
        self.causal = bool(causal)
        self.mode = mode
        self.queue_order = queue_orders.check_queue_order(queue_order)
        if queue_order != "lpt":   # the fast paths deal LPT only: every plan the numpy way
            self.tile_table_path, self.small_tiles = False, 0
        mql = int(max_qo_len) if max_qo_len else int(max_qo_tokens)
        self.tile = tile or select_tile(self.device, num_qo_heads, num_kv_heads, head_dim, mql, kernel=kernel,
                                        max_rows=max_rows,
                                        invariant=mode == "batch-invariant" and chunk_runs is not False)
        if self.tile.tile_q * self.group > self.tile.max_rows:
            raise ValueError(f"tile_q={self.tile.tile_q} x g={self.group} rows exceed "
                             f"max_rows={self.tile.max_rows}")
        self.num_ctas = int(num_ctas) if num_ctas is not None else num_ctas_for(self.device, self.tile,
                                                                   num_kv_heads)
        # Batch-invariant on the decode kernel: items are runs of whole chunks (its invariant
        # build folds them); chunk_runs=False: one item per fixed chunk (kernels that do not fold).
        if chunk_runs is None:
            chunk_runs = self.tile.kernel == "decode"
        self.chunk_runs = mode == "batch-invariant" and bool(chunk_runs)
        ct = 0
        if self.chunk_runs:   # chunk_tokens=None: auto's smallest split (run_chunk)
            grain = math.lcm(self.page_size, self.tile.tile_kv)
            ct = run_chunk(self.page_size, self.tile.tile_kv, self.group, min_chunk_tokens) if chunk_tokens is None \
                else -(-int(chunk_tokens) // grain) * grain
        elif mode == "batch-invariant":   # chunk_tokens=None: from the grid (invariant_chunk)
            ct = invariant_chunk(self.num_ctas, self.page_size, min_chunk_tokens) if chunk_tokens is None \
                else -(-int(chunk_tokens) // self.page_size) * self.page_size
        self.bounds = F.PlanBounds(int(max_batch), int(max_qo_tokens), int(max_pages),
                                   self.num_ctas, self.tile.tile_q, mode, self.page_size, ct,
                                   mql, self.chunk_runs)
        self.layout = F.PlanLayout(self.bounds)
        self._fold_chunk = ct if self.chunk_runs else 0   # plan_info chunk_tokens: what items fold
        floor = max(self.page_size, int(min_chunk_tokens))
        self.min_chunk = -(-floor // self.page_size) * self.page_size
        self.num_pages_pool = num_pages_pool
        b = self.bounds
        if b.max_kv_tokens >= 2**31:
            raise ValueError(f"max_pages * page_size = {b.max_kv_tokens} does not fit int32")
        # one cached arange serves every "0..n-1" the scheduler needs
        self._ar = np.arange(max(b.max_items, b.max_partial_rows, b.max_tiles, b.max_batch,
                                 b.max_merge_rows) + 1, dtype=np.int64)
        self._views = F.ViewCache(self.layout.views)
        self._tq = self.tile.tile_q
        # An unsplit decode plan's items: request = query row = tile, one token, KV from 0,
        # writethrough; rows 4 (KV end) and 7 (page start) are rewritten by every plan that uses it
        # (the items are taken in queue order before anything else sees them).
        self._decode_items = np.empty((8, b.max_batch), dtype=np.int32)
        self._decode_items[0:2] = self._ar[:b.max_batch]
        self._decode_items[2], self._decode_items[3], self._decode_items[5:7] = 1, 0, -1
        self._decode_qo = np.arange(b.max_batch + 1, dtype=np.int32)   # a decode batch's qo_indptr (sliced)
        self._tiles = None   # rtattn.plan.tile_table's table (tile_table.Tiles), made on first use
        self._small_layouts = {}   # rtattn.plan.small's layouts of balanced plans (small.Layout)

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
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, out=None,
             window_left: int | None = None) -> PlanInfo:
        """`window_left`: the sliding window (query at q_pos sees KV >= q_pos - window_left);
        None: no window, every tile reads from KV 0."""
        if window_left is not None:
            window_left = check_window(window_left)
        # (the fast paths' quick checks decide which batches they take: None for the rest;
        # tile_table.plan's checks start from these). A decode batch (qo_indptr None) is the
        # one-tile batch of one query token per request, qo_indptr 0, 1, .., B: the same plan bytes
        # (tests/test_tile_table_plan.py), which rtattn.plan.uniform lays out in ~half the numpy
        # path's time from batch 4 on (docs/perf-log.md "Session 16").
        if (self.tile_table_path and type(kv_indptr) is np.ndarray and kv_indptr.ndim == 1
                and kv_indptr.shape[0] > 1
                and (info := tile_table.plan(self, self._decode_qo[:kv_indptr.shape[0]] if qo_indptr is None
                                             else qo_indptr, kv_indptr, kv_indices, kv_last_page_len, window_left,
                                             out)) is not None):
            return info
        info = small.plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, window_left, out)
        if info is not None:
            return info
        b = self.bounds
        batch = validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                               self.page_size, num_pages=self.num_pages_pool,
                               causal=self.causal, max_batch=b.max_batch,
                               max_qo_tokens=b.max_qo_tokens, max_pages=b.max_pages,
                               max_qo_len=b.max_qo_len)
        return self.plan_batch(batch, *self._buffer(out), window_left)

    def plan_batch(self, batch: Batch, buf, views, window_left: int | None = None) -> PlanInfo:
        """Plan a validated batch into `buf` (its field views `views`): the numpy path's schedule
        and writers (the cascade's flat plan lays the decode part of its plan set out this way)."""
        items = self._schedule(batch, window_left)
        self._write(views, batch, items)
        return self._info(items, batch.batch, batch.qo_indptr.item(-1), buf, views)

    def _info(self, items: dict, B: int, num_qo: int, buf, views) -> PlanInfo:
        return PlanInfo(items["n"], items["merge_rows"], items["partial_rows"], B,
                        num_qo, self.num_ctas, self._tq, self.page_size,
                        items["L"], items["split_tiles"], items["loads"],
                        buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8),
                        views, items["mode"], items.get("queue_order", "lpt"))   # (fast paths, contiguous: LPT's)

    def _buffer(self, out):
        """(buffer, its field views): `out`, or a new buffer when None."""
        if out is None:
            buf = self.layout.allocate()
            return buf, self.layout.views(buf)
        return out, self._views.get(out)

    def _schedule(self, bt: Batch, window_left: int | None = None, partials: bool = True) -> dict:
        """Tiles -> chunks -> items, LPT assignment, partial rows, merge map (`partials`
        False: neither, only the count of split tiles -- the cascade folds states itself).
        Plain numpy on small arrays: every call here is ~0.3-1 us, so the code
        keeps the call count low (one 2-D item array, fast paths for pure decode
        and for unsplit plans) and prefers the cheap forms: array methods
        (.repeat, .argsort, .take) over their np.* wrappers, argmax over max."""
        tq, C, mode, B = self._tq, self.num_ctas, self.mode, bt.batch
        qo_len, kv_len, qo_indptr = bt.qo_len, bt.kv_len, bt.qo_indptr
        decode = qo_indptr.item(-1) == B and (B == 0 or bt.qo_max == 1)
        if decode or (bt.qo_max <= tq and qo_len.item(qo_len.argmin()) >= 1):
            # every request is one tile, its own (decode: a 1-token tile, so qo_indptr is 0, 1, ...,
            # B; causal: the tile's last row's horizon is its request's KV)
            t_req, t_off = self._ar[:B], 0
            t_qlen, t_qs, t_kv = qo_len, qo_indptr[:B], kv_len
        else:
            t_req, tj = _repeat_index(np.floor_divide(qo_len + (tq - 1), tq), self._ar)
            t_off = tj * tq
            t_qlen = np.minimum(qo_len[t_req] - t_off, tq)
            t_qs = qo_indptr[t_req] + t_off
            t_kv = kv_len[t_req]
            if self.causal:   # clip to the horizon of the tile's last row
                t_kv = t_kv - qo_len[t_req] + t_off + t_qlen
        # Window: the tile's first row (query position q0) sees nothing below q0 - window_left.
        # Tiles then span [t_k0, t_kv): chunks are laid out on the span's length and shifted.
        t_k0 = None
        if window_left is not None:
            q0 = (kv_len - 1 if decode else kv_len[t_req] - qo_len[t_req] + t_off).astype(np.int64)
            t_k0 = np.maximum(q0 - window_left, 0)
            t_k0 -= t_k0 % self.page_size   # (chunks are laid out from here: the request's own)
            t_k0 = np.minimum(t_k0, t_kv).astype(np.int32)   # (an empty tile stays empty)
            t_kv = t_kv - t_k0
        T = t_req.shape[0]
        # Chunk bound L (tokens, page multiple) and chunks per tile.
        if mode == "naive" or T == 0:
            L, maxc = 0, 1
        else:
            if mode == "batch-invariant" and not self.chunk_runs:
                L = self.bounds.chunk_tokens
            else:   # chunk runs: segments of whole chunks (their bits do not depend on L)
                kv_total = int(_ADD(t_kv, dtype=np.int64))
                L = max(-(-kv_total // C), self.min_chunk)
                grain = self.bounds.chunk_tokens if self.chunk_runs else self.page_size
                L = -(-L // grain) * grain
            # A tile's last chunk takes up to L + L/8 tokens: a tail of at most L/8 joins the chunk
            # before it (one item, partial row and merge input less). ceil((kv - L/8) / L) chunks.
            # Fixed batch-invariant chunks stay at their fixed positions.
            tail = 0 if mode == "batch-invariant" and not self.chunk_runs else L // TAIL_FRACTION
            nchunk = np.floor_divide(t_kv + (L - 1 - tail), L)
            if nchunk.item(nchunk.argmin()) < 1:   # empty or short KV: still one chunk
                np.maximum(nchunk, 1, out=nchunk)
            maxc = nchunk.item(nchunk.argmax())
        if mode == "contiguous" and T > 0:
            return _shift(self._contiguous(decode, t_req, t_qs, t_qlen, t_kv, partials), t_k0)
        like_auto = mode == "auto" or self.chunk_runs   # chunk runs choose their cuts as auto does
        # Items: rows request, qo_start, qo_len, kv_start, kv_end, partial, merge, and
        # kv_page_start (filled by _write).
        cost = con = ends = None
        taken = "lpt"   # the queue order the assignment takes (queue_order, or LPT's)
        if mode == "auto" and maxc > 1:
            ends = _ACC(nchunk, dtype=np.int64)
            # (n <= C or over max_items: the balanced layout decides, or refuses; past 2 items per
            # CTA the mean is rarely below the largest chunk: not worth the pass over the tiles)
            if C < ends.item(-1) <= min(2 * C, self.bounds.max_items):
                con, chosen = self._auto_contiguous_first(decode, t_req, t_qs, t_qlen, t_kv, nchunk, L, kv_total,
                                                          ends.item(-1), partials)
                if chosen:
                    return _shift(con, t_k0)
        if maxc == 1:
            n = T
            if decode and t_k0 is None and n <= self._decode_items.shape[1]:   # (a cascade plans more tiles)
                # rows but the KV end (and page start) are the same every step
                it = self._decode_items[:, :n]
                it[4] = t_kv
                cost = np.add(t_kv, COST_ALPHA + COST_GAMMA, dtype=np.int64)
            else:
                it = np.empty((8, n), dtype=np.int32)
                it[0], it[1], it[2], it[3], it[4], it[5:7] = t_req, t_qs, t_qlen, 0, t_kv, -1
            i_tile = i_chunk = None
        else:
            if ends is None:   # (auto's early choice has them)
                ends = _ACC(nchunk, dtype=np.int64)
            n = ends.item(-1)
            if n > self.bounds.max_items:
                raise ValueError(f"plan needs {n} work items, exceeding max_items="
                                 f"{self.bounds.max_items} (mode={mode})")
            i_tile, i_chunk = _repeat_index(nchunk, self._ar, ends)
            it = np.empty((8, n), dtype=np.int32)
            if decode:   # request == query row == tile, one row each
                it[0:2] = i_tile
                it[2] = 1
            else:
                it[0] = t_req[i_tile]
                it[1] = t_qs[i_tile]
                it[2] = t_qlen[i_tile]
            np.multiply(i_chunk, L, out=it[3])
            np.add(it[3], L, out=it[4])
            it[4][ends - 1] = t_kv   # a tile's last chunk ends at its end
        if cost is None:   # (the unsplit decode items have theirs)
            cost = np.subtract(it[4], it[3], dtype=np.int64)
            if decode:
                cost += COST_ALPHA + COST_GAMMA
            else:
                cost += COST_ALPHA * it[2] + COST_GAMMA
        # Assignment: naive = round robin in item order; else LPT.
        if mode == "naive":
            order, cs = None, cost
        else:
            order = (-cost).argsort(kind="stable")
            cs = cost[order]
        if n <= C:   # one item per CTA at most: queue order is the sorted order
            final = self._ar[:n] if order is None else order
            counts = np.zeros(C, dtype=np.int64)
            counts[:n] = 1
            loads = np.zeros(C, dtype=np.int64)
            loads[:n] = cs
        else:
            # LPT over Algorithm 1's chunks leaves one CTA a chunk above the mean when chunks
            # barely outnumber CTAs (n <= C: one chunk <= L per CTA, nothing to gain). Past
            # AUTO_IMBALANCE the contiguous partition (every CTA within a page of the mean,
            # more split rows) was faster on the H200 (docs/perf-log.md): mode "auto" takes
            # it if it is lighter. Decided on the loads alone, before this plan's queues and
            # partial rows are laid out.
            if like_auto:
                # the loads sum to every KV token once plus each item's fixed cost
                total = (kv_total + (COST_ALPHA + COST_GAMMA) * n) if decode else int(_ADD(cost))
                # LPT's heaviest CTA carries at least the largest item, the mean, and the
                # C-th and (C+1)-th largest items together (item C joins a CTA holding only
                # one item of cost cs[C-1]). When that bound already decides, skip LPT.
                bound = max(cs.item(0), cs.item(C - 1) + cs.item(C), -(-total // C))
                if bound * C > AUTO_IMBALANCE * total:
                    if con is None:
                        con = self._contiguous(decode, t_req, t_qs, t_qlen, t_kv, partials)
                    if _top(con["loads"]) < bound:
                        return _shift(con, t_k0)
            if mode == "naive" or cs.item(0) == cs.item(n - 1):   # round robin (== LPT if all equal)
                cta = self._ar[:n] % C
            elif mode == "batch-invariant" and not self.chunk_runs and n > ROUNDS_MIN_ITEMS_PER_CTA * C:
                cta = rounds_assign(cs, C, self._ar)   # the assignment never changes its numerics
            else:
                cta = lpt_assign(cs, C, self._ar)
            # float64 sums of int costs: exact (< 2**53)
            loads = np.bincount(cta, weights=cs, minlength=C).astype(np.int64)
            if like_auto:
                top = _top(loads)
                if top * C > AUTO_IMBALANCE * total:
                    if con is None:
                        con = self._contiguous(decode, t_req, t_qs, t_qlen, t_kv, partials)
                    if _top(con["loads"]) < top:
                        return _shift(con, t_k0)
            if self.queue_order != "lpt" and order is not None and mode in ("auto", "balanced"):
                # (auto's partition is decided above on LPT's loads; only the queues change)
                r_order, r_cta, r_loads = queue_orders.request_rounds(it[0], cost, C, self._ar)
                keep = queue_orders.within_slack(r_loads, _top(loads))
                if keep:
                    order, cta, loads = r_order, r_cta, r_loads
                    taken = self.queue_order
            q = cta.argsort(kind="stable")     # queue order: (cta, assignment order)
            final = q if order is None else order[q]
            counts = np.bincount(cta, minlength=C)
        res = dict(n=n, L=int(L), loads=loads, counts=counts, items=it, final=final,
                   merge_rows=0, partial_rows=0, split_tiles=0,
                   mode="balanced" if mode == "auto" else mode, queue_order=taken)
        if maxc > 1:
            self._partials(res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode, partials, t_kv)
            res["i_tile"] = i_tile
        return _shift(res, t_k0)

    def _auto_contiguous_first(self, decode, t_req, t_qs, t_qlen, t_kv, nchunk, L, kv_total, n, partials):
        """Auto's choice of the contiguous partition from a part of its bound, before the
        balanced items are laid out (some tile split): the largest chunk (L, or a tile's last of
        up to L + L/8, plus its tile's fixed cost) and the mean are both known from the chunk
        counts. If they already put the bound over AUTO_IMBALANCE and the contiguous loads under
        them, the full bound (>= them) decides the same way: (the contiguous plan, True). Else
        (the contiguous plan it made, or None; False): the full decision reuses it."""
        C = self.num_ctas
        if decode:   # one query token per tile: the same fixed cost everywhere
            fixed = lo = hi = COST_ALPHA + COST_GAMMA
            total = kv_total + fixed * n
        else:
            fixed = t_qlen * COST_ALPHA
            fixed += COST_GAMMA
            lo, hi = fixed.item(fixed.argmin()), fixed.item(fixed.argmax())
            total = kv_total + int(nchunk @ fixed)   # (every chunk pays its tile's)
        mean = -(-total // C)
        # No chunk exceeds L + L/8: if that does not decide, nothing here does (ints only).
        if max(L + L // TAIL_FRACTION + hi, mean) * C <= AUTO_IMBALANCE * total:
            return None, False
        last = t_kv - nchunk * L   # (each tile's last chunk, less L)
        if not decode:
            last += fixed          # (... plus its tile's fixed cost)
        # (some tile has a full chunk of L; every tile a last one)
        b0 = max(L + lo, L + last.item(last.argmax()) + (hi if decode else 0), mean)
        if b0 * C <= AUTO_IMBALANCE * total:
            return None, False
        con = self._contiguous(decode, t_req, t_qs, t_qlen, t_kv, partials, fixed)
        return con, _top(con["loads"]) < b0

    def _contiguous(self, decode, t_req, t_qs, t_qlen, t_kv, partials: bool = True, fixed=None) -> dict:
        """Contiguous cost partition: lay the tiles end to end on one cost axis (each tile's
        fixed cost, then its KV tokens) and give CTA c the slice [c*w, (c+1)*w), w = total/C,
        cutting tiles at page boundaries. Every CTA's load is within a page (plus one item's
        fixed cost) of the mean -- LPT over Algorithm 1's chunks is only within one chunk,
        which at ~1 chunk per CTA doubles the slowest CTA. Cuts never exceed C - 1, so the
        balanced bounds hold: items <= T + C - 1, split tiles <= C - 1. `fixed`: each tile's
        fixed cost, when the caller has it (prefill tiles)."""
        C, ps, T = self.num_ctas, self.page_size, t_req.shape[0]
        if decode:   # one query row per tile: the same fixed cost everywhere
            fixed = COST_ALPHA + COST_GAMMA
        elif fixed is None:
            fixed = t_qlen * COST_ALPHA
            fixed += COST_GAMMA
        # (COST_BETA = 1; the cost axis in int64: a cascade's pseudo-batch has int32 lengths)
        length = (t_kv if t_kv.dtype == np.int64 else t_kv.astype(np.int64)) + fixed
        ends = _ACC(length)
        total = ends.item(-1)
        w = max(-(-total // C), self.min_chunk * COST_BETA)
        # C * w >= total > ends - 1 >= start: every CTA index below is already < C.
        base = ends - t_kv        # each tile's KV token 0 on the axis
        c1 = (ends - 1) // w      # the CTA of each tile's last piece
        if self.chunk_runs:       # cuts on chunk boundaries, coarser than w: any piece may come out empty
            c0 = (base - fixed) // w
            grain = self.bounds.chunk_tokens
        else:
            # Only a tile's leading pieces can come out empty (their cuts round down to token 0;
            # later cuts are w >= a page apart): start at the CTA whose slice ends past the tile's
            # first page, its piece at token 0. A tile shorter than a page is its last piece alone;
            # an empty tile keeps its first, [0, 0).
            c0, grain = (base + (ps - 1)) // w, ps
            if t_kv.item(t_kv.argmin()) < ps:
                np.minimum(c0, c1, out=c0)
                empty = t_kv == 0
                if empty.any():
                    c0[empty] = c1[empty] = ((base - fixed) // w)[empty]
        pieces = c1 - c0 + 1
        pend = _ACC(pieces)
        i_tile, k = _repeat_index(pieces, self._ar, pend)
        cta = c0[i_tile] + k
        # Cost offset -> token offset (COST_BETA = 1) of CTA cta's slice in the tile. The
        # first piece (k = 0: c0 * w < start + a page) lands before the tile's KV or in its first
        # page, so clipping at 0 and rounding start it at token 0; later pieces start at
        # cta * w <= ends - 1, i.e. below the tile's kv: no clipping at kv is needed.
        cut = cta * w - base[i_tile]
        np.maximum(cut, 0, out=cut)
        if grain > 1:   # round down to a page (chunk) boundary
            if grain & (grain - 1):
                cut -= cut % grain
            else:        # a power of two, and cut >= 0: a mask does it
                cut &= -grain
        # kv_end[i] = nxt[i + 1]: the next piece's cut, or the tile's kv for its last piece
        nxt = np.empty(cut.shape[0] + 1, dtype=np.int64)
        nxt[1:-1] = cut[1:]
        nxt[pend] = t_kv
        kv_end = nxt[1:]
        n, nchunk, i_chunk = i_tile.shape[0], pieces, k
        if self.chunk_runs:
            keep = kv_end > cut
            if t_kv.item(t_kv.argmin()) == 0:   # empty KV: its first piece is its one item
                keep[(pend - pieces)[t_kv == 0]] = True
            if not keep.item(keep.argmin()):    # drop the empty pieces
                i_tile, cut, kv_end, cta = i_tile[keep], cut[keep], kv_end[keep], cta[keep]
                n = i_tile.shape[0]
                nchunk = np.bincount(i_tile, minlength=T)
                i_chunk = self._ar[:n] - (_ACC(nchunk) - nchunk)[i_tile]
        if n > self.bounds.max_items:
            raise ValueError(f"plan needs {n} work items, exceeding max_items={self.bounds.max_items}")
        it = np.empty((8, n), dtype=np.int32)
        if decode:
            it[0:2] = i_tile
            it[2] = 1
        else:
            it[0], it[1], it[2] = t_req[i_tile], t_qs[i_tile], t_qlen[i_tile]
        it[3], it[4], it[5:7] = cut, kv_end, -1
        cost = kv_end - cut   # (COST_BETA = 1, as in the cuts)
        cost += fixed if decode else fixed[i_tile]
        res = dict(n=n, L=int(w), loads=np.bincount(cta, weights=cost, minlength=C).astype(np.int64),
                   counts=np.bincount(cta, minlength=C), items=it, final=None,
                   merge_rows=0, partial_rows=0, split_tiles=0,
                   mode="batch-invariant" if self.chunk_runs else "contiguous")
        if nchunk.item(nchunk.argmax()) > 1:
            self._partials(res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode, partials, t_kv)
        res["i_tile"] = i_tile
        return res

    def _partials(self, res, it, nchunk, t_qlen, t_qs, i_tile, i_chunk, decode, rows: bool = True,
                  t_kv=None):
        """Partial rows: split tile t owns rows pbase[t] .. + n_t * qo_t, state j
        writes pbase[t] + j * qo_t + r for its row r.  Merge entry (t, r) lists
        those n_t rows in state (= ascending KV) order; a split tile's entries are
        consecutive from its item_merge. `rows` False: only the count of split tiles.
        A state is an item's (nchunk items per tile), or with chunk runs a chunk's: tile t
        has ceil(t_kv / C) states and an item's first is its first chunk (items start on
        chunk boundaries of the tile's span; it[3] is still span-relative here)."""
        split = nchunk >= 2
        st = split.nonzero()[0]
        if not rows:
            res["split_tiles"] = int(st.shape[0])
            return
        if self.chunk_runs:
            ct = self.bounds.chunk_tokens
            nchunk = np.maximum(-(-t_kv.astype(np.int64) // ct), 1)
            i_chunk = it[3].astype(np.int64) // ct
        T = split.shape[0]
        if decode:
            # One row per tile: the merge entries are the split tiles (query row = tile),
            # and tile t's partial rows are its chunks, so pbase = merge_indptr[:-1].
            M = st.shape[0]
            cnt = nchunk[st]
            m_indptr = np.zeros(M + 1, dtype=np.int64)
            _ACC(cnt, out=m_indptr[1:])
            P = m_indptr.item(M)
            self._check_partial(P)
            self._check_merge(M)
            _item_partials(it, T, st, m_indptr[:M], self._ar[:M], i_tile, i_chunk)
            res.update(m_indptr=m_indptr, m_row=st, m_start=m_indptr[:M], m_stride=1,
                       merge_rows=M, partial_rows=P, split_tiles=M)
            return
        rows_t = nchunk * t_qlen * split
        pend = _ACC(rows_t)
        P = pend.item(-1)
        self._check_partial(P)
        qst = t_qlen[st]
        e_end = _ACC(qst, dtype=np.int64)   # each split tile's merge entries end here
        M = e_end.item(-1) if e_end.shape[0] else 0
        self._check_merge(M)
        pb_st = (pend - rows_t)[st]
        _item_partials(it, T, st, pb_st, e_end - qst, i_tile, i_chunk * it[2])
        e_tile_i, e_r = _repeat_index(qst, self._ar, e_end)
        e_tile = st[e_tile_i]
        cnt = nchunk[e_tile]
        m_row = t_qs[e_tile] + e_r
        m_start, m_stride = pb_st[e_tile_i] + e_r, qst[e_tile_i]
        m_indptr = np.zeros(M + 1, dtype=np.int64)
        _ACC(cnt, out=m_indptr[1:])
        res.update(m_indptr=m_indptr, m_row=m_row, m_start=m_start, m_stride=m_stride,
                   merge_rows=M, partial_rows=P, split_tiles=int(st.shape[0]))

    def _check_partial(self, P):
        if P > self.bounds.max_partial_rows:
            raise ValueError(f"plan needs {P} partial rows, exceeding "
                             f"max_partial_rows={self.bounds.max_partial_rows}")

    def _check_merge(self, M):
        if M > self.bounds.max_merge_rows:
            raise ValueError(f"plan needs {M} merge rows, exceeding "
                             f"max_merge_rows={self.bounds.max_merge_rows}")

    def _write(self, v: dict, batch: Batch, it: dict) -> None:
        B, n, C = batch.batch, it["n"], self.num_ctas
        F.write_requests(v, B, batch.qo_indptr, batch.qo_len, batch.kv_indptr, batch.kv_len,
                         batch.kv_indptr.item(-1), batch.kv_indices)
        wi = v["work_indptr"]
        wi[0] = 0
        wi[1:C + 1] = _ACC(it["counts"])   # (an int64 accumulate cast on the fly into wi is slower)
        items, final = it["items"], it["final"]
        items[7] = batch.kv_indptr.take(items[0])   # item_kv_page_start (take: int32 indices)
        v["_items"][:, :n] = items if final is None else items.take(final, axis=1)
        F.write_merge_and_info(v, it, (n, it["merge_rows"], it["partial_rows"], B, self._tq, self.page_size, C,
                                       batch.qo_indptr.item(-1), self._fold_chunk))
