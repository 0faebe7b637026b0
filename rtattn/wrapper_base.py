"""What every planned attention wrapper shares (decode, prefill): the device workspace, the two
pinned plan buffers and their async copy, the window and KV-pool checks, and the per-call path
of run()/prepare(): tensors imported once per object (TensorImports) and checked there, what
depends on the plan checked every call, the per-call members of the one Params struct written
in place into a packed template (FieldWriter), launches (rtattn.runtime.launch) of prepared
kernel calls that check their plan.

A subclass builds `self.planner` and `self.kernels` (anything with `.rendered.params` and
`.calls()`), sets the head/page attributes, `spec`, `fused_merge` and `_pool_given`
(num_pages_pool known up front), then calls `_setup_buffers(workspace)`.

LSE convention: natural logarithm (base e) of the sum of the attention weights' exponentials,
log sum_j exp(s_j), with s_j the logits after sm_scale (and the variant's logits transform).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from rtattn.codegen.cstruct import FieldWriter
from rtattn.codegen.spec import AttentionSpec
from rtattn.plan.inspector import check_window
from rtattn.runtime import Device, DeviceBuffer, Event, PinnedBuffer, libcuda, memset_d32
from rtattn.runtime import launch as launch_path
from rtattn.runtime.launch import Launch, Params, stream_handle
from rtattn.tensors import (TensorImports, cuda_tensor, expect_inner_contiguous, expect_shape, expect_typed,
                            expect_vector_aligned, same_device)

KV_LAYOUTS = ("NHD", "HND")
FP8_SCALE_MEMBERS = ("k_scale", "v_scale", "k_scale_stride", "v_scale_stride", "k_scale_f", "v_scale_f")
LOG2E = 1.4426950408889634


class PlannedWrapper:
    spec: AttentionSpec
    launch_type: type   # the family's PlannedLaunch subclass

    def _setup_buffers(self, workspace) -> None:
        self.layout = self.planner.layout
        # Two pinned plan buffers, used in turn: plan() for step N+1 fills one while step N's
        # copy (queued behind step N-1's kernels) may still be pending from the other, so the
        # host only waits on the copy of two steps ago instead of on the GPU's current work.
        self._pinned = tuple(PinnedBuffer(self.layout.plan_bytes, self.device) for _ in range(2))
        self._pinned_arrays = tuple(b.array for b in self._pinned)  # stable objects: the planner caches views
        self._copied = tuple(Event(timing=False, device=self.device) for _ in range(2))
        self._in_flight = [False, False]
        self._slot = 0
        self.pinned = self._pinned[0]   # the buffer holding the latest plan
        self.workspace = self._workspace(workspace)
        self._counters = self.workspace_ptr + self.layout.merge_counters_offset(self.num_qo_heads, self.head_dim)
        memset_d32(self._counters, 0, self.layout.merge_counters_bytes(self.num_qo_heads) // 4, self.device)
        self._fixed = self._fixed_params()
        self._param_names = frozenset(p.name for p in self.spec.params)
        self._may_split = self.planner.bounds.max_merge_rows > 0   # naive plans never need the merge kernel
        self.info = None
        self._nnz = 0   # pages the latest plan reads (kv_indptr[-1])
        self.window_left: int | None = None   # the planned window (sliding-window variants)
        self._template, self._write = self._argument_template()
        self._eager = {}   # (merge kernel, pdl) -> the launch run() rebinds
        self._imports = TensorImports(self.device.ordinal)
        sc = 1.0 / math.sqrt(self.head_dim)
        self._default_scale = (sc, sc * LOG2E)
        ps, hk, d = self.page_size, self.num_kv_heads, self.head_dim
        self._per_page = (ps, hk, d) if self.kv_layout == "NHD" else (hk, ps, d)
        self._no_scales = self._scales(None, None, 0)   # what run() packs when given no scales

    def _workspace(self, workspace):
        need = self.planner.workspace_bytes()
        if workspace is None:
            return DeviceBuffer(need, self.device)
        t = cuda_tensor("workspace", workspace, device_id=self.device.ordinal)
        same_device({"workspace": t}, self.device.ordinal)
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
        # One context entry (and stream check) for the wait, the copy and its event: the driver
        # calls are direct, ~1 us each, not ~3-6 through Event/memcpy_htod_async (each re-enters)
        h, prev = launch_path.enter_stream(stream, self.device)
        try:
            slot = self._slot
            ev = self._copied[slot].handle
            if self._in_flight[slot]:  # this buffer's copy (two plans ago) may not have run yet
                libcuda.wait_event(ev)
            buf = self._pinned[slot]
            info = self.planner.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     out=self._pinned_arrays[slot], window_left=window_left)
            libcuda.copy_htod(self.workspace_ptr, buf.ptr, self.layout.plan_bytes, h)
            libcuda.record_event(ev, h)
        finally:
            Device.leave(prev)
        self._in_flight[slot] = True
        self._slot = slot ^ 1
        self._take_plan(info, window_left, kv_indptr.item(-1), buf)   # (a host ndarray by now)
        return info

    def _take_plan(self, info, window_left, nnz: int, pinned) -> None:
        """The plan run() checks against from now on (its copy into the workspace is queued):
        this wrapper's own, or one planned once for several (rtattn.shared_plan)."""
        self.info, self.window_left, self._nnz, self.pinned = info, window_left, nnz, pinned

    # ------------------------------------------------------------------ run
    def run(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
            params: dict | None = None, k_scale=None, v_scale=None):
        """Attention for the planned batch. q [tokens, H_qo, D]; the caches as the wrapper's class
        documents (paged: [pages, page_size, H_kv, D] for NHD, [pages, H_kv, page_size, D] for HND,
        or one kv_cache [pages, 2, ...] as k_cache). `out` (optional) [tokens, H_qo, D]; `lse`:
        None, True (allocate) or a float32 [tokens, H_qo] tensor. `k_scale`/`v_scale`: fp8 caches
        only (BatchDecodeWrapper). Returns out, or (out, lse) when lse was asked for."""
        launch = self._bind(self._reusable(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                            k_scale, v_scale)
        launch()
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    def prepare(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
                params: dict | None = None, k_scale=None, v_scale=None) -> "PlannedLaunch":
        """Validate everything and pack the kernel arguments into a launch of its own; calling it
        enqueues the kernels. Graph capture calls it once and replays; every pointer is fixed in it.
        q, out and lse may hold more rows than the plan's tokens (size them for the largest batch
        the launch will replay): later plans may use up to that many, and a plan with more is
        refused before the replay."""
        return self._bind(self._new_launch(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                          k_scale, v_scale, exact=False)

    def _new_launch(self, merge: bool | None = None) -> "PlannedLaunch":
        """`merge` None: the merge kernel follows whenever a plan may split KV."""
        args = Params(self._template)
        if merge is None:
            merge = self._may_split and not self.fused_merge
        calls = self.kernels.calls(args, self.num_ctas, self.num_kv_heads, merge=merge, pdl=self.pdl)
        return self.launch_type(self, calls, args)

    def _reusable(self, keep_merge: bool = False) -> "PlannedLaunch":
        """The launch run() (and DecodeGraphs.step()) rebind on every call: its argument buffer is
        rewritten each time, which is safe because the driver copies arguments at enqueue. For
        run() it launches the merge kernel only when the current plan has merge rows: the merge of
        a plan with none has nothing to do (one driver call and one grid less per layer).
        `keep_merge` (DecodeGraphs.step) keeps it whenever a plan may split, as prepare()'s launches
        do (_new_launch's default): one captured topology serves every later plan."""
        info = self.info
        merge = self._may_split and not self.fused_merge and (
            keep_merge or (info is not None and info.num_merge_rows > 0))
        key = (merge, self.pdl)
        launch = self._eager.get(key)
        if launch is None:
            launch = self._eager[key] = self._new_launch(merge=merge)
        return launch

    def _bind(self, launch: "PlannedLaunch", q, k_cache, v_cache, out, lse, stream, sm_scale, params,
              k_scale=None, v_scale=None, exact: bool = True):
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
        ka, va = self._caches(k_cache, v_cache, h)
        if out is None:
            out = DeviceBuffer(max(n_tok, 1) * self.num_qo_heads * self.head_dim * 2, self.device).as_tensor(
                self.o_dtype, (n_tok, self.num_qo_heads, self.head_dim), stream=stream)
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
            scale = (sc, sc * LOG2E)
        kv_scales = self._no_scales if k_scale is None and v_scale is None else self._scales(k_scale, v_scale, h)
        extra = self._extra(params, h) if (params or self._param_names) else ()
        imp.order(h)
        self._write(launch.args.buffer,
                    qa[3:] + ka[3:] + va[3:] + oa[3:] + (lse_ptr,) + scale + kv_scales + extra)
        launch.stream, launch.out, launch.lse, launch.window_left = stream, out, lse, self.window_left
        launch.tokens = tokens   # rows q, out and lse hold: the most any replayed plan may use
        launch.keep = (q, k_cache, v_cache, out, lse, params, k_scale, v_scale)
        return launch

    def _caches(self, k_cache, v_cache, h):
        """The paged K and V caches' derived fields (pages, name, shape, ptr, 3 strides); a cache
        with fewer pages than seen so far is checked against the plan and bounds the pool."""
        imp = self._imports
        if v_cache is None:
            ka, va = imp.get("kv_cache", k_cache, h, self._derive_kv_pair)
        else:
            ka = imp.get("k_cache", k_cache, h, self._derive_cache)
            va = imp.get("v_cache", v_cache, h, self._derive_cache)
        pool = self.planner.num_pages_pool
        if pool is None or ka[0] < pool or va[0] < pool:   # a smaller cache than seen: check it, learn it
            self._learn_pool(((ka[1], ka[0]), (va[1], va[0])))
        return ka, va

    # What run() packs from a tensor, derived once per tensor object (TensorImports): plain numbers,
    # led by (rows or pages, name, shape) for the per-call checks against the plan.
    def _derive_rows(self, name, t):
        """q / out [tokens, H_qo, D]: (..., ptr, token stride, head stride). q's rows are read with
        16-byte loads, out's written two elements at a time."""
        H, D = self.num_qo_heads, self.head_dim
        t = _checked(name, t, self.o_dtype if name == "out" else self.dtype, 3, self.device.ordinal)
        expect_shape(name, t, (None, H, D))
        expect_inner_contiguous(name, t)
        expect_vector_aligned(name, t, 16 if name == "q" else 4)
        return (t.shape[0], name, t.shape, t.ptr, t.strides[0], t.strides[1])

    def _derive_lse(self, name, t):
        t = _checked(name, t, "float32", 2, self.device.ordinal)
        expect_shape(name, t, (None, self.num_qo_heads))
        expect_lse_rows(t, self.num_qo_heads)
        return (t.shape[0], name, t.shape, t.ptr)

    def _derive_cache(self, name, t):
        """One K or V cache: (..., ptr, page stride, token stride, head stride)."""
        t = _checked(name, self._kv_typed(name, t), self.kv_dtype, 4, self.device.ordinal)
        return self._cache_fields(name, t)

    def _derive_kv_pair(self, name, t):
        """One [pages, 2, ...] cache: K at index 0, V at 1 of dimension 1."""
        t = _checked("kv_cache", self._kv_typed("kv_cache", t), self.kv_dtype, 5, self.device.ordinal)
        expect_shape("kv_cache", t, (None, 2) + self._per_page)
        return tuple(self._cache_fields(f"kv_cache[:, {i}]", select(t, 1, i)) for i in (0, 1))

    def _kv_typed(self, name, t):
        if t.dtype != self.kv_dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, but this wrapper was built for kv_dtype={self.kv_dtype} "
                            f"caches (pass kv_dtype={t.dtype!r} to BatchDecodeWrapper for such a cache)")
        return t

    def _cache_fields(self, name, t):
        expect_shape(name, t, (None,) + self._per_page)
        expect_inner_contiguous(name, t)
        expect_vector_aligned(name, t)
        return (t.shape[0], name, t.shape, t.ptr) + paged_strides(t, self.kv_layout)

    def _scales(self, k_scale, v_scale, stream_handle: int) -> tuple:
        """fp8 dequantization scales as FP8_SCALE_MEMBERS values (pointers, strides, host
        factors); () for a 16-bit cache, which takes none."""
        given = (("k_scale", k_scale), ("v_scale", v_scale))
        if not self.spec.kv_is_fp8:
            bad = [n for n, x in given if x is not None]
            if bad:
                raise ValueError(f"{bad[0]} applies to fp8 KV caches; this wrapper's kv_dtype is {self.kv_dtype}")
            return ()
        ptrs, strides, factors = [], [], []
        for name, x in given:
            ptr, stride, factor = 0, 0, 1.0
            if isinstance(x, numbers.Real) and not isinstance(x, bool):
                factor = float(x)
                if not math.isfinite(factor):
                    raise ValueError(f"{name}={x!r} is not finite")
            elif x is not None:
                ptr, stride = self._imports.get(name, x, stream_handle, self._derive_scale)
            ptrs.append(ptr), strides.append(stride), factors.append(factor)
        return tuple(ptrs + strides + factors)

    def _derive_scale(self, name, t) -> tuple[int, int]:
        """A scale tensor: float32 [1] (per tensor) or [H_kv] (per KV head): (ptr, element stride)."""
        t = _checked(name, t, "float32", 1, self.device.ordinal)
        if t.shape not in ((1,), (self.num_kv_heads,)):
            raise ValueError(f"{name} has shape {list(t.shape)}, expected [1] (per tensor) or "
                             f"[{self.num_kv_heads}] (per KV head)")
        return t.ptr, (t.strides[0] if t.shape[0] > 1 else 0)

    def _extra(self, params: dict | None, stream_handle: int) -> tuple:
        """Variant parameters in member order: scalars as numbers, tensors as CUDA pointers.
        The window comes from the plan (params may repeat it, not change it)."""
        params = self._with_planned_window(params or {})
        self._check_param_names(params)
        out = []
        for p in self.spec.params:
            v = params[p.name]
            if p.is_pointer:
                derive = self._derive_sinks if p.name == "sinks" and self.spec.sinks else _pointer_of
                out.append(self._imports.get(f"params[{p.name!r}]", v, stream_handle, derive))
            else:
                out.append(scalar_param(p, v))
        return tuple(out)

    def _derive_sinks(self, name, t) -> int:
        expect_sinks(_checked(name, t, "float32", 1, self.device.ordinal), self.num_qo_heads)
        return t.ptr

    # ------------------------------------------------------------------ checks
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

    # ------------------------------------------------------------------ packing
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
        per_call += FP8_SCALE_MEMBERS if self.spec.kv_is_fp8 else ()
        zeros = {n: 0 for n in per_call}
        extra = {p.name: 0 for p in self.spec.params} or {"unused_": 0}
        template = ps.pack(**zeros, extra=extra, **self._fixed)
        writer = FieldWriter(ps, per_call + tuple(f"extra.{p.name}" for p in self.spec.params))
        return template, writer


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



def _checked(name: str, t, dtype: str, ndim: int, device_id: int):
    expect_typed(name, t, dtype, ndim)
    same_device({name: t}, device_id)
    return t


def _tokens_mismatch(derived, n_tok: int, exact: bool = True):
    _, name, shape = derived[:3]
    want = [n_tok] + list(shape[1:])
    least = "" if exact else "at least "
    raise ValueError(f"{name} has shape {list(shape)}, expected {least}{want} (the plan has {n_tok} query tokens)")


def _pointer_of(name, t) -> int:
    return t.ptr
