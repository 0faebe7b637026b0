"""BatchDecodeWrapper: plan() once per step on the host, run() per layer on the device.

plan() fills a pinned buffer (one of two, used in turn) at offsets fixed when the wrapper was
built and issues one async host-to-device copy into the workspace; run() launches the persistent
decode kernel and the split-KV merge kernel with fixed grids and fixed pointers, so both can be
captured into a CUDA graph once and replayed every step while the plan changes underneath
(see rtattn.graphs).

LSE convention: natural logarithm (base e) of the sum of the attention weights' exponentials,
log sum_j exp(s_j), with s_j the logits after sm_scale (and the variant's logits transform).
With attention sinks the sink's exp(sinks[h]) is part of that sum (the softmax denominator):
the LSE is that of the row's KV plus its sink.
"""
from __future__ import annotations

import math

import numpy as np

from rtattn.codegen.spec import BUILTINS, AttentionSpec, default_stages
from rtattn.kernels import decode_kernels
from rtattn.plan import devices as plan_devices
from rtattn.plan.inspector import Planner, PlanInfo, check_window
from rtattn.plan.layout import check_config, check_int
from rtattn.runtime import DeviceBuffer, Event, PinnedBuffer, as_stream, current_device, memcpy_htod_async, memset_d32
from rtattn.tensors import cuda_tensor, expect_inner_contiguous, expect_shape, expect_vector_aligned, same_device

KV_LAYOUTS = ("NHD", "HND")


def _spec_for(variant, dtype: str, head_dim: int, group: int, arch: str) -> AttentionSpec:
    m_tiles = 1 if group <= 16 else 2
    if isinstance(variant, AttentionSpec):
        if variant.head_dim != head_dim or variant.dtype != dtype:
            raise ValueError(f"variant spec is for head_dim={variant.head_dim}, dtype={variant.dtype}; "
                             f"the wrapper has head_dim={head_dim}, dtype={dtype}")
        return variant if variant.rows >= group else variant.with_(m_tiles=m_tiles)
    if variant not in BUILTINS:
        raise ValueError(f"unknown variant {variant!r}; built-ins are {sorted(BUILTINS)} "
                         f"(or pass an AttentionSpec)")
    return BUILTINS[variant](dtype=dtype, head_dim=head_dim, m_tiles=m_tiles, stages=default_stages(head_dim, arch))


class BatchDecodeWrapper:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 max_batch: int, max_pages: int, max_qo_tokens: int | None = None,
                 variant="plain", dtype: str = "bfloat16", kv_layout: str = "NHD",
                 mode: str = "auto", chunk_tokens: int = 2048, pdl: bool = True, num_ctas: int | None = None,
                 fused_merge: bool = False, device=None, workspace=None,
                 num_pages_pool: int | None = None):
        """`num_pages_pool`: pages in the KV cache pool, if known up front; plan() refuses page
        ids >= it. Without it, the pool is the smallest cache prepare()/run() has been given."""
        check_config(num_qo_heads, num_kv_heads, head_dim, page_size, num_ctas=num_ctas)
        if num_pages_pool is not None:
            check_int("num_pages_pool", num_pages_pool)
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.device = current_device(device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.page_size, self.kv_layout, self.dtype = page_size, kv_layout, dtype
        self.spec = _spec_for(variant, dtype, head_dim, self.group, self.device.arch)
        if self.group > self.spec.rows:
            raise ValueError(f"head group {self.group} exceeds the kernel's {self.spec.rows} rows")
        self.kernels = decode_kernels(self.spec, self.device.ordinal)
        self.pdl = pdl
        # Split KV rows are merged by a second kernel after the whole grid (default), or by the
        # decode kernel's CTA that writes a tile's last partial (arrival counters in the
        # workspace): faster for a few very long rows, slower for heavy-tailed small batches
        # (docs/perf-log.md v4).
        self.fused_merge = bool(fused_merge)
        # Default: one resident wave. More oversubscribes the GPU (the hardware then hands queues
        # to whichever SM frees first); fewer leaves SMs to other streams.
        self.num_ctas = int(num_ctas) if num_ctas is not None else self.kernels.num_ctas(num_kv_heads)
        max_qo_tokens = max_batch if max_qo_tokens is None else max_qo_tokens
        self.planner = Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads, head_dim, page_size,
                               device=plan_devices.from_props(self.device.props), mode=mode,
                               num_ctas=self.num_ctas, max_rows=self.spec.rows, chunk_tokens=chunk_tokens,
                               causal=self.spec.causal, num_pages_pool=num_pages_pool)
        self._pool_given = num_pages_pool is not None   # else learnt from the caches (_check_pool)
        self.layout = self.planner.layout
        # Two pinned plan buffers, used in turn: plan() for step N+1 fills one while step N's
        # copy (queued behind step N-1's kernels) may still be pending from the other, so the
        # host only waits on the copy of two steps ago instead of on the GPU's current work.
        self._pinned = tuple(PinnedBuffer(self.layout.plan_bytes, self.device) for _ in range(2))
        self._pinned_arrays = tuple(b.array for b in self._pinned)  # stable objects: the planner caches views
        self._copied = tuple(Event(timing=False) for _ in range(2))
        self._in_flight = [False, False]
        self._slot = 0
        self.pinned = self._pinned[0]   # the buffer holding the latest plan
        self.workspace = self._workspace(workspace)
        self._counters = self.workspace_ptr + self.layout.merge_counters_offset(num_qo_heads, head_dim)
        memset_d32(self._counters, 0, self.layout.merge_counters_bytes(num_qo_heads) // 4)
        self._fixed = self._fixed_params()
        self._may_split = self.planner.bounds.max_merge_rows > 0   # naive plans never need the merge kernel
        self.info: PlanInfo | None = None
        self._nnz = 0   # pages the latest plan reads (kv_indptr[-1])
        self.window_left: int | None = None   # the planned window (sliding-window variants)

    def _workspace(self, workspace):
        need = self.planner.workspace_bytes()
        if workspace is None:
            buf = DeviceBuffer(need, self.device)
            return buf
        t = cuda_tensor("workspace", workspace)
        if t.nbytes < need:
            raise ValueError(f"workspace has {t.nbytes} bytes, this wrapper needs {need}")
        if t.ptr % 256:
            raise ValueError(f"workspace must be 256-byte aligned (got 0x{t.ptr:x})")
        return t

    @property
    def workspace_ptr(self) -> int:
        return self.workspace.ptr

    # ------------------------------------------------------------------ plan
    def plan(self, kv_indptr, kv_indices, kv_last_page_len, qo_indptr=None, stream=None, *,
             window_left: int | None = None) -> PlanInfo:
        """Plan one step from host arrays (numpy or host DLPack tensors). Decode by default:
        one query token per request unless `qo_indptr` says otherwise. The plan's copy is
        queued on `stream`: run() on the same stream (or order the two streams yourself).
        Page ids must lie in the KV pool (`num_pages_pool`): launches and graphs prepared
        earlier replay this plan, so it is refused before anything is written or copied.

        Sliding-window variants need `window_left` here (the plan reads only the window;
        run() takes it from the plan and refuses a params window that disagrees)."""
        window_left = check_window(window_left)
        if self.spec.window and window_left is None:
            raise ValueError(f"window_left: variant {self.spec.variant!r} has a sliding window; pass "
                             f"plan(..., window_left=N) so the plan reads only the window")
        if window_left is not None and not self.spec.window:
            raise ValueError(f"window_left={window_left}: variant {self.spec.variant!r} has no sliding window")
        kv_indptr, kv_indices, kv_last_page_len = (_host(a) for a in (kv_indptr, kv_indices, kv_last_page_len))
        slot = self._slot
        if self._in_flight[slot]:  # this buffer's copy (two plans ago) may not have run yet
            self._copied[slot].synchronize()
        buf = self._pinned[slot]
        qo_indptr = None if qo_indptr is None else _host(qo_indptr)   # None: decode
        info = self.planner.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, out=self._pinned_arrays[slot],
                                 window_left=window_left)
        memcpy_htod_async(self.workspace_ptr, buf.ptr, self.layout.plan_bytes, stream)
        self._copied[slot].record(stream)
        self._in_flight[slot] = True
        self._slot, self.pinned = slot ^ 1, buf
        self._nnz = int(kv_indptr[-1])
        self.info, self.window_left = info, window_left
        return info

    # ------------------------------------------------------------------ run
    def run(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
            params: dict | None = None):
        """Attention for the planned batch. `k_cache`/`v_cache`: [pages, page_size, H_kv, D] (NHD)
        or [pages, H_kv, page_size, D] (HND); or one `kv_cache` [pages, 2, ...] as `k_cache`.
        `out` (optional) [tokens, H_qo, D]; `lse`: None, True (allocate) or a float32 [tokens, H_qo]
        tensor. Returns out, or (out, lse) when lse was asked for."""
        launch = self.prepare(q, k_cache, v_cache, out=out, lse=lse, stream=stream, sm_scale=sm_scale,
                              params=params)
        launch()
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    def prepare(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
                params: dict | None = None) -> "DecodeLaunch":
        """Validate everything and pack the kernel arguments; the returned callable launches.
        Graph capture calls it once and replays; every pointer is fixed inside it."""
        if self.info is None:
            raise RuntimeError("run() before plan(): call plan() for this step first")
        stream = as_stream(stream)
        H, Hk, D, dt = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype
        n_tok = self.info.num_qo_tokens
        qv = cuda_tensor("q", q, stream, dtype=dt, ndim=3)
        expect_shape("q", qv, (n_tok, H, D))
        expect_inner_contiguous("q", qv)
        expect_vector_aligned("q", qv)
        kv = self._caches(k_cache, v_cache, stream)
        if out is None:
            out = DeviceBuffer(max(n_tok, 1) * H * D * 2, self.device).as_tensor(dt, (n_tok, H, D), stream=stream)
        ov = cuda_tensor("out", out, stream, dtype=dt, ndim=3)
        expect_shape("out", ov, (n_tok, H, D))
        expect_inner_contiguous("out", ov)
        lv = None
        if lse is True:
            lse = DeviceBuffer(max(n_tok, 1) * H * 4, self.device).as_tensor("float32", (n_tok, H), stream=stream)
        if lse is not None:
            lv = cuda_tensor("lse", lse, stream, dtype="float32", ndim=2)
            expect_shape("lse", lv, (n_tok, H))
            if lv.strides != (H, 1):
                raise ValueError(f"lse must be contiguous [tokens, heads], got strides {lv.strides}")
        same_device({"q": qv, "k_cache": kv[0], "v_cache": kv[1], "out": ov, "lse": lv}, self.device.ordinal)
        scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
        packed = self._pack(qv, kv, ov, lv, scale, self._extra(params or {}, stream))
        return DecodeLaunch(self, packed, stream, out, lse if lv is not None else None,
                            keep=(qv, kv, ov, lv, params), window_left=self.window_left)

    def _caches(self, k_cache, v_cache, stream):
        D, Hk, ps = self.head_dim, self.num_kv_heads, self.page_size
        per_page = (ps, Hk, D) if self.kv_layout == "NHD" else (Hk, ps, D)
        if v_cache is None:  # one tensor [pages, 2, ...]: K at index 0, V at 1
            kvt = cuda_tensor("kv_cache", k_cache, stream, dtype=self.dtype, ndim=5)
            expect_shape("kv_cache", kvt, (None, 2) + per_page)
            k = _select(kvt, 1, 0)
            v = _select(kvt, 1, 1)
            names = ("kv_cache[:, 0]", "kv_cache[:, 1]")
        else:
            k = cuda_tensor("k_cache", k_cache, stream, dtype=self.dtype, ndim=4)
            v = cuda_tensor("v_cache", v_cache, stream, dtype=self.dtype, ndim=4)
            names = ("k_cache", "v_cache")
        for name, t in zip(names, (k, v)):
            expect_shape(name, t, (None,) + per_page)
            expect_inner_contiguous(name, t)
            expect_vector_aligned(name, t)
            self._check_pool(name, t.shape[0])
        pool = self.planner.num_pages_pool
        self.planner.num_pages_pool = min(k.shape[0], v.shape[0], *(() if pool is None else (pool,)))
        return k, v

    def _check_pool(self, name: str, pages: int) -> None:
        """A cache of `pages` pages bounds the pool plan() accepts from now on (every launch
        prepared on it replays later plans); refuse it if the current plan already reads past."""
        pool = self.planner.num_pages_pool
        if pool is not None and pages >= pool:
            return
        if self._pool_given:
            raise ValueError(f"{name} holds {pages} pages, fewer than num_pages_pool={pool} "
                             f"the wrapper was built with")
        ids = self.info.views["kv_indices"][:self._nnz]
        top = int(ids.max()) if self._nnz else -1
        if pages <= top:
            raise ValueError(f"{name} holds {pages} pages but the plan reads page {top}")

    def _extra(self, params: dict, stream) -> dict:
        """Variant parameters: scalars as numbers, tensor parameters as CUDA DLPack tensors.
        The window comes from the plan (params may repeat it, not change it)."""
        if self.spec.window:
            given = params.get("window_left", self.window_left)
            if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given != self.window_left:
                raise ValueError(f"params['window_left']={given!r} disagrees with the planned "
                                 f"window_left={self.window_left} (plan(..., window_left=N) sets it)")
            params = {**params, "window_left": self.window_left}
        names = {p.name for p in self.spec.params}
        unknown = set(params) - names
        missing = names - set(params)
        if unknown or missing:
            raise ValueError(f"variant {self.spec.variant!r} takes parameters {sorted(names)}; "
                             f"missing {sorted(missing)}, unknown {sorted(unknown)}")
        values, keep = {}, []
        for p in self.spec.params:
            v = params[p.name]
            if p.is_pointer:
                if p.name == "sinks" and self.spec.sinks:   # built-in sinks: float32 [H_qo]
                    t = cuda_tensor("params['sinks']", v, stream, dtype="float32", ndim=1)
                    expect_shape("params['sinks']", t, (self.num_qo_heads,))
                    if t.strides != (1,):
                        raise ValueError(f"params['sinks'] must be contiguous, got strides {t.strides}")
                else:
                    t = cuda_tensor(f"params[{p.name!r}]", v, stream)
                keep.append(t)
                values[p.name] = t.ptr
            else:
                values[p.name] = float(v) if p.c_type == "float" else int(v)
                if p.name == "soft_cap" and not 0 < values[p.name] < math.inf:
                    raise ValueError(f"params['soft_cap']={v!r}: the cap must be a positive finite number")
        return values or {"unused_": 0}

    def _fixed_params(self) -> dict:
        """Kernel arguments that never change for this wrapper (workspace and plan pointers, head
        layout), computed once instead of on every run()."""
        ws = self.workspace_ptr
        return dict(
            partial_o=ws + self.layout.partial_o_offset(),
            partial_lse=ws + self.layout.partial_lse_offset(self.num_qo_heads, self.head_dim),
            merge_counters=self._counters, fused_merge=int(self.fused_merge),
            plan={name: ws + off for name, off in self.layout.offsets.items()},
            num_qo_heads=self.num_qo_heads, group_size=self.group,
            merge_row_capacity=max(1, self.layout.bounds.max_merge_rows),
            page_shift=self.page_size.bit_length() - 1)

    def _pack(self, qv, kv, ov, lv, scale: float, extra: dict) -> bytes:
        kt, vt = kv
        page_k = _paged_strides(kt, self.kv_layout)
        page_v = _paged_strides(vt, self.kv_layout)
        return self.kernels.rendered.params.pack(
            q=qv.ptr, q_stride_tok=qv.strides[0], q_stride_head=qv.strides[1],
            k_cache=kt.ptr, k_stride_page=page_k[0], k_stride_tok=page_k[1], k_stride_head=page_k[2],
            v_cache=vt.ptr, v_stride_page=page_v[0], v_stride_tok=page_v[1], v_stride_head=page_v[2],
            o=ov.ptr, o_stride_tok=ov.strides[0], o_stride_head=ov.strides[1],
            lse=lv.ptr if lv is not None else 0,
            sm_scale=scale, sm_scale_log2=scale * 1.4426950408889634, extra=extra, **self._fixed)


class DecodeLaunch:
    """A fully validated launch: calling it enqueues the decode and merge kernels."""

    def __init__(self, wrapper: BatchDecodeWrapper, params: bytes, stream, out, lse, keep, window_left=None):
        self.wrapper, self.params, self.stream = wrapper, params, stream
        self.out, self.lse, self._keep = out, lse, keep
        self.window_left = window_left   # packed into params: a replan must keep it

    def check_plan(self) -> None:
        """The current plan must be one this launch's packed arguments fit (its window)."""
        if self.wrapper.window_left != self.window_left:
            raise ValueError(f"window_left: this launch was prepared for window {self.window_left}, the "
                             f"current plan has {self.wrapper.window_left}; prepare() again")

    def __call__(self, stream=None) -> None:
        w = self.wrapper
        self.check_plan()
        w.kernels.launch(self.params, w.num_ctas, w.num_kv_heads, stream or self.stream,
                         merge=w._may_split and not w.fused_merge, pdl=w.pdl)


def _host(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__dlpack__"):
        dev = a.__dlpack_device__()[0] if hasattr(a, "__dlpack_device__") else 1
        if int(dev) not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise ValueError("plan() takes host arrays (the plan is computed on the CPU); got device memory")
        return np.from_dlpack(a)
    return np.asarray(a)


def _select(t, axis: int, index: int):
    """View of t with `axis` fixed at `index` (no copy)."""
    from rtattn.runtime import export
    shape = t.shape[:axis] + t.shape[axis + 1:]
    strides = t.strides[:axis] + t.strides[axis + 1:]
    return export(t.ptr + index * t.strides[axis] * t.itemsize, shape, t.dtype, t.device_id, strides, owner=t)


def _paged_strides(t, layout: str) -> tuple[int, int, int]:
    """(page, token-in-page, head) strides in elements for either cache layout."""
    if layout == "NHD":
        return t.strides[0], t.strides[1], t.strides[2]
    return t.strides[0], t.strides[2], t.strides[1]
