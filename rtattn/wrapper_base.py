"""What every planned attention wrapper shares (decode, prefill): the device workspace, the two
pinned plan buffers and their async copy, the window and KV-pool checks, the fixed kernel
arguments, and launches (rtattn.runtime.launch) that check their plan. Per-call validation and
packing of the one Params struct come in two forms: BatchDecodeWrapper's fast path (tensor
imports remembered, members written in place: rtattn/wrapper.py) and the plain one here, which
BatchPrefillWrapper uses (moving prefill onto the fast path is the next step).

A subclass builds `self.planner` and `self.kernels` (anything with `.rendered.params`), sets the
head/page/dtype attributes and `_pool_given` (num_pages_pool known up front), then calls
`_setup_buffers(workspace)`.

LSE convention: natural logarithm (base e) of the sum of the attention weights' exponentials,
log sum_j exp(s_j), with s_j the logits after sm_scale (and the variant's logits transform).
"""
from __future__ import annotations

import math

import numpy as np

from rtattn.codegen.spec import AttentionSpec
from rtattn.plan.inspector import check_window
from rtattn.runtime import DeviceBuffer, Event, PinnedBuffer, memcpy_htod_async, memset_d32
from rtattn.runtime import launch as launch_path
from rtattn.runtime.launch import Launch, Params
from rtattn.tensors import (cuda_tensor, expect_inner_contiguous, expect_shape, expect_typed, expect_vector_aligned,
                            same_device)

KV_LAYOUTS = ("NHD", "HND")


class PlannedWrapper:
    spec: AttentionSpec

    def _setup_buffers(self, workspace) -> None:
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
        self._counters = self.workspace_ptr + self.layout.merge_counters_offset(self.num_qo_heads, self.head_dim)
        memset_d32(self._counters, 0, self.layout.merge_counters_bytes(self.num_qo_heads) // 4)
        self._fixed = self._fixed_params()
        self._param_names = frozenset(p.name for p in self.spec.params)
        self._may_split = self.planner.bounds.max_merge_rows > 0   # naive plans never need the merge kernel
        self.info = None
        self._nnz = 0   # pages the latest plan reads (kv_indptr[-1])
        self.window_left: int | None = None   # the planned window (sliding-window variants)

    def _workspace(self, workspace):
        need = self.planner.workspace_bytes()
        if workspace is None:
            return DeviceBuffer(need, self.device)
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
    def _check_window(self, window_left):
        """plan()'s window_left: required by (and only by) sliding-window variants."""
        window_left = check_window(window_left)
        if self.spec.window and window_left is None:
            raise ValueError(f"window_left: variant {self.spec.variant!r} has a sliding window; pass "
                             f"plan(..., window_left=N) so the plan reads only the window")
        if window_left is not None and not self.spec.window:
            raise ValueError(f"window_left={window_left}: variant {self.spec.variant!r} has no sliding window")
        return window_left

    def _plan_and_copy(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, stream, window_left=None):
        """Plan into the next pinned buffer and queue its one copy into the workspace
        (qo_indptr None: one query token per request)."""
        slot = self._slot
        if self._in_flight[slot]:  # this buffer's copy (two plans ago) may not have run yet
            self._copied[slot].synchronize()
        buf = self._pinned[slot]
        info = self.planner.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                 out=self._pinned_arrays[slot], window_left=window_left)
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
        """Attention for the planned batch: prepare() (validation, packing), then the launch.
        q [tokens, H_qo, D]; the caches as the wrapper's class documents (paged: [pages,
        page_size, H_kv, D] for NHD, [pages, H_kv, page_size, D] for HND, or one kv_cache
        [pages, 2, ...] as k_cache). `out` (optional) [tokens, H_qo, D]; `lse`: None, True
        (allocate) or a float32 [tokens, H_qo] tensor. Returns out, or (out, lse)."""
        launch = self.prepare(q, k_cache, v_cache, out=out, lse=lse, stream=stream, sm_scale=sm_scale,
                              params=params)
        launch()
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    # ------------------------------------------------------------------ validation
    def _check_q(self, q, stream):
        qv = cuda_tensor("q", q, stream, dtype=self.dtype, ndim=3)
        expect_shape("q", qv, (self.info.num_qo_tokens, self.num_qo_heads, self.head_dim))
        expect_inner_contiguous("q", qv)
        expect_vector_aligned("q", qv)
        return qv

    def _outputs(self, out, lse, stream):
        """(out, out view, lse, lse view): allocated when not given; checked when given."""
        n_tok, H, D, dt = self.info.num_qo_tokens, self.num_qo_heads, self.head_dim, self.dtype
        if out is None:
            out = DeviceBuffer(max(n_tok, 1) * H * D * 2, self.device).as_tensor(dt, (n_tok, H, D), stream=stream)
        ov = cuda_tensor("out", out, stream, dtype=dt, ndim=3)
        expect_shape("out", ov, (n_tok, H, D))
        expect_inner_contiguous("out", ov)
        expect_vector_aligned("out", ov, 4)
        lv = None
        if lse is True:
            lse = DeviceBuffer(max(n_tok, 1) * H * 4, self.device).as_tensor("float32", (n_tok, H), stream=stream)
        if lse is not None:
            lv = cuda_tensor("lse", lse, stream, dtype="float32", ndim=2)
            expect_shape("lse", lv, (n_tok, H))
            expect_lse_rows(lv, H)
        return out, ov, (lse if lv is not None else None), lv

    def _paged_caches(self, k_cache, v_cache, stream):
        """Paged K and V views: [pages, page_size, H_kv, D] (NHD) or [pages, H_kv, page_size, D]
        (HND), or one kv_cache [pages, 2, ...] passed as k_cache."""
        D, Hk, ps = self.head_dim, self.num_kv_heads, self.page_size
        per_page = (ps, Hk, D) if self.kv_layout == "NHD" else (Hk, ps, D)
        if v_cache is None:  # one tensor [pages, 2, ...]: K at index 0, V at 1
            kvt = cuda_tensor("kv_cache", k_cache, stream, dtype=self.dtype, ndim=5)
            expect_shape("kv_cache", kvt, (None, 2) + per_page)
            k = select(kvt, 1, 0)
            v = select(kvt, 1, 1)
            names = ("kv_cache[:, 0]", "kv_cache[:, 1]")
        else:
            k = cuda_tensor("k_cache", k_cache, stream, dtype=self.dtype, ndim=4)
            v = cuda_tensor("v_cache", v_cache, stream, dtype=self.dtype, ndim=4)
            names = ("k_cache", "v_cache")
        for name, t in zip(names, (k, v)):
            expect_shape(name, t, (None,) + per_page)
            expect_inner_contiguous(name, t)
            expect_vector_aligned(name, t)
        self._learn_pool(zip(names, (k.shape[0], v.shape[0])))
        return k, v

    def _learn_pool(self, caches) -> None:
        """caches: (name, pages) of the K and V caches of a launch: each is checked against the
        plan (_check_pool) and the smallest bounds the pool from now on."""
        pool, caches = self.planner.num_pages_pool, tuple(caches)
        for name, pages in caches:
            self._check_pool(name, pages)
        self.planner.num_pages_pool = min(*(pages for _, pages in caches), *(() if pool is None else (pool,)))

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

    def _same_device(self, tensors: dict) -> None:
        same_device(tensors, self.device.ordinal)

    def _with_planned_window(self, params: dict) -> dict:
        """A sliding-window variant's params with the plan's window (params may repeat it, not
        change it)."""
        if not self.spec.window:
            return params
        given = params.get("window_left", self.window_left)
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given != self.window_left:
            raise ValueError(f"params['window_left']={given!r} disagrees with the planned "
                             f"window_left={self.window_left} (plan(..., window_left=N) sets it)")
        return {**params, "window_left": self.window_left}

    def _check_param_names(self, params: dict) -> None:
        """params must name exactly the variant's parameters."""
        names = self._param_names
        if params.keys() != names:
            raise ValueError(f"variant {self.spec.variant!r} takes parameters {sorted(names)}; "
                             f"missing {sorted(names - params.keys())}, unknown {sorted(params.keys() - names)}")

    def _extra_values(self, params: dict, stream) -> dict:
        """Variant parameters by name (the struct packer's form): scalars as numbers, tensor
        parameters as CUDA DLPack tensors' pointers.
        The window comes from the plan (params may repeat it, not change it)."""
        params = self._with_planned_window(params)
        self._check_param_names(params)
        values = {}
        for p in self.spec.params:
            v = params[p.name]
            if p.is_pointer:
                t = cuda_tensor(f"params[{p.name!r}]", v, stream)
                if p.name == "sinks" and self.spec.sinks:
                    expect_sinks(t, self.num_qo_heads)
                values[p.name] = t.ptr
            else:
                values[p.name] = scalar_param(p, v)
        return values or {"unused_": 0}

    # ------------------------------------------------------------------ packing
    def _fixed_params(self) -> dict:
        """Kernel arguments that never change for this wrapper (workspace and plan pointers, head
        layout), computed once instead of on every run()."""
        ws = self.workspace_ptr
        return dict(
            partial_o=ws + self.layout.partial_o_offset(),
            partial_lse=ws + self.layout.partial_lse_offset(self.num_qo_heads, self.head_dim),
            merge_counters=self._counters, fused_merge=int(getattr(self, "fused_merge", False)),
            plan={name: ws + off for name, off in self.layout.offsets.items()},
            num_qo_heads=self.num_qo_heads, group_size=self.group,
            merge_row_capacity=max(1, self.layout.bounds.max_merge_rows),
            page_shift=self.page_size.bit_length() - 1)

    def _pack(self, qv, kv_strides, kv_ptrs, ov, lv, sm_scale, extra: dict) -> bytes:
        """The Params struct. kv_strides: ((page, token, head) of K, same of V) in elements."""
        (kp, kt, kh), (vp, vt, vh) = kv_strides
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else float(sm_scale)
        return self.kernels.rendered.params.pack(
            q=qv.ptr, q_stride_tok=qv.strides[0], q_stride_head=qv.strides[1],
            k_cache=kv_ptrs[0], k_stride_page=kp, k_stride_tok=kt, k_stride_head=kh,
            v_cache=kv_ptrs[1], v_stride_page=vp, v_stride_tok=vt, v_stride_head=vh,
            o=ov.ptr, o_stride_tok=ov.strides[0], o_stride_head=ov.strides[1],
            lse=lv.ptr if lv is not None else 0,
            sm_scale=scale, sm_scale_log2=scale * 1.4426950408889634, extra=extra, **self._fixed)


class PlannedLaunch(Launch):
    """A validated launch of a planned wrapper's kernels: calling it enqueues them. `args` is its
    argument buffer; `out`/`lse` what run() returns; `window_left` the plan's window packed in it."""

    def __init__(self, wrapper, calls, args: Params):
        super().__init__(calls, device=wrapper.device)
        self.wrapper, self.args = wrapper, args
        self.out = self.lse = self.keep = None
        self.window_left = None   # packed into the arguments: a replan must keep it
        self.tokens = 0           # query rows of its q/out/lse: a replan may not read or write more

    @property
    def params(self) -> bytes:
        """The argument struct's bytes."""
        return bytes(self.args)

    def check_plan(self) -> None:
        """The current plan must be one this launch's packed arguments fit: its window, and no more
        query tokens than its q/out/lse hold (a replay would read and write past them)."""
        w = self.wrapper
        if w.window_left != self.window_left:
            raise ValueError(f"window_left: this launch was prepared for window {self.window_left}, the "
                             f"current plan has {w.window_left}; prepare() again")
        if w.info.num_qo_tokens > self.tokens:
            raise ValueError(f"q: this launch was prepared with {self.tokens} query tokens, the current "
                             f"plan has {w.info.num_qo_tokens}; prepare() again with tensors that hold them")

    def __call__(self, stream=None) -> None:
        w = self.wrapper
        if self.window_left != w.window_left or w.info.num_qo_tokens > self.tokens:
            self.check_plan()
        # Launch.__call__ inlined: one Python frame less per run()
        launch_path.enqueue(self.calls, self.stream if stream is None else stream, self.device)


def expect_lse_rows(t, num_qo_heads: int) -> None:
    """An lse view [tokens, H_qo] (its rank checked) must be row-major contiguous."""
    if t.strides != (num_qo_heads, 1):
        raise ValueError(f"lse must be contiguous [tokens, heads], got strides {t.strides}")


def expect_sinks(t, num_qo_heads: int) -> None:
    """Built-in sinks: one float32 logit per query head, contiguous."""
    name = "params['sinks']"
    expect_typed(name, t, "float32", 1)
    expect_shape(name, t, (num_qo_heads,))
    if t.strides != (1,):
        raise ValueError(f"{name} must be contiguous, got strides {t.strides}")


def scalar_param(p, v):
    """A scalar variant parameter as its C type's number (soft_cap: positive and finite)."""
    x = float(v) if p.c_type == "float" else int(v)
    if p.name == "soft_cap" and not 0 < x < math.inf:
        raise ValueError(f"params['soft_cap']={v!r}: the cap must be a positive finite number")
    return x


def host_array(a) -> np.ndarray:
    """A host numpy view of a numpy array or a host DLPack tensor (plan() inputs)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__dlpack__"):
        dev = a.__dlpack_device__()[0] if hasattr(a, "__dlpack_device__") else 1
        if int(dev) not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise ValueError("plan() takes host arrays (the plan is computed on the CPU); got device memory")
        return np.from_dlpack(a)
    return np.asarray(a)


def select(t, axis: int, index: int):
    """View of t with `axis` fixed at `index` (no copy)."""
    from rtattn.runtime import export
    shape = t.shape[:axis] + t.shape[axis + 1:]
    strides = t.strides[:axis] + t.strides[axis + 1:]
    return export(t.ptr + index * t.strides[axis] * t.itemsize, shape, t.dtype, t.device_id, strides, owner=t)


def paged_strides(t, layout: str) -> tuple[int, int, int]:
    """(page, token-in-page, head) strides in elements for either cache layout."""
    if layout == "NHD":
        return t.strides[0], t.strides[1], t.strides[2]
    return t.strides[0], t.strides[2], t.strides[1]
