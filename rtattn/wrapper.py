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

import numpy as np

from rtattn.families import decode as decode_family
from rtattn.kernels import decode_kernels
from rtattn.plan import devices as plan_devices
from rtattn.plan.inspector import Planner, PlanInfo
from rtattn.plan.layout import check_config, check_int
from rtattn.runtime import current_device
from rtattn.wrapper_base import KV_LAYOUTS, PlannedLaunch, PlannedWrapper, host_array


class BatchDecodeWrapper(PlannedWrapper):
    # Batch-invariant mode: the kernel folds each item's chunks (AttentionSpec.invariant) and the
    # planner cuts items on chunk boundaries only (Planner chunk_runs).
    folds_chunks = True

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 max_batch: int, max_pages: int, max_qo_tokens: int | None = None, max_qo_len: int | None = None,
                 variant="plain", dtype: str = "bfloat16", kv_dtype: str | None = None, kv_layout: str = "NHD",
                 mode: str = "auto", chunk_tokens: int | None = None, pdl: bool = True, num_ctas: int | None = None,
                 fused_merge: bool = False, device=None, workspace=None,
                 num_pages_pool: int | None = None):
        """`num_pages_pool`: pages in the KV cache pool, if known up front; plan() refuses page
        ids >= it. Without it, the pool is the smallest cache prepare()/run() has been given.
        `max_qo_len` (multi-token decode): the longest query plan() accepts; a built-in variant's
        tile then holds max_qo_len x group rows where the kernel has them (32 at head_dim <= 128).
        rtattn.family_wrapper.multi_token_wrapper picks between this and the prefill family."""
        check_config(num_qo_heads, num_kv_heads, head_dim, page_size, num_ctas=num_ctas)
        for name, v in (("num_pages_pool", num_pages_pool), ("max_qo_len", max_qo_len)):
            if v is not None:
                check_int(name, v)
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.device = current_device(device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.page_size, self.kv_layout = page_size, kv_layout
        self.spec = decode_family.spec_for(variant, dtype, head_dim, self.group, self.device.arch, kv_dtype=kv_dtype,
                                           rows=self.group * (max_qo_len or 1))
        chunk_runs = mode == "batch-invariant" and self.folds_chunks
        if chunk_runs:
            self.spec = decode_family.invariant_build(self.spec, self.device.arch)
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
                               max_qo_len=1 if one_token else max_qo_len, chunk_runs=chunk_runs)
        block = 16 * self.spec.num_warps   # the kernel's KV block: chunks must start blocks
        if chunk_runs and self.planner.bounds.chunk_tokens % block:
            raise ValueError(f"chunk_tokens={self.planner.bounds.chunk_tokens} is not a multiple of the decode "
                             f"kernel's KV block ({block} tokens, num_warps={self.spec.num_warps})")
        self._pool_given = num_pages_pool is not None   # else learnt from the caches (_check_pool)
        self._setup_buffers(workspace)

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
        if window_left is not None or self.spec.window:
            window_left = self._check_window(window_left)
        nd = np.ndarray   # (numpy arrays as they are: host_array's first case, without the calls)
        if type(kv_indptr) is not nd or type(kv_indices) is not nd or type(kv_last_page_len) is not nd:
            kv_indptr, kv_indices, kv_last_page_len = (host_array(kv_indptr), host_array(kv_indices),
                                                       host_array(kv_last_page_len))
        if qo_indptr is not None and type(qo_indptr) is not nd:   # None: decode
            qo_indptr = host_array(qo_indptr)
        return self._plan_and_copy(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, stream, window_left)


class DecodeLaunch(PlannedLaunch):
    """A validated launch of the decode (and merge) kernels: calling it enqueues them."""


BatchDecodeWrapper.launch_type = DecodeLaunch
