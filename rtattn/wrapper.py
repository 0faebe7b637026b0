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

fp8 KV caches (kv_dtype="float8_e4m3fn" / "float8_e5m2"): run() takes k_scale / v_scale, each a
float (per tensor) or a CUDA float32 tensor of shape [1] (per tensor) or [H_kv] (per KV head);
attention then runs over k_cache * k_scale and v_cache * v_scale (the LSE too).
"""
from __future__ import annotations

import math
import numbers

from rtattn.codegen.cstruct import FieldWriter
from rtattn.families import decode as decode_family
from rtattn.kernels import decode_kernels
from rtattn.plan import devices as plan_devices
from rtattn.plan.inspector import Planner, PlanInfo
from rtattn.plan.layout import check_config, check_int
from rtattn.runtime import DeviceBuffer, current_device
from rtattn.runtime.launch import Params, stream_handle
from rtattn.tensors import (TensorImports, expect_inner_contiguous, expect_shape, expect_typed, expect_vector_aligned,
                            same_device)
from rtattn.wrapper_base import (KV_LAYOUTS, PlannedLaunch, PlannedWrapper, expect_lse_rows, expect_sinks, host_array,
                                 paged_strides, scalar_param, select)

# fp8 caches stay behind this switch until their GPU tier passes: on the H200 every fp8 decode
# kernel so far stopped with "an illegal instruction was encountered" (docs/perf-log.md, fp8 KV).
FP8_SCALE_MEMBERS = ("k_scale", "v_scale", "k_scale_stride", "v_scale_stride", "k_scale_f", "v_scale_f")


class BatchDecodeWrapper(PlannedWrapper):
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 max_batch: int, max_pages: int, max_qo_tokens: int | None = None,
                 variant="plain", dtype: str = "bfloat16", kv_dtype: str | None = None, kv_layout: str = "NHD",
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
        self.page_size, self.kv_layout = page_size, kv_layout
        self.spec = decode_family.spec_for(variant, dtype, head_dim, self.group, self.device.arch, kv_dtype=kv_dtype)
        # q's, the caches' and the output's element types (kv_dtype None: q's)
        self.dtype, self.kv_dtype, self.o_dtype = self.spec.q_dtype, self.spec.kv_dtype, self.spec.o_dtype
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
        self._setup_buffers(workspace)
        self._template, self._write = self._argument_template()
        self._eager, self._eager_key = None, None
        self._imports = TensorImports(self.device.ordinal)
        sc = 1.0 / math.sqrt(head_dim)
        self._default_scale = (sc, sc * 1.4426950408889634)
        self._per_page = (page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else (num_kv_heads, page_size, head_dim)
        self._no_scales = self._scales(None, None, 0)   # what run() packs when given no scales

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
        window_left = self._check_window(window_left)
        kv_indptr, kv_indices, kv_last_page_len = (host_array(a) for a in (kv_indptr, kv_indices, kv_last_page_len))
        qo_indptr = None if qo_indptr is None else host_array(qo_indptr)   # None: decode
        return self._plan_and_copy(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, stream, window_left)

    # ------------------------------------------------------------------ run
    def run(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
            params: dict | None = None, k_scale=None, v_scale=None):
        """Attention for the planned batch. `k_cache`/`v_cache`: [pages, page_size, H_kv, D] (NHD)
        or [pages, H_kv, page_size, D] (HND); or one `kv_cache` [pages, 2, ...] as `k_cache`.
        `out` (optional) [tokens, H_qo, D]; `lse`: None, True (allocate) or a float32 [tokens, H_qo]
        tensor. `k_scale`/`v_scale`: fp8 caches only (module docstring). Returns out, or
        (out, lse) when lse was asked for."""
        launch = self._bind(self._reusable(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                            k_scale, v_scale)
        launch()
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    def prepare(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
                params: dict | None = None, k_scale=None, v_scale=None) -> "DecodeLaunch":
        """Validate everything and pack the kernel arguments into a launch of its own; calling it
        enqueues the kernels. Graph capture calls it once and replays; every pointer is fixed in it.
        q, out and lse may hold more rows than the plan's tokens (size them for the largest batch
        the launch will replay): later plans may use up to that many, and a plan with more is
        refused before the replay."""
        return self._bind(self._new_launch(), q, k_cache, v_cache, out, lse, stream, sm_scale, params,
                          k_scale, v_scale, exact=False)

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
        if v_cache is None:
            ka, va = imp.get("kv_cache", k_cache, h, self._derive_kv_pair)
        else:
            ka = imp.get("k_cache", k_cache, h, self._derive_cache)
            va = imp.get("v_cache", v_cache, h, self._derive_cache)
        pool = self.planner.num_pages_pool
        if pool is None or ka[0] < pool or va[0] < pool:   # a smaller cache than seen: check it, learn it
            self._learn_pool(((ka[1], ka[0]), (va[1], va[0])))
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
            scale = (sc, sc * 1.4426950408889634)
        kv_scales = self._no_scales if k_scale is None and v_scale is None else self._scales(k_scale, v_scale, h)
        extra = self._extra(params, h) if (params or self._param_names) else ()
        imp.order(h)
        self._write(launch.args.buffer,
                    qa[3:] + ka[3:] + va[3:] + oa[3:] + (lse_ptr,) + scale + kv_scales + extra)
        launch.stream, launch.out, launch.lse, launch.window_left = stream, out, lse, self.window_left
        launch.tokens = tokens   # rows q, out and lse hold: the most any replayed plan may use
        launch.keep = (q, k_cache, v_cache, out, lse, params, k_scale, v_scale)
        return launch

    # What run() packs from a tensor, derived once per tensor object (TensorImports): plain numbers,
    # led by (rows or pages, name, shape) for the per-call checks against the plan.
    def _derive_rows(self, name, t):
        """q / out [tokens, H_qo, D]: (..., ptr, token stride, head stride)."""
        H, D = self.num_qo_heads, self.head_dim
        t = _checked(name, t, self.o_dtype if name == "out" else self.dtype, 3, self.device.ordinal)
        expect_shape(name, t, (None, H, D))
        expect_inner_contiguous(name, t)
        if name == "q":
            expect_vector_aligned(name, t)
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

    def _cache_fields(self, name, t):
        expect_shape(name, t, (None,) + self._per_page)
        expect_inner_contiguous(name, t)
        expect_vector_aligned(name, t)
        return (t.shape[0], name, t.shape, t.ptr) + paged_strides(t, self.kv_layout)

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


class DecodeLaunch(PlannedLaunch):
    """A validated launch of the decode (and merge) kernels: calling it enqueues them."""


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
