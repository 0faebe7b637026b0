"""BatchPrefillWrapper: ragged query batches (prompt prefill, chunked prefill over cached
prefixes, multi-token verification) on the tensor-core prefill kernel, with the decode
wrapper's conventions: plan() once per step on the host (one pinned buffer of two, one async
copy), run() per layer with fixed grids and pointers (CUDA-graph capturable: rtattn.graphs'
DecodeGraphs replays it like decode).

KV is paged (kv_layout "NHD" [pages, page_size, H_kv, D] or "HND" [pages, H_kv, page_size, D],
page sizes 1..128, powers of two) or ragged ("ragged": K and V are [kv_tokens, H_kv, D] and
kv_indptr counts tokens). Query token i of a request with lengths (q_len, kv_len) sits at
position kv_len - q_len + i: causal variants need kv_len >= q_len (a cached prefix of
kv_len - q_len tokens, then the new ones).

LSE convention: natural logarithm (base e), as BatchDecodeWrapper.
"""
from __future__ import annotations

import numpy as np

from rtattn.families import prefill as family
from rtattn.plan import devices as plan_devices
from rtattn.plan.inspector import Planner, PlanInfo
from rtattn.plan.layout import check_config, check_int
from rtattn.runtime import current_device
from rtattn.tensors import expect_inner_contiguous, expect_shape, expect_vector_aligned
from rtattn.wrapper_base import KV_LAYOUTS, PlannedLaunch, PlannedWrapper, _checked, host_array

PREFILL_KV_LAYOUTS = KV_LAYOUTS + ("ragged",)


class BatchPrefillWrapper(PlannedWrapper):
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16, *,
                 max_batch: int, max_qo_tokens: int, max_pages: int | None = None,
                 max_kv_tokens: int | None = None, max_qo_len: int | None = None,
                 avg_qo_len: float | None = None, variant="causal", dtype: str = "bfloat16",
                 kv_layout: str = "NHD", mode: str = "auto", chunk_tokens: int = 2048, pdl: bool = True,
                 num_ctas: int | None = None, tile: dict | None = None, device=None, workspace=None,
                 num_pages_pool: int | None = None, queue_order: str = "lpt"):
        """`max_pages` bounds the pages of one step (paged KV); `max_kv_tokens` the KV tokens
        (ragged KV). `avg_qo_len` (default: max_qo_len or 1024, whichever is smaller) picks
        the query tile: the smallest of 16..128 fused rows covering avg_qo_len x group; on an
        H200 from 128 tokens the wgmma kernel's 64 rows, 128 where the KV bound per request
        (max_pages x page_size / max_batch) reaches 2048 tokens (rtattn.families.prefill).
        `tile`: overrides of the tile policy (mma, rows, tile_kv, num_warps, stages), for A/B runs.
        `num_pages_pool` (paged KV): as BatchDecodeWrapper's: plan() refuses page ids >= it.
        `queue_order`: the planner's ("lpt", the default, or "request": a request's tiles run side by
        side, rtattn.plan.order; an A/B path until measured)."""
        if kv_layout not in PREFILL_KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {PREFILL_KV_LAYOUTS}, got {kv_layout!r}")
        self.ragged = kv_layout == "ragged"
        if self.ragged:
            page_size = 1
            if max_kv_tokens is None:
                raise ValueError("ragged KV needs max_kv_tokens (the bound on a step's KV tokens)")
            max_pages = int(max_kv_tokens)
        elif max_pages is None:
            raise ValueError("paged KV needs max_pages (the bound on a step's KV pages)")
        check_config(num_qo_heads, num_kv_heads, head_dim, page_size, num_ctas=num_ctas)
        if page_size > 128:
            raise ValueError(f"page_size={page_size}: the prefill kernel takes powers of two up to 128")
        if num_pages_pool is not None:
            check_int("num_pages_pool", num_pages_pool)
        self.device = current_device(device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.page_size, self.kv_layout = page_size, kv_layout
        self.spec = family.spec_for(variant, dtype, head_dim)
        self.dtype, self.kv_dtype, self.o_dtype = self.spec.q_dtype, self.spec.kv_dtype, self.spec.o_dtype
        dev = plan_devices.from_props(self.device.props)
        mql = int(max_qo_len or max_qo_tokens)
        avg = float(avg_qo_len) if avg_qo_len is not None else float(min(mql, 1024))
        avg_kv = max_pages * page_size / max(1, int(max_batch))   # the step's KV bound per request
        self.tile = family.choose_tile(dev, head_dim, self.group, avg, paged=not self.ragged, avg_kv_len=avg_kv,
                                       linear_bias=self.spec.linear_bias, **(tile or {}))
        self.kernels = family.prefill_kernels(self.spec, self.tile, self.device.ordinal)
        self.pdl, self.fused_merge = pdl, False   # split KV: always the merge kernel
        self.num_ctas = int(num_ctas) if num_ctas is not None else self.kernels.num_ctas(num_kv_heads)
        self.planner = Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads, head_dim,
                               page_size, device=dev, mode=mode, num_ctas=self.num_ctas,
                               tile=family.tile_config(self.tile, head_dim, self.group, self.kernels.ctas_per_sm),
                               max_qo_len=mql, chunk_tokens=chunk_tokens,
                               causal=self.spec.causal,
                               num_pages_pool=None if self.ragged else num_pages_pool, queue_order=queue_order)
        self._pool_given = num_pages_pool is not None and not self.ragged
        self._ragged_ids = np.arange(max_pages if self.ragged else 0, dtype=np.int32)
        self._setup_buffers(workspace)

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr, kv_indptr, kv_indices=None, kv_last_page_len=None, stream=None, *,
             window_left: int | None = None) -> PlanInfo:
        """Plan one step from host arrays (numpy or host DLPack tensors). Paged KV: kv_indptr over
        pages, kv_indices, kv_last_page_len; ragged KV: kv_indptr over tokens only. The plan's
        copy is queued on `stream`: run() on the same stream (or order the two yourself).
        Sliding-window variants take `window_left` here, as BatchDecodeWrapper.plan()."""
        if window_left is not None or self.spec.window:
            window_left = self._check_window(window_left)
        nd = np.ndarray   # (numpy arrays as they are: host_array's first case, without the calls)
        if type(qo_indptr) is not nd or type(kv_indptr) is not nd:
            qo_indptr, kv_indptr = host_array(qo_indptr), host_array(kv_indptr)
        if self.ragged:
            if kv_indices is not None or kv_last_page_len is not None:
                raise ValueError("ragged KV: pass only qo_indptr and kv_indptr (token offsets)")
            kv_len = np.diff(np.asarray(kv_indptr, dtype=np.int64))
            nnz = int(kv_indptr[-1]) if len(kv_indptr) else 0
            if nnz > self._ragged_ids.shape[0]:
                raise ValueError(f"{nnz} KV tokens (kv_indptr[-1]) exceed max_kv_tokens={self._ragged_ids.shape[0]}")
            kv_indices = self._ragged_ids[:max(nnz, 0)]
            kv_last_page_len = np.ones(kv_len.shape[0], dtype=np.int32)
        elif kv_indices is None or kv_last_page_len is None:
            raise ValueError("paged KV: plan() needs kv_indices and kv_last_page_len")
        else:
            if type(kv_indices) is not nd or type(kv_last_page_len) is not nd:
                kv_indices, kv_last_page_len = host_array(kv_indices), host_array(kv_last_page_len)
        return self._plan_and_copy(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, stream, window_left)

    # ------------------------------------------------------------------ run (PlannedWrapper's)
    def _caches(self, k_cache, v_cache, h):
        """Paged caches as the decode wrapper's; ragged K and V [kv_tokens, H_kv, D] must hold
        the tokens the plan reads (kv_indptr[-1])."""
        if not self.ragged:
            return super()._caches(k_cache, v_cache, h)
        if v_cache is None:
            raise ValueError("ragged KV needs both k and v tensors [kv_tokens, H_kv, D]")
        out = []
        for name, t in (("k", k_cache), ("v", v_cache)):
            f = self._imports.get(name, t, h, self._derive_ragged)
            if f[0] < self._nnz:
                raise ValueError(f"{name} has {f[0]} tokens but the plan reads {self._nnz} (kv_indptr[-1])")
            out.append(f)
        return out

    def _cache_fields(self, name, t):
        fields = super()._cache_fields(name, t)   # (pages, name, shape, ptr, page, token, head strides)
        family.check_kv_strides(name, fields[4], fields[5], t.itemsize)
        return fields

    def _derive_ragged(self, name, t):
        """Ragged K or V [tokens, H_kv, D]: (..., ptr, token stride as the page stride, 0, head
        stride): page size 1."""
        t = _checked(name, t, self.kv_dtype, 3, self.device.ordinal)
        expect_shape(name, t, (None, self.num_kv_heads, self.head_dim))
        expect_inner_contiguous(name, t)
        expect_vector_aligned(name, t)
        family.check_kv_strides(name, t.strides[0], 0, t.itemsize)
        return (t.shape[0], name, t.shape, t.ptr, t.strides[0], 0, t.strides[1])


class PrefillLaunch(PlannedLaunch):
    """A validated launch of the prefill (and merge) kernels: calling it enqueues them."""


BatchPrefillWrapper.launch_type = PrefillLaunch
