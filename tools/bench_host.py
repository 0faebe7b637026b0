#!/usr/bin/env python3
"""Host cost of the per-layer path, without a GPU: rtattn's real launch code against a stub
libcuda whose calls return at once (tools/stub_libcuda.c), so what is timed is Python and ctypes.

    python tools/bench_host.py [--layers 32] [--batches 1,16,64,256] [--reps 2000] [--families decode,prefill]

Per family and batch: µs per call of run() (bind + enqueue of the attention and merge kernels)
and of DecodeGraphs.step(): `step` the default pool (bind + graph launch: one exec per layer),
`step1` max_execs=1 (bind + kernel-node updates + graph launch, one exec updated per layer), each through the direct ctypes driver entry and through cuda.bindings; plus prepare()
and plan() (its pinned buffers, copy and event through the stub driver). decode: one query token per request; prefill: BatchPrefillWrapper on 4 query tokens
per request (multi-token verification), causal. The stream is a foreign stream object (a torch-like `.cuda_stream`), as
bench_overhead passes torch's; `run-h` is run() given the raw handle instead. The device, kernels and memory are the CPU tier's fakes (tests/fakes.py); tensors are
rtattn views. Host time only: the driver's own work and framework tensors (torch's data_ptr,
current stream) are not in it -- tools/bench_overhead.py measures those on the GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import stub_driver

ROOT = Path(__file__).resolve().parent.parent
PREFILL_QO = 4   # query tokens per request of the prefill rows






class _TorchLikeStream:
    """A foreign stream object as torch's: the handle behind a property."""

    def __init__(self, handle: int):
        self._h = handle

    @property
    def cuda_stream(self) -> int:
        return self._h


def per_call_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):   # best of 5 rounds: the least disturbed by this machine's other work
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--families", type=lambda s: s.split(","), default=["decode", "prefill"])
    args = ap.parse_args(argv)
    if not stub_driver.active():
        return stub_driver.reexec_with_stub(__file__, sys.argv[1:] if argv is None else argv)

    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import fakes
    from rtattn import prefill_wrapper as PW
    from rtattn import wrapper as W
    from rtattn.graphs import DecodeGraphs
    from rtattn.plan.layout import indptr_from_lengths, paged_kv
    from rtattn.runtime import export, libcuda
    from rtattn.runtime import launch as launch_mod

    from rtattn.runtime import Device, Event, PinnedBuffer
    real_enqueue = launch_mod.enqueue
    real_copies = (libcuda.copy_htod, libcuda.record_event, libcuda.wait_event)
    dev = fakes.fake_device()
    dev.enter = Device(0).set_current().enter   # the real context check; current already, as under torch
    dev.streams_checked.add(0x5000)    # the stream: the stub's, checked once (as a real device remembers it)
    fakes.install_prefill(stub_driver.Patch(), device=dev)
    fakes.install(stub_driver.Patch(), fakes.FakeKernels, device=dev)
    launch_mod.enqueue = real_enqueue           # the real launch path, into the stub driver
    libcuda.copy_htod, libcuda.record_event, libcuda.wait_event = real_copies   # and plan()'s copy
    stub = Device(0)

    def real_plan_buffers(w):
        """plan() through its real copy path: pinned buffers and events of the stub device."""
        w._pinned = tuple(PinnedBuffer(w.layout.plan_bytes, stub) for _ in range(2))
        w._pinned_arrays = tuple(b.array for b in w._pinned)
        w._copied = tuple(Event(timing=False, device=stub) for _ in range(2))
    H, HK, D, PS, L = 32, 8, 128, 16, args.layers
    stream = _TorchLikeStream(0x5000)
    print(f"# host µs per call, stub driver, {L} layers, {H}/{HK} heads, D={D}, page {PS}")
    print(f"{'family':>7} {'batch':>6} {'entry':>9} {'run':>7} {'run-h':>7} {'step':>7} {'step1':>7} {'prepare':>8} "
          f"{'plan':>7}")
    for family in args.families:
        qo_len = PREFILL_QO if family == "prefill" else 1
        for batch in args.batches:
            pages_per = 1024 // PS
            pool = batch * pages_per + 16
            kv = paged_kv([1024] * batch, PS, shuffle_seed=batch)
            if family == "prefill":
                w = PW.BatchPrefillWrapper(H, HK, D, PS, max_batch=batch, max_qo_tokens=batch * qo_len, max_pages=pool,
                                           max_qo_len=qo_len)
                qi = indptr_from_lengths([qo_len] * batch)
                real_plan_buffers(w)
                plan_us = per_call_us(lambda: w.plan(qi, *kv), max(50, args.reps // 20))
            else:
                w = W.BatchDecodeWrapper(H, HK, D, PS, max_batch=batch, max_pages=pool)
                real_plan_buffers(w)
                plan_us = per_call_us(lambda: w.plan(*kv), max(50, args.reps // 20))
            rows = batch * qo_len
            base = 1 << 36
            layers = []
            for l in range(L):
                b = base + l * (1 << 32)
                layers.append((export(b, (rows, H, D), "bfloat16"), export(b + (1 << 30), (pool, PS, HK, D), "bfloat16"),
                               export(b + (2 << 30), (pool, PS, HK, D), "bfloat16"),
                               export(b + (3 << 30), (rows, H, D), "bfloat16")))
            for entry in ("ctypes", "bindings"):
                libcuda.set_entry(entry)
                it = iter(range(10**12))

                def run():
                    q, k, v, o = layers[next(it) % L]
                    w.run(q, k, v, out=o, stream=stream)

                def run_handle():
                    q, k, v, o = layers[next(it) % L]
                    w.run(q, k, v, out=o, stream=0x5000)
                g = DecodeGraphs(w, max_execs=1)   # the update path (as documented above)
                gp = DecodeGraphs(w)               # the default pool: one exec per layer, replays only

                def step():
                    q, k, v, o = layers[next(it) % L]
                    g.step(q, k, v, out=o, stream=stream)

                def step_pool():
                    q, k, v, o = layers[next(it) % L]
                    gp.step(q, k, v, out=o, stream=stream)

                def prepare():
                    q, k, v, o = layers[next(it) % L]
                    w.prepare(q, k, v, out=o, stream=stream)
                r, rh = per_call_us(run, args.reps), per_call_us(run_handle, args.reps)
                s, p = per_call_us(step, args.reps), per_call_us(prepare, args.reps // 4)
                sp = per_call_us(step_pool, args.reps)
                assert g.stats["param_updates"] > 0 and g.stats["reinstantiations"] == 0, g.stats
                assert gp.stats["param_updates"] == 0 and gp.stats["instantiations"] <= L, gp.stats
                print(f"{family:>7} {batch:6d} {entry:>9} {r:7.1f} {rh:7.1f} {sp:7.1f} {s:7.1f} {p:8.1f} {plan_us:7.1f}",
                      flush=True)
    np.asarray(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
