"""SharedPlan: one host plan per step for several wrappers that plan the same batch.

Tensor-parallel ranks hold a slice of the heads each, so their wrappers (one per device, all
with the same per-rank head counts, page size, bounds and grid) plan identical batches into
identical plans. SharedPlan runs the planner once into its own pinned buffer (portable: every
device's context may copy from it) and queues one host-to-device copy per wrapper, into that
wrapper's workspace on that wrapper's stream; each wrapper then runs (or replays its graphs)
on the plan as if it had planned it itself.

    plans = SharedPlan([w0, w1])                       # w_i = BatchDecodeWrapper(..., device=i)
    plans.plan(kv_indptr, kv_indices, kv_last_page_len, streams=[s0, s1])
    for w, s, t in zip(plans.wrappers, (s0, s1), tensors): w.run(*t, stream=s)

Like a wrapper's own plan(), the pinned buffers are used in turn (two), so planning step N+1
waits only for step N-1's copies. Page ids are checked against the smallest KV pool of the
wrappers. Wrappers on one device are allowed (a simulated split, tools/demo_tp.py).
"""
from __future__ import annotations

from rtattn.runtime import Device, Event, PinnedBuffer, libcuda
from rtattn.runtime.launch import check_stream, enter_stream, stream_handle
from rtattn.wrapper import BatchDecodeWrapper
from rtattn.wrapper_base import host_array

__all__ = ["SharedPlan"]


def plan_signature(w) -> dict:
    """What decides a wrapper's plan bytes and where its kernels read them: equal signatures,
    equal plans at equal offsets."""
    p = w.planner
    return {"planner bounds": p.bounds, "tile": p.tile, "causal": p.causal, "min_chunk": p.min_chunk,
            "plan layout": (p.layout.plan_bytes, tuple(sorted(p.layout.offsets.items()))),
            "page_size": w.page_size, "window": bool(w.spec.window), "kind": type(w).__name__}


class SharedPlan:
    def __init__(self, wrappers):
        self.wrappers = tuple(wrappers)
        if not self.wrappers:
            raise ValueError("wrappers: SharedPlan needs at least one wrapper")
        lead = self.wrappers[0]
        for i, w in enumerate(self.wrappers):
            if not hasattr(w, "_take_plan") or getattr(w, "ragged", False):
                raise TypeError(f"wrappers[{i}]: SharedPlan takes paged BatchDecodeWrapper / BatchPrefillWrapper "
                                f"objects, got {type(w).__name__}")
        want = plan_signature(lead)
        for i, w in enumerate(self.wrappers[1:], 1):
            got = plan_signature(w)
            diff = [k for k in want if want[k] != got[k]]
            if diff:
                raise ValueError(f"wrappers[{i}] plans differently from wrappers[0] ({', '.join(diff)} differ): "
                                 f"a shared plan needs the same per-rank heads, page size, bounds, grid and mode")
        self.planner, self.plan_bytes = lead.planner, lead.layout.plan_bytes
        self._pinned = tuple(PinnedBuffer(self.plan_bytes, lead.device) for _ in range(2))
        self._arrays = tuple(b.array for b in self._pinned)   # stable objects: the planner caches views
        # per slot, one event per wrapper: its copy out of that slot
        self._copied = tuple(tuple(Event(timing=False, device=w.device) for w in self.wrappers) for _ in range(2))
        self._in_flight = [False, False]
        self._slot = 0
        self.info = None

    def plan(self, kv_indptr, kv_indices, kv_last_page_len, qo_indptr=None, *, streams=None,
             window_left: int | None = None):
        """Plan one step once and copy it to every wrapper's workspace. Arguments as
        BatchDecodeWrapper.plan() (qo_indptr None: one query token per request; a prefill
        wrapper needs it). `streams`: one per wrapper (None: each device's legacy stream); each
        wrapper's run() goes on its stream, or is ordered after it."""
        lead = self.wrappers[0]
        n = len(self.wrappers)
        streams = [None] * n if streams is None else list(streams)
        if len(streams) != n:
            raise ValueError(f"streams: {len(streams)} given for {n} wrappers (one per wrapper)")
        for w, s in zip(self.wrappers, streams):   # each copy goes on a stream of its wrapper's device
            check_stream(stream_handle(s), w.device)
        window_left = lead._check_window(window_left)
        kv_indptr, kv_indices, kv_last_page_len = (host_array(a) for a in (kv_indptr, kv_indices, kv_last_page_len))
        if qo_indptr is None and not isinstance(lead, BatchDecodeWrapper):
            raise ValueError("qo_indptr: a prefill wrapper's plan needs the query offsets")
        qo_indptr = None if qo_indptr is None else host_array(qo_indptr)
        slot = self._slot
        if self._in_flight[slot]:   # the copies out of this buffer (two plans ago) may still be pending
            for ev in self._copied[slot]:
                ev.synchronize()
        pools = [w.planner.num_pages_pool for w in self.wrappers if w.planner.num_pages_pool is not None]
        own_pool = self.planner.num_pages_pool
        self.planner.num_pages_pool = min(pools) if pools else None   # every wrapper's caches bound it
        try:
            info = self.planner.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     out=self._arrays[slot], window_left=window_left)
        finally:
            self.planner.num_pages_pool = own_pool
        buf, nnz = self._pinned[slot], int(kv_indptr[-1])
        for w, s, ev in zip(self.wrappers, streams, self._copied[slot]):
            # one context entry for the copy and its event, as a wrapper's own plan() does
            h, prev = enter_stream(s, w.device)
            try:
                libcuda.copy_htod(w.workspace_ptr, buf.ptr, self.plan_bytes, h)
                libcuda.record_event(ev.handle, h)
            finally:
                Device.leave(prev)
            w._take_plan(info, window_left, nnz, buf)
        self._in_flight[slot] = True
        self._slot = slot ^ 1
        self.info = info
        return info
