"""The one declaration of the plan arrays, and everything generated from it.

`PLAN_FIELDS` lists (name, dtype, capacity) once.  From it come the byte offsets
of every array in one buffer (256-byte aligned), numpy views into a host (pinned)
buffer, the C struct the kernels include, the packed struct of device pointers,
and the workspace size (plan region + partial O/LSE storage).  Nothing else in
the code base spells an offset, so the Python and CUDA sides cannot drift.

Capacities are functions of `PlanBounds`, given once when a planner is built:
the buffer layout is then fixed for the planner's lifetime (CUDA graphs capture
the pointers once; the contents change every step).
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np

ALIGN = 256  # every array starts on a 256-byte boundary (coalesced loads, TMA-friendly)

# Indices into the `plan_info` header (int32[PLAN_INFO_LEN]).
INFO_NUM_ITEMS = 0
INFO_NUM_MERGE_ROWS = 1
INFO_NUM_PARTIAL_ROWS = 2
INFO_BATCH = 3
INFO_TILE_Q = 4
INFO_PAGE_SIZE = 5
INFO_NUM_CTAS = 6
INFO_NUM_QO_TOKENS = 7
INFO_CHUNK_TOKENS = 8   # chunk runs' C: an item folds its KV chunk by chunk (0: an item is one state)
PLAN_INFO_LEN = 9
PLAN_INFO_NAMES = ("num_items", "num_merge_rows", "num_partial_rows", "batch",
                   "tile_q", "page_size", "num_ctas", "num_qo_tokens", "chunk_tokens")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MODES = ("auto", "balanced", "contiguous", "naive", "batch-invariant")


@dataclass(frozen=True)
class PlanBounds:
    """Upper bounds fixed at construction; every capacity derives from these.

    Derived bounds (proofs).  L is a plan's KV chunk length, T the number of
    (request, query tile) pairs, kv_t the KV tokens tile t attends (its
    request's KV, clipped to the causal horizon), n_t = max(1, ceil(kv_t / L)).

    * max_tiles: sum_b ceil(qo_b / tile_q) <= floor(sum_b qo_b / tile_q) + batch
      (ceil(x/t) <= floor(x/t) + 1), and <= total query tokens (a tile has >= 1
      token).  So T <= min(max_qo_tokens, max_qo_tokens // tile_q + max_batch).
    * balanced, max_items: L >= sum_t kv_t / num_ctas (the floor and the page
      rounding only raise L), so sum_t n_t <= sum_t (kv_t / L + 1)
      <= num_ctas + T.
    * balanced, max_partial_rows: only split tiles (n_t >= 2, i.e. kv_t > L)
      write partial rows; for them n_t < kv_t / L + 1 < 2 kv_t / L, hence
      sum_split n_t < 2 num_ctas (the "<= 2 #CTA split tiles" argument), and
      each chunk writes <= tile_q rows: partial rows < 2 * num_ctas * tile_q.
    * balanced, max_merge_rows: #split tiles < sum_t kv_t / L <= num_ctas, so
      merge rows <= min(num_ctas * tile_q, max_qo_tokens).
    * batch-invariant (fixed chunk C = chunk_tokens, page aligned): with
      K = max_pages * page_size >= sum_b kv_b, a tile has <= k = ceil(K / C)
      chunks: items <= T * k; also sum_t n_t <= sum_t (kv_t / C + 1)
      <= T + ceil(max_qo_len / tile_q) * K / C (a request has at most that many
      tiles, each attending <= kv_b).  max_items is the smaller.  Split tiles have n_t < 2 kv_t / C, so partial
      rows <= sum_b qo_b * 2 kv_b / C <= 2 * max_qo_len * K / C, and also
      <= max_qo_tokens * k.  Merge rows <= max_qo_tokens.
    * batch-invariant with chunk runs (`chunk_runs`, the decode kernel: an item is a run of
      whole chunks, folded in the kernel): items are balanced's (segments of L >= the
      balanced bound, rounded up to a multiple of C, or contiguous cuts on chunk
      boundaries), so are merge rows. A split tile writes one partial row per chunk per
      query token: chunks of split tiles <= sum_split kv_t / C + #split, sum_t kv_t <=
      ceil(max_qo_len / tile_q) K, #split <= num_ctas: partial rows <= tile_q *
      (ceil(max_qo_len / tile_q) K / C + num_ctas), and <= max_qo_tokens * k.
    * naive: one item per tile, no partials, no merges.
    """

    max_batch: int
    max_qo_tokens: int
    max_pages: int
    num_ctas: int
    tile_q: int
    mode: str = "auto"
    page_size: int = 1
    chunk_tokens: int = 0   # batch-invariant chunk C (multiple of page_size)
    max_qo_len: int = 0     # per-request query-length bound (0 = max_qo_tokens)
    chunk_runs: bool = False  # batch-invariant items are runs of chunks (decode kernel)

    def __post_init__(self):
        for name in ("max_batch", "max_qo_tokens", "max_pages", "num_ctas", "tile_q",
                     "page_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"PlanBounds.{name} must be a positive int, got {v!r}")
        if self.mode not in MODES:
            raise ValueError(f"PlanBounds.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "batch-invariant":
            c = self.chunk_tokens
            if c < 1 or c % self.page_size:
                raise ValueError(f"PlanBounds.chunk_tokens={c} must be a positive multiple "
                                 f"of page_size={self.page_size}")
        if self.max_qo_len == 0:
            object.__setattr__(self, "max_qo_len", self.max_qo_tokens)
        if not 1 <= self.max_qo_len <= self.max_qo_tokens:
            raise ValueError(f"PlanBounds.max_qo_len={self.max_qo_len} must be in "
                             f"[1, max_qo_tokens={self.max_qo_tokens}]")

    @functools.cached_property
    def max_kv_tokens(self) -> int:
        return self.max_pages * self.page_size

    @functools.cached_property
    def max_tiles(self) -> int:
        return min(self.max_qo_tokens, self.max_qo_tokens // self.tile_q + self.max_batch)

    @functools.cached_property
    def _fixed_chunks(self) -> bool:
        """One item per fixed chunk (batch-invariant without chunk runs)."""
        return self.mode == "batch-invariant" and not self.chunk_runs

    @functools.cached_property
    def max_chunks_per_tile(self) -> int:
        if self.mode == "batch-invariant":
            return _cdiv(self.max_kv_tokens, self.chunk_tokens)
        return 1 if self.mode == "naive" else self.num_ctas + 1

    @functools.cached_property
    def max_items(self) -> int:
        if self._fixed_chunks:
            per_req_tiles = _cdiv(self.max_qo_len, self.tile_q)
            return min(self.max_tiles * self.max_chunks_per_tile,
                       self.max_tiles + _cdiv(per_req_tiles * self.max_kv_tokens,
                                              self.chunk_tokens))
        if self.mode == "naive":
            return self.max_tiles
        return self.num_ctas + self.max_tiles

    @functools.cached_property
    def max_partial_rows(self) -> int:
        if self.mode == "batch-invariant":
            k = self.max_chunks_per_tile
            if k < 2:
                return 0
            if self.chunk_runs:
                per_req_tiles = _cdiv(self.max_qo_len, self.tile_q)
                return min(self.max_qo_tokens * k,
                           self.tile_q * (_cdiv(per_req_tiles * self.max_kv_tokens, self.chunk_tokens)
                                          + self.num_ctas))
            return min(self.max_qo_tokens * k,
                       _cdiv(2 * self.max_qo_len * self.max_kv_tokens, self.chunk_tokens))
        if self.mode == "naive":
            return 0
        return 2 * self.num_ctas * self.tile_q

    @functools.cached_property
    def max_merge_rows(self) -> int:
        if self._fixed_chunks:
            return self.max_qo_tokens if self.max_chunks_per_tile > 1 else 0
        if self.mode == "naive":
            return 0
        return min(self.num_ctas * self.tile_q, self.max_qo_tokens)


@dataclass(frozen=True)
class PlanField:
    name: str
    dtype: np.dtype
    capacity: Callable[[PlanBounds], int]
    formula: str  # the capacity formula as text (printed by rtattn-inspect, docs)
    doc: str


def _f(name, cap, formula, doc):
    return PlanField(name, np.dtype(np.int32), cap, formula, doc)


# THE declaration.  Order is the C struct's member order and the buffer order.
PLAN_FIELDS: tuple[PlanField, ...] = (
    _f("req_qo_start", lambda b: b.max_batch, "max_batch",
       "first global query row of request b"),
    _f("req_qo_len", lambda b: b.max_batch, "max_batch",
       "query tokens of request b"),
    _f("req_kv_page_start", lambda b: b.max_batch, "max_batch",
       "kv_indptr[b]: first entry of request b in kv_indices"),
    _f("req_kv_len", lambda b: b.max_batch, "max_batch",
       "KV tokens of request b = (pages-1)*page_size + last_page_len, 0 if no pages"),
    _f("kv_indices", lambda b: b.max_pages, "max_pages",
       "page ids (copy of the caller's kv_indices)"),
    _f("work_indptr", lambda b: b.num_ctas + 1, "num_ctas + 1",
       "CTA c processes items [work_indptr[c], work_indptr[c+1])"),
    _f("item_request", lambda b: b.max_items, "max_items",
       "request of the work item"),
    _f("item_qo_start", lambda b: b.max_items, "max_items",
       "first GLOBAL query row of the item's tile"),
    _f("item_qo_len", lambda b: b.max_items, "max_items",
       "query tokens in the tile (<= tile_q)"),
    _f("item_kv_start", lambda b: b.max_items, "max_items",
       "first KV token (within the request) of the chunk, page aligned"),
    _f("item_kv_end", lambda b: b.max_items, "max_items",
       "one past the last KV token of the chunk (== start only for empty KV)"),
    _f("item_partial", lambda b: b.max_items, "max_items",
       "-1: writethrough final O/LSE; else first partial row p (rows p..p+qo_len-1)"),
    _f("item_merge", lambda b: b.max_items, "max_items",
       "-1: writethrough; else the first merge entry of the item's tile (its rows' entries are "
       "consecutive): the kernel's CTA that writes the tile's last partial merges them"),
    _f("item_kv_page_start", lambda b: b.max_items, "max_items",
       "req_kv_page_start of the item's request (the KV loader reads no request field)"),
    _f("merge_indptr", lambda b: b.max_merge_rows + 1, "max_merge_rows + 1",
       "merge entry r folds n_r = merge_indptr[r+1] - merge_indptr[r] partial rows"),
    _f("merge_qo_row", lambda b: b.max_merge_rows, "max_merge_rows",
       "global query row written by merge entry r"),
    _f("merge_partial_start", lambda b: b.max_merge_rows, "max_merge_rows",
       "entry r's j-th partial row is start[r] + j * stride[r], j < n_r: ascending KV order"),
    _f("merge_partial_stride", lambda b: b.max_merge_rows, "max_merge_rows",
       "(1 for decode; the tile's query length when a tile holds several rows)"),
    _f("plan_info", lambda b: PLAN_INFO_LEN, str(PLAN_INFO_LEN),
       "header: " + ", ".join(PLAN_INFO_NAMES)),
)

FIELD_NAMES = tuple(f.name for f in PLAN_FIELDS)


class ViewCache:
    """The views of the last few buffers a planner wrote into (callers reuse a few pinned
    buffers): plan() looks them up instead of slicing every field again."""

    def __init__(self, make: Callable, size: int = 4):
        self._make, self._size, self._hits = make, size, {}

    def get(self, buf):
        hit = self._hits.get(id(buf))
        if hit is not None and hit[0] is buf:
            return hit[1]
        views = self._make(buf)
        if len(self._hits) >= self._size:
            self._hits.clear()
        self._hits[id(buf)] = (buf, views)
        return views


def align_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


class PlanLayout:
    """Byte layout of the plan (and of the device workspace) for fixed bounds.

    Workspace = [plan region | partial_o f32[max_partial_rows, H_qo, D] |
    partial_lse f32[max_partial_rows, H_qo, 2] | merge_counters i32[max_merge_rows, H_qo]],
    each part 256-byte aligned. An auto partial row's LSE takes one float of its pair, a
    batch-invariant row's unnormalized (m, l) both (cuda_src/state_fold.cuh). The counters
    (arrivals per split tile's first merge entry and KV head) are zero between kernels: zeroed once, reset by the CTA that merges.  The
    host pinned buffer holds only the plan region; one H2D copy of `plan_bytes`
    moves it to the workspace base.

    `borrowed`: fields this plan reads from another plan of a plan set (a cascade's prefill
    part reads the union's requests and page ids): capacity 0 here, the kernel's pointer
    names the other plan's array.
    """

    def __init__(self, bounds: PlanBounds, borrowed: tuple[str, ...] = ()):
        unknown = set(borrowed) - set(FIELD_NAMES)
        if unknown:
            raise ValueError(f"borrowed fields {sorted(unknown)} are not plan fields")
        self.bounds, self.borrowed = bounds, tuple(borrowed)
        self.capacity: dict[str, int] = {}
        self.offsets: dict[str, int] = {}
        off = 0
        for f in PLAN_FIELDS:
            cap = 0 if f.name in self.borrowed else int(f.capacity(bounds))
            self.capacity[f.name] = cap
            self.offsets[f.name] = off
            off = align_up(off + max(cap, 1) * f.dtype.itemsize)
        self.plan_bytes = off

    # -- host views -----------------------------------------------------------
    def allocate(self) -> np.ndarray:
        """A zeroed host buffer of plan_bytes (tests / CPU-only use; the runtime
        passes a pinned buffer instead)."""
        return np.zeros(self.plan_bytes, dtype=np.uint8)

    def views(self, buf) -> dict[str, np.ndarray]:
        """numpy views, one per field, into `buf` (anything exposing a writable
        buffer of >= plan_bytes bytes: numpy uint8 array, memoryview of pinned
        memory, ...).  Views share memory with `buf`."""
        raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raw = raw.reshape(-1).view(np.uint8)
        if raw.nbytes < self.plan_bytes:
            raise ValueError(f"plan buffer has {raw.nbytes} bytes, the layout needs "
                             f"plan_bytes={self.plan_bytes}")
        if raw.ctypes.data % 8:
            raise ValueError("plan buffer must be at least 8-byte aligned")
        out = {}
        for f in PLAN_FIELDS:
            o = self.offsets[f.name]
            n = self.capacity[f.name]
            out[f.name] = raw[o:o + n * f.dtype.itemsize].view(f.dtype)
        # The eight item_* arrays have one capacity, so they sit at equal strides: a 2-D view
        # lets the planner write all of them with one assignment; so do the merge map's rows
        # after merge_indptr (cached layouts copy them in one go).
        out["_items"] = self._rows(out, ("item_request", "item_qo_start", "item_qo_len", "item_kv_start",
                                         "item_kv_end", "item_partial", "item_merge", "item_kv_page_start"))
        out["_merge"] = self._rows(out, ("merge_qo_row", "merge_partial_start", "merge_partial_stride"))
        return out

    def _rows(self, views: dict, names: tuple) -> np.ndarray:
        """A 2-D view over consecutive fields of one capacity (equal strides in the buffer)."""
        first = self.offsets[names[0]]
        stride = self.offsets[names[1]] - first
        assert all(self.offsets[k] == first + i * stride for i, k in enumerate(names))
        return np.lib.stride_tricks.as_strided(views[names[0]], shape=(len(names), self.capacity[names[0]]),
                                               strides=(stride, 4), writeable=True)

    # -- device side ------------------------------------------------------------
    def pack_plan_ptrs(self, base_ptr: int) -> bytes:
        """struct PlanPtrs for a workspace at device address `base_ptr`: one
        8-byte little-endian pointer per field, in declaration order."""
        if base_ptr % ALIGN:
            raise ValueError(f"workspace base 0x{base_ptr:x} is not {ALIGN}-byte aligned")
        return struct.pack(f"<{len(PLAN_FIELDS)}Q",
                           *(base_ptr + self.offsets[f.name] for f in PLAN_FIELDS))

    def partial_o_offset(self) -> int:
        return align_up(self.plan_bytes)

    def partial_lse_offset(self, num_qo_heads: int, head_dim: int) -> int:
        n = self.bounds.max_partial_rows * num_qo_heads * head_dim * 4
        return align_up(self.partial_o_offset() + n)

    def merge_counters_offset(self, num_qo_heads: int, head_dim: int) -> int:
        n = self.bounds.max_partial_rows * num_qo_heads * 8   # (m, l) per batch-invariant row
        return align_up(self.partial_lse_offset(num_qo_heads, head_dim) + n)

    def merge_counters_bytes(self, num_qo_heads: int) -> int:
        return max(self.bounds.max_merge_rows, 1) * num_qo_heads * 4

    def workspace_bytes(self, num_qo_heads: int, head_dim: int) -> int:
        return align_up(self.merge_counters_offset(num_qo_heads, head_dim) + self.merge_counters_bytes(num_qo_heads))

    def table(self) -> list[tuple[str, str, int, int, str]]:
        """(name, dtype, capacity, offset, formula) per field, declaration order."""
        return [(f.name, str(f.dtype), self.capacity[f.name], self.offsets[f.name], f.formula)
                for f in PLAN_FIELDS]


def request_rows(v: dict, B: int) -> tuple:
    """The views of B requests' rows (query start and length, first page, KV length) in the
    views `v` of a plan buffer (write_requests' `rows`, for a caller that keeps them)."""
    return v["req_qo_start"][:B], v["req_qo_len"][:B], v["req_kv_page_start"][:B], v["req_kv_len"][:B]


def write_requests(v: dict, B: int, qo_indptr, qo_len, kv_indptr, kv_len, nnz: int, kv_indices,
                   rows: tuple | None = None) -> None:
    """The requests' rows (query start and length, first page, KV length) and the page table's
    first `nnz` ids into the views `v` of a plan buffer (every planner path writes these alike);
    `rows`: request_rows(v, B), if the caller has them."""
    qs, ql, ps, kl = rows or request_rows(v, B)
    qs[...] = qo_indptr[:B]
    ql[...] = qo_len
    ps[...] = kv_indptr[:B]
    kl[...] = kv_len
    v["kv_indices"][:nnz] = kv_indices[:nnz]


def write_merge_and_info(v: dict, res: dict, info: tuple) -> None:
    """The merge map of a schedule `res` (merge_rows, m_indptr, m_row, m_start, m_stride) and
    the plan_info header (PLAN_INFO_NAMES' values) into the views `v` of a plan buffer."""
    m = res["merge_rows"]
    v["merge_indptr"][0] = 0
    if m:
        v["merge_indptr"][:m + 1] = res["m_indptr"]
        v["merge_qo_row"][:m] = res["m_row"]
        v["merge_partial_start"][:m] = res["m_start"]
        v["merge_partial_stride"][:m] = res["m_stride"]
    write_info(v, *info)


def write_info(v: dict, *info) -> None:
    """The plan_info header (PLAN_INFO_NAMES' values) into the views `v`, in one call (a tuple
    assignment converts through numpy, ~2x slower)."""
    struct.pack_into("=9i", v["plan_info"], 0, *info)


def merge_partials(views: dict, num_merge_rows: int) -> np.ndarray:
    """Every merge entry's partial rows, flattened in entry order (entry r's slice is
    merge_indptr[r]:merge_indptr[r+1]), from the start/stride form the kernel reads."""
    M = num_merge_rows
    if M == 0:
        return np.zeros(0, np.int64)
    mi = views["merge_indptr"][:M + 1].astype(np.int64)
    owner = np.repeat(np.arange(M), np.diff(mi))
    j = np.arange(int(mi[-1])) - mi[owner]
    return (views["merge_partial_start"][:M].astype(np.int64)[owner]
            + j * views["merge_partial_stride"][:M].astype(np.int64)[owner])


def c_struct() -> str:
    """The C struct the kernels include: one `const int32_t*` per field, in
    declaration order (so it matches `pack_plan_ptrs`)."""
    lines = ["// Generated from rtattn.plan.fields.PLAN_FIELDS -- do not edit.",
             "struct PlanPtrs {"]
    for f in PLAN_FIELDS:
        assert f.dtype == np.int32
        lines.append(f"  const int32_t* {f.name};  // [{f.formula}] {f.doc}")
    lines.append("};")
    for i, n in enumerate(PLAN_INFO_NAMES):
        lines.append(f"#define RTATTN_PLAN_INFO_{n.upper()} {i}")
    return "\n".join(lines) + "\n"
