"""Ragged queries and paged KV (BSR) as int32 arrays, validated.

A batch is described by four arrays (FlashInfer's convention):
  qo_indptr[batch+1]        query rows of request b: qo_indptr[b] .. qo_indptr[b+1]
  kv_indptr[batch+1]        pages of request b: kv_indices[kv_indptr[b] : kv_indptr[b+1]]
  kv_indices[nnz_pages]     page ids in the pool [0, num_pages)
  kv_last_page_len[batch]   tokens used in the request's last page, in [1, page_size]
KV tokens of b = (pages_b - 1) * page_size + last_page_len[b].  A request with
zero pages has zero KV tokens (its last_page_len is ignored): its output is 0
and its LSE -inf, and it is still written.  Dense / ragged KV is page_size 1
with identity indices (`dense_kv`).

Every refusal names the array and the index (or the bound), so bad input never
reaches a kernel as a device fault or silent zeros.  This module is the one
validation path: the Planner, the wrappers and the CLI all call it, for the
batch arrays (`validate_batch`, every step) and for the configuration
(`check_config`, once).  Lengths and bounds are computed in int64, so no
difference or product can wrap around before it is checked.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

_I32_MAX = np.iinfo(np.int32).max
_I32 = np.dtype(np.int32)
HEAD_DIMS = (64, 128, 256)   # what the kernels are built for (codegen.spec and the planner read it)
# Extremes are taken as x.item(x.argmin()) / x.item(x.argmax()): on the small arrays of a decode
# step that is ~4x less overhead than a ufunc reduction or ndarray.min() (plan() is on
# the per-step host critical path).


class Batch(NamedTuple):
    """Validated int32 batch description plus derived per-request lengths.
    (A NamedTuple: a frozen dataclass costs ~2 us to build, per plan step.)"""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    qo_len: np.ndarray   # int64[batch]
    kv_len: np.ndarray   # int64[batch] tokens (each < 2**31: the kernels' positions are int32)
    page_size: int
    qo_max: int = 0      # longest query

    @property
    def batch(self) -> int:
        return self.qo_len.shape[0]


def as_int32(name: str, a) -> np.ndarray:
    """np.asarray + refuse non-integer dtypes and values outside int32."""
    arr = np.asarray(a)
    if arr.dtype == np.int32:
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        return arr
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":   # np.asarray([]) is float64
            return np.zeros(0, np.int32)
        raise TypeError(f"{name} must have an integer dtype (int32), got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > _I32_MAX):
        i = int(np.flatnonzero((arr < np.iinfo(np.int32).min) | (arr > _I32_MAX))[0])
        raise ValueError(f"{name}[{i}] = {arr[i]} does not fit in int32")
    return arr.astype(np.int32)


def _int32(name: str, a) -> np.ndarray:
    """as_int32, short-cut for what callers pass every step: a 1-D int32 ndarray."""
    if type(a) is np.ndarray and a.dtype is _I32 and a.ndim == 1:
        return a
    return as_int32(name, a)


def _top_u32(a: np.ndarray) -> int:
    """The largest entry of int32 `a` read as unsigned: a negative entry is >= 2**31, so one pass
    checks a range [0, n) (argmax: ~4x cheaper than a reduction)."""
    u = a.view(np.uint32)
    return u.item(u.argmax())


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_indptr(name: str, indptr: np.ndarray, length: int | None = None) -> np.ndarray:
    """Check an indptr; return its differences (the per-request lengths)."""
    return _check_indptr(name, indptr, length)[0]


def _check_indptr(name: str, indptr: np.ndarray, length: int | None = None):
    """check_indptr, plus the smallest length (0 for an empty batch)."""
    if indptr.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (batch+1), got 0")
    if length is not None and indptr.shape[0] != length:
        raise ValueError(f"{name} has {indptr.shape[0]} entries, expected {length}")
    if indptr.item(0) != 0:
        raise ValueError(f"{name}[0] = {indptr[0]}, must be 0")
    # int64: an int32 difference wraps ([0, 2**31-1, -2**31+1] would look monotone)
    d = np.subtract(indptr[1:], indptr[:-1], dtype=np.int64)
    dmin = d.item(d.argmin()) if d.shape[0] else 0
    if dmin < 0:
        i = _first(d < 0)
        raise ValueError(f"{name} is not monotone: {name}[{i + 1}] = {indptr[i + 1]} "
                         f"< {name}[{i}] = {indptr[i]}")
    return d, dmin


def check_int(name: str, value, low: int = 1) -> int:
    """`value` as a Python int >= low; TypeError for non-integers (bools and floats too)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_page_size(page_size) -> int:
    page_size = check_int("page_size", page_size)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: the kernels need a power of two (1, 2, 4, ..., 16, ...)")
    return page_size


def check_config(num_qo_heads, num_kv_heads, head_dim, page_size, *, num_ctas=None) -> int:
    """Validate a planner/wrapper configuration once, at construction; return g = H_qo / H_kv.
    num_ctas None means "the default grid"; 0 is refused, never read as the default."""
    g = check_heads(num_qo_heads, num_kv_heads)
    head_dim = check_int("head_dim", head_dim)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; the kernels take {HEAD_DIMS}")
    check_page_size(page_size)
    if num_ctas is not None:
        check_int("num_ctas", num_ctas)
    return g


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    """Return the group size g = H_qo / H_kv, refusing counts that don't divide."""
    check_int("num_qo_heads", num_qo_heads, 0)
    check_int("num_kv_heads", num_kv_heads, 0)
    if num_qo_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"head counts must be positive, got num_qo_heads={num_qo_heads}, "
                         f"num_kv_heads={num_kv_heads}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    return num_qo_heads // num_kv_heads


def validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size: int, *,
                   num_pages: int | None = None, causal: bool = False,
                   max_batch: int | None = None, max_qo_tokens: int | None = None,
                   max_pages: int | None = None, max_qo_len: int | None = None) -> Batch:
    """Validate a batch; return int32 arrays and per-request lengths.

    `qo_indptr` None: decode, one query token per request.
    `num_pages` is the pool size (page ids must be < it; None: only >= 0).
    `causal` refuses requests whose query is longer than their KV (query token i
    sees KV positions <= kv_len - qo_len + i, which would be negative).
    The max_* bounds, when given, are checked and named in the error.
    """
    if page_size < 1 or page_size & (page_size - 1):
        check_page_size(page_size)   # raises, naming the rule
    kv_indptr = _int32("kv_indptr", kv_indptr)
    decode = qo_indptr is None and kv_indptr.shape[0] > 0   # one query token per request
    qo_indptr = np.arange(kv_indptr.shape[0], dtype=np.int32) if qo_indptr is None else _int32("qo_indptr", qo_indptr)
    kv_indices = _int32("kv_indices", kv_indices)
    last = _int32("kv_last_page_len", kv_last_page_len)

    if decode:   # (a valid indptr by construction)
        qo_len = np.empty(qo_indptr.shape[0] - 1, dtype=np.int64)
        qo_len.fill(1)   # (np.ones is Python around these two: ~1 us more per plan)
        qo_min = min(1, qo_len.shape[0])   # (_check_indptr: 0 for an empty batch)
    else:
        qo_len, qo_min = _check_indptr("qo_indptr", qo_indptr)
    batch = qo_indptr.shape[0] - 1
    pages, pages_min = _check_indptr("kv_indptr", kv_indptr, batch + 1)
    if last.shape[0] != batch:
        raise ValueError(f"kv_last_page_len has {last.shape[0]} entries, expected batch={batch}")
    if max_batch is not None and batch > max_batch:
        raise ValueError(f"batch {batch} exceeds max_batch={max_batch}")
    nnz = kv_indptr.item(-1)
    if nnz * page_size > _I32_MAX:   # Python ints: no overflow; bounds every request's KV
        raise ValueError(f"kv_indptr[{batch}] = {nnz} pages x page_size {page_size} = "
                         f"{nnz * page_size} KV tokens do not fit int32")
    if kv_indices.shape[0] < nnz:
        raise ValueError(f"kv_indices has {kv_indices.shape[0]} entries, kv_indptr[{batch}] "
                         f"= {nnz} needs at least that many")
    if max_pages is not None and nnz > max_pages:
        raise ValueError(f"{nnz} KV pages (kv_indptr[{batch}]) exceed max_pages={max_pages}")
    total_q = qo_indptr.item(-1)
    if max_qo_tokens is not None and total_q > max_qo_tokens:
        raise ValueError(f"{total_q} query tokens (qo_indptr[{batch}]) exceed "
                         f"max_qo_tokens={max_qo_tokens}")
    ids = kv_indices[:nnz]
    # a pool past 2**31 still refuses a negative id (>= 2**31 as unsigned)
    if nnz and (ids.item(ids.argmin()) < 0 if num_pages is None else _top_u32(ids) >= min(num_pages, 2**31)):
        if ids.item(ids.argmin()) < 0:
            i = _first(ids < 0)
            raise ValueError(f"kv_indices[{i}] = {ids[i]} is negative")
        i = _first(ids >= num_pages)
        raise ValueError(f"kv_indices[{i}] = {ids[i]} is outside the page pool "
                         f"[0, {num_pages})")

    # last_page_len in [1, page_size] <=> (last - 1) as unsigned < page_size; only for
    # requests with pages (an empty request's last_page_len is ignored). The per-request
    # test runs only when the extremes are out of range.
    if batch and (last.item(last.argmin()) < 1 or last.item(last.argmax()) > page_size):
        bad = ((last - 1).view(np.uint32) >= page_size) & (pages > 0)
        if bad.any():
            i = _first(bad)
            raise ValueError(f"kv_last_page_len[{i}] = {last[i]} outside [1, page_size="
                             f"{page_size}]")
    kv_len = pages * page_size
    kv_len += last - page_size
    if pages_min == 0:   # some request has no pages (a no-op for an empty batch)
        kv_len *= pages > 0
    if total_q == batch and qo_min == 1:   # pure decode: every request has one query token
        qo_max = 1
    else:
        qo_max = qo_len.item(qo_len.argmax()) if batch else 0
    if max_qo_len is not None and qo_max > max_qo_len:
        i = _first(qo_len > max_qo_len)
        raise ValueError(f"request {i} has {qo_len[i]} query tokens (qo_indptr), exceeding "
                         f"max_qo_len={max_qo_len}")
    if causal and batch:
        d = qo_len - kv_len
        if d.item(d.argmax()) > 0:
            i = _first(qo_len > kv_len)
            raise ValueError(f"causal: request {i} has qo_len {qo_len[i]} (qo_indptr) > "
                             f"kv_len {kv_len[i]} (kv_indptr/kv_last_page_len)")
    return Batch(qo_indptr, kv_indptr, kv_indices, last, qo_len, kv_len, page_size, qo_max)


# -- builders (tests, CLI, benchmarks) ------------------------------------------

def indptr_from_lengths(lengths) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


def paged_kv(kv_lens, page_size: int, *, shuffle_seed: int | None = None):
    """(kv_indptr, kv_indices, kv_last_page_len) for the given token lengths.
    Page ids are 0..n-1, randomly permuted when shuffle_seed is given."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-kv // page_size)
    indptr = indptr_from_lengths(pages)
    n = int(indptr[-1])
    idx = np.arange(n, dtype=np.int32)
    if shuffle_seed is not None:
        idx = np.random.default_rng(shuffle_seed).permutation(n).astype(np.int32)
    last = np.where(pages > 0, kv - (pages - 1) * page_size, 0).astype(np.int32)
    return indptr, idx, last


def dense_kv(kv_lens):
    """Dense / ragged KV as a degenerate page table: page_size 1, identity ids."""
    return paged_kv(kv_lens, 1)
