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
from rtattn.codegen.cstruct import FieldWriter
from rtattn.runtime import DeviceBuffer, Event, PinnedBuffer, current_device, memcpy_htod_async, memset_d32
from rtattn.runtime.launch import Launch, Params, stream_handle
from rtattn.tensors import (TensorImports, cuda_tensor, expect_inner_contiguous, expect_shape, expect_vector_aligned,
                            same_device)

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
                 mode: str = "auto", chunk_tokens: int | None = None, pdl: bool = True, num_ctas: int | None = None,
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
        # Batch-invariant partial storage scales with the longest query (splits are fixed, not
        # bounded by the grid): a decode wrapper (no max_qo_tokens) sizes it for one token per request.
        one_token = mode == "batch-invariant" and max_qo_tokens is None
        max_qo_tokens = max_batch if max_qo_tokens is None else max_qo_tokens
        self.planner = Planner(max_batch, max_qo_tokens, max_pages, num_qo_heads, num_kv_heads, head_dim, page_size,
                               device=plan_devices.from_props(self.device.props), mode=mode,
                               num_ctas=self.num_ctas, max_rows=self.spec.rows, chunk_tokens=chunk_tokens,
                               causal=self.spec.causal, num_pages_pool=num_pages_pool,
                               max_qo_len=1 if one_token else None)
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
        self._template, self._write = self._argument_template()
        self._eager, self._eager_key = None, None
        self._imports = TensorImports(self.device.ordinal)
        sc = 1.0 / math.sqrt(head_dim)
        self._default_scale = (sc, sc * 1.4426950408889634)
        self._per_page = (page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else (num_kv_heads, page_size, head_dim)
        self._param_names = frozenset(p.name for p in self.spec.params)
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
        launch = self._bind(self._reusable(), q, k_cache, v_cache, out, lse, stream, sm_scale, params)
        launch()
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    def prepare(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
                params: dict | None = None) -> "DecodeLaunch":
        """Validate everything and pack the kernel arguments into a launch of its own; calling it
        enqueues the kernels. Graph capture calls it once and replays; every pointer is fixed in it.
        q, out and lse may hold more rows than the plan's tokens (size them for the largest batch
        the launch will replay): later plans may use up to that many, and a plan with more is
        refused before the replay."""
        return self._bind(self._new_launch(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                          exact=False)

    def _new_launch(self) -> "DecodeLaunch":
        args = Params(self._template)
        calls = self.kernels.calls(args, self.num_ctas, self.num_kv_heads,
                                   merge=self._may_split and not self.fused_merge, pdl=self.pdl)
        return DecodeLaunch(self, calls, args)

    def _reusable(self) -> "DecodeLaunch":
        """The launch run() (and DecodeGraphs.step()) rebind on every call: its argument buffer is
        rewritten each time, which is safe because the driver copies arguments at enqueue."""
        key = (self._may_split and not self.fused_merge, self.pdl)
        if self._eager is None or self._eager_key != key:
            self._eager, self._eager_key = self._new_launch(), key
        return self._eager

    def _bind(self, launch: "DecodeLaunch", q, k_cache, v_cache, out, lse, stream, sm_scale, params,
              exact: bool = True):
        """Validate the tensors against the plan and write their pointers into `launch`'s arguments.
        Per tensor object, the DLPack import and the checks that depend on it alone run once
        (TensorImports); what depends on the plan (token count, pages read) is checked every call.
        `exact`: q/out/lse hold exactly the plan's tokens (run()), else at least (prepare())."""
        info = self.info
        if info is None:
            raise RuntimeError("run() before plan(): call plan() for this step first")
        n_tok = info.num_qo_tokens
        h = stream_handle(stream)
        imp = self._imports
        qa = imp.get("q", q, h, self._derive_rows)
        if qa[0] != n_tok and (exact or qa[0] < n_tok):
            _tokens_mismatch(qa, n_tok, exact)
        if v_cache is None:
            ka, va = imp.get("kv_cache", k_cache, h, self._derive_kv_pair)
        else:
            ka = imp.get("k_cache", k_cache, h, self._derive_cache)
            va = imp.get("v_cache", v_cache, h, self._derive_cache)
        pool = self.planner.num_pages_pool
        if pool is None or ka[0] < pool or va[0] < pool:   # a smaller cache than seen: check it, learn it
            for a in (ka, va):
                self._check_pool(a[1], a[0])
            self.planner.num_pages_pool = min(ka[0], va[0], *(() if pool is None else (pool,)))
        if out is None:
            out = DeviceBuffer(max(n_tok, 1) * self.num_qo_heads * self.head_dim * 2, self.device).as_tensor(
                self.dtype, (n_tok, self.num_qo_heads, self.head_dim), stream=stream)
        oa = imp.get("out", out, h, self._derive_rows)
        if oa[0] != n_tok and (exact or oa[0] < n_tok):
            _tokens_mismatch(oa, n_tok, exact)
        tokens = min(qa[0], oa[0])
        lse_ptr = 0
        if lse is True:
            lse = DeviceBuffer(max(n_tok, 1) * self.num_qo_heads * 4, self.device).as_tensor(
                "float32", (n_tok, self.num_qo_heads), stream=stream)
        if lse is not None:
            la = imp.get("lse", lse, h, self._derive_lse)
            if la[0] != n_tok and (exact or la[0] < n_tok):
                _tokens_mismatch(la, n_tok, exact)
            lse_ptr, tokens = la[3], min(tokens, la[0])
        if sm_scale is None:
            scale = self._default_scale
        else:
            sc = float(sm_scale)
            scale = (sc, sc * 1.4426950408889634)
        extra = self._extra(params, h) if (params or self.spec.params) else ()
        imp.order(h)
        self._write(launch.args.buffer, qa[3:] + ka[3:] + va[3:] + oa[3:] + (lse_ptr,) + scale + extra)
        launch.stream, launch.out, launch.lse, launch.window_left = stream, out, lse, self.window_left
        launch.tokens = tokens   # rows q, out and lse hold: the most any replayed plan may use
        launch.keep = (q, k_cache, v_cache, out, lse, params)
        return launch

    # What run() packs from a tensor, derived once per tensor object (TensorImports): plain numbers,
    # led by (rows or pages, name, shape) for the per-call checks against the plan.
    def _derive_rows(self, name, t):
        """q / out [tokens, H_qo, D]: (..., ptr, token stride, head stride)."""
        H, D = self.num_qo_heads, self.head_dim
        t = _checked(name, t, self.dtype, 3, self.device.ordinal)
        expect_shape(name, t, (None, H, D))
        expect_inner_contiguous(name, t)
        if name == "q":
            expect_vector_aligned(name, t)
        return (t.shape[0], name, t.shape, t.ptr, t.strides[0], t.strides[1])

    def _derive_lse(self, name, t):
        t = _checked(name, t, "float32", 2, self.device.ordinal)
        expect_shape(name, t, (None, self.num_qo_heads))
        if t.strides != (self.num_qo_heads, 1):
            raise ValueError(f"lse must be contiguous [tokens, heads], got strides {t.strides}")
        return (t.shape[0], name, t.shape, t.ptr)

    def _derive_cache(self, name, t):
        """One K or V cache: (..., ptr, page stride, token stride, head stride)."""
        t = _checked(name, t, self.dtype, 4, self.device.ordinal)
        return self._cache_fields(name, t)

    def _derive_kv_pair(self, name, t):
        """One [pages, 2, ...] cache: K at index 0, V at 1 of dimension 1."""
        t = _checked("kv_cache", t, self.dtype, 5, self.device.ordinal)
        expect_shape("kv_cache", t, (None, 2) + self._per_page)
        return tuple(self._cache_fields(f"kv_cache[:, {i}]", _select(t, 1, i)) for i in (0, 1))

    def _cache_fields(self, name, t):
        expect_shape(name, t, (None,) + self._per_page)
        expect_inner_contiguous(name, t)
        expect_vector_aligned(name, t)
        return (t.shape[0], name, t.shape, t.ptr) + _paged_strides(t, self.kv_layout)

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

    def _extra(self, params: dict | None, stream_handle: int) -> tuple:
        """Variant parameters in member order: scalars as numbers, tensors as CUDA pointers.
        The window comes from the plan (params may repeat it, not change it)."""
        params = params or {}
        if self.spec.window:
            given = params.get("window_left", self.window_left)
            if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given != self.window_left:
                raise ValueError(f"params['window_left']={given!r} disagrees with the planned "
                                 f"window_left={self.window_left} (plan(..., window_left=N) sets it)")
            params = {**params, "window_left": self.window_left}
        names = self._param_names
        if len(params) != len(names) or any(n not in params for n in names):
            unknown = sorted(set(params) - set(names))
            missing = sorted(set(names) - set(params))
            raise ValueError(f"variant {self.spec.variant!r} takes parameters {sorted(names)}; "
                             f"missing {missing}, unknown {unknown}")
        out = []
        for p in self.spec.params:
            v = params[p.name]
            if p.is_pointer:
                derive = self._derive_sinks if p.name == "sinks" and self.spec.sinks else _pointer_of
                out.append(self._imports.get(f"params[{p.name!r}]", v, stream_handle, derive))
            else:
                x = float(v) if p.c_type == "float" else int(v)
                if p.name == "soft_cap" and not 0 < x < math.inf:
                    raise ValueError(f"params['soft_cap']={v!r}: the cap must be a positive finite number")
                out.append(x)
        return tuple(out)

    def _derive_sinks(self, name, t) -> int:
        """Built-in sinks: float32 [H_qo], contiguous."""
        t = _checked(name, t, "float32", 1, self.device.ordinal)
        expect_shape(name, t, (self.num_qo_heads,))
        if t.strides != (1,):
            raise ValueError(f"{name} must be contiguous, got strides {t.strides}")
        return t.ptr

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

    def _argument_template(self):
        """The packed argument struct with every fixed member set and the per-call ones zero, and
        the writer of the per-call members (tensor pointers and strides, scales, variant params)."""
        ps = self.kernels.rendered.params
        per_call = ("q", "q_stride_tok", "q_stride_head",
                    "k_cache", "k_stride_page", "k_stride_tok", "k_stride_head",
                    "v_cache", "v_stride_page", "v_stride_tok", "v_stride_head",
                    "o", "o_stride_tok", "o_stride_head", "lse", "sm_scale", "sm_scale_log2")
        zeros = {n: 0 for n in per_call}
        extra = {p.name: 0 for p in self.spec.params} or {"unused_": 0}
        template = ps.pack(**zeros, extra=extra, **self._fixed)
        writer = FieldWriter(ps, per_call + tuple(f"extra.{p.name}" for p in self.spec.params))
        return template, writer


class DecodeLaunch(Launch):
    """A validated launch of the decode (and merge) kernels: calling it enqueues them.
    `args` is its argument buffer; `out`/`lse` what run() returns."""

    def __init__(self, wrapper: BatchDecodeWrapper, calls, args: Params):
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
        super().__call__(stream)


def _checked(name: str, t, dtype: str, ndim: int, device_id: int):
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} has shape {t.shape}, expected {ndim} dimensions")
    same_device({name: t}, device_id)
    return t


def _tokens_mismatch(derived, n_tok: int, exact: bool = True):
    _, name, shape = derived[:3]
    want = [n_tok] + list(shape[1:])
    least = "" if exact else "at least "
    raise ValueError(f"{name} has shape {list(shape)}, expected {least}{want} (the plan has {n_tok} query tokens)")


def _pointer_of(name, t) -> int:
    return t.ptr


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
