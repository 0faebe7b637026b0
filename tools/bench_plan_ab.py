#!/usr/bin/env python3
"""The wrapper's whole plan() on bench_overhead's rows, this tree against another checkout, in
one process, without a GPU (the stub libcuda of tools/stub_libcuda.c, the fake H200 of tests/fakes.py).

    python tools/bench_plan_ab.py OLD_TREE [--batches 1,16,64,256] [--reps 3000] [--families pf,decode] [--steps N]

Inputs are tools/bench_overhead.py's: KV U(768, 1280) per request (rng seeded by the batch), page
16, 32/8 heads, d128, pool for 256 requests; pf: BatchPrefillWrapper on PREFILL_QO = 4 tokens per
request (causal), decode: BatchDecodeWrapper. The grids are the H200's (num_ctas 66 for the
prefill wrapper's resident-4 tile, 33 for decode; the fake device alone would give 33 / 33).
Both trees' wrappers plan the same inputs in alternating single calls (A, B, A, B, ...): the
ratio of their medians holds on a busy machine where absolute figures drift. Every plan's bytes
and PlanInfo fields are compared once between the trees (a difference is reported, not timed).
`--steps N`: a serving loop's inputs instead (each call the next of N steps, every request's KV
1-5 tokens longer a step): what plan layouts cached across calls meet in use.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import stub_driver
from bench_common import page_table

ROOT = Path(__file__).resolve().parent.parent
H, HK, D, PS, PREFILL_QO = 32, 8, 128, 16, 4
GRID = {"pf": 66, "decode": 33}








def load_tree(root: Path):
    """Import rtattn (and tests/fakes) from `root` afresh: a factory of that tree's wrappers
    on the fake device with the real plan() copy path into the stub driver."""
    for name in [m for m in sys.modules if m == "rtattn" or m.startswith("rtattn.") or m in ("fakes", "fake_driver")]:
        del sys.modules[name]
    sys.path[:0] = [str(root), str(root / "tests")]
    try:
        import fakes
        from rtattn import prefill_wrapper as PW
        from rtattn import wrapper as W
        from rtattn.runtime import Device, Event, PinnedBuffer, libcuda
        copies = ("copy_htod", "record_event", "wait_event", "copy_and_record")   # (a tree has those it has: the last, session 9's only)
        real = {n: getattr(libcuda, n) for n in copies if hasattr(libcuda, n)}
        dev = fakes.fake_device()
        dev.enter = Device(0).set_current().enter
        dev.streams_checked.add(0x5000)
        fakes.install_prefill(stub_driver.Patch(), device=dev)
        fakes.install(stub_driver.Patch(), fakes.FakeKernels, device=dev)
        for n, f in real.items():   # plan()'s real copy path, into the stub
            setattr(libcuda, n, f)
        stub = Device(0)
    finally:
        del sys.path[:2]

    def make(family, batch, pool):
        if family == "pf":
            w = PW.BatchPrefillWrapper(H, HK, D, PS, max_batch=batch, max_qo_tokens=batch * PREFILL_QO,
                                       max_pages=pool, max_qo_len=PREFILL_QO, num_ctas=GRID[family])
        else:
            w = W.BatchDecodeWrapper(H, HK, D, PS, max_batch=batch, max_pages=pool, num_ctas=GRID[family])
        w._pinned = tuple(PinnedBuffer(w.layout.plan_bytes, stub) for _ in range(2))
        w._pinned_arrays = tuple(b.array for b in w._pinned)
        w._copied = tuple(Event(timing=False, device=stub) for _ in range(2))
        return w
    return make


def inputs(family, batch, pool, steps=0):
    """plan() on bench_overhead's inputs; `steps` > 0: a serving loop's instead, each call the
    next of `steps` steps (cycled) in which every request's KV grew by 1-5 tokens (a decode step
    or an accepted draft), the page table as bench_common.page_table lays it out."""
    rng = np.random.default_rng(batch)
    kv_lens = rng.integers(768, 1280 + 1, batch)
    seq = [page_table(rng, kv_lens, PS, pool)]
    for _ in range(steps - 1):
        kv_lens = kv_lens + rng.integers(1, 6, batch)
        seq.append(page_table(rng, kv_lens, PS, pool))
    qi = np.arange(0, batch * PREFILL_QO + 1, PREFILL_QO, dtype=np.int32) if family == "pf" else None
    if steps <= 1:
        kv = seq[0]
        if family == "pf":
            return lambda w: w.plan(qi, *kv, stream=0x5000)
        return lambda w: w.plan(*kv, stream=0x5000)
    state = {}

    def call(w):   # (A and B alternate: each plans every step once)
        i = state[id(w)] = (state.get(id(w), -1) + 1) % steps
        kv = seq[i]
        return w.plan(qi, *kv, stream=0x5000) if family == "pf" else w.plan(*kv, stream=0x5000)
    return call


def same(wa, wb, ia, ib) -> str:
    keys = ("num_items", "num_merge_rows", "num_partial_rows", "chunk_tokens", "num_split_tiles", "mode")
    for k in keys:
        if getattr(ia, k) != getattr(ib, k):
            return f"PlanInfo.{k} {getattr(ia, k)} != {getattr(ib, k)}"
    if not np.array_equal(ia.cta_loads, ib.cta_loads):
        return "cta_loads differ"
    n = wa.layout.plan_bytes
    if bytes(ia.buffer[:n]) != bytes(ib.buffer[:n]):
        return "plan bytes differ"
    return "same"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the other checkout's root (A); this tree is B")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--families", type=lambda s: s.split(","), default=["pf", "decode"])
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=0,
                    help="plan a serving loop's N steps in turn (KV +1-5 tokens per request per step) "
                         "instead of bench_overhead's one input")
    args = ap.parse_args(argv)
    if not stub_driver.active():
        return stub_driver.reexec_with_stub(__file__, sys.argv[1:] if argv is None else argv)
    make_a, make_b = load_tree(args.old.resolve()), load_tree(ROOT)
    pool = max(args.batches) * (-(-(1280 + 5 * args.steps) // PS)) + 16
    pc = time.perf_counter
    print(f"# wrapper plan() host us, stub driver, {H}/{HK} d{D} page {PS}, KV U(768,1280); "
          f"A = {args.old}, B = this tree; median of {args.reps} interleaved calls each"
          + (f"; a serving loop of {args.steps} steps" if args.steps else ""))
    print(f"{'family':>6} {'batch':>5} {'C':>3} {'items':>5} {'A us':>7} {'B us':>7} {'B/A':>6}  plans")
    for family in args.families:
        for batch in args.batches:
            wa, wb = make_a(family, batch, pool), make_b(family, batch, pool)
            call = inputs(family, batch, pool, args.steps)
            for w in (wa, wb):   # the same stale bytes under both trees' plans
                for a in w._pinned_arrays:
                    a[:] = 0xA5
            verdict = "same"
            for _ in range(max(args.steps, 1)):   # (every step of a loop compared once)
                ia, ib = call(wa), call(wb)
                if verdict == "same":
                    verdict = same(wa, wb, ia, ib)
            for _ in range(50):
                call(wa)
                call(wb)
            ta, tb = [], []
            for _ in range(args.reps):
                t0 = pc()
                call(wa)
                t1 = pc()
                call(wb)
                t2 = pc()
                ta.append(t1 - t0)
                tb.append(t2 - t1)
            a, b = statistics.median(ta) * 1e6, statistics.median(tb) * 1e6
            print(f"{family:>6} {batch:5d} {GRID[family]:3d} {ib.num_items:5d} {a:7.1f} {b:7.1f} {b / a:6.3f}  "
                  f"{verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
