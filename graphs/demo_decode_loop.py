"""Synthetic multi-layer decode loop: eager run() vs CUDA graph replay, framework-free.

    python -m rtattn.graphs.demo_decode_loop [--layers 32] [--steps 200] [--batch 16]

Every step plans once (host) and runs attention for every layer three ways on the same plan:
eager `wrapper.run()` per layer; `DecodeGraphs.step()` per layer (one executable graph whose
kernel-node arguments are updated in place for each layer); and a `StepGraph` (all layers
captured once at step 0, replayed whole every step while the plan changes underneath).
Requests grow, finish and join over a page pool with scattered page ids. Outputs of sampled
layers and steps are checked against the float64 reference, and every graph result against
the eager one bitwise. Exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from rtattn.plan.reference import reference_attention
from rtattn.runtime import Stream, export
from rtattn.runtime.dlpack import contiguous_strides
from rtattn.wrapper import BatchDecodeWrapper

from .decode_graphs import DecodeGraphs
from .decode_sim import DecodeBatch
from .device_arrays import DeviceArray, rounded
from .step_graph import StepGraph

TOL = 2e-2


class Model:
    """Per-layer q, K, V and out. K/V/q of layer l are windows, shifted by l pages/rows, into one
    random buffer each: distinct pointers and distinct contents per layer, one upload."""

    def __init__(self, layers, batch, pool_pages, H, Hk, D, ps, rng, stream):
        self.layers, self.batch, self.pool = layers, batch, pool_pages
        kshape = (pool_pages + layers, ps, Hk, D)
        host = [rng.standard_normal(kshape, dtype=np.float32) for _ in range(2)]
        qh = rng.standard_normal((batch + layers, H, D), dtype=np.float32)
        self.k_host, self.v_host = (rounded(x, "bfloat16") for x in host)
        self.q_host = rounded(qh, "bfloat16")
        self.kbuf, self.vbuf = (DeviceArray.from_host(x, "bfloat16") for x in host)
        self.qbuf = DeviceArray.from_host(qh, "bfloat16")
        self.out = [DeviceArray((batch, H, D), "bfloat16") for _ in range(layers)]
        self.k = [self._pages(self.kbuf, l) for l in range(layers)]
        self.v = [self._pages(self.vbuf, l) for l in range(layers)]
        self.stream = stream

    def _pages(self, buf, layer):
        shape = (self.pool,) + buf.shape[1:]
        page = int(np.prod(buf.shape[1:])) * buf.itemsize
        return export(buf.ptr + layer * page, shape, "bfloat16", buf.buffer.device.ordinal,
                      contiguous_strides(shape), owner=buf)

    def q(self, layer, n):
        return self.qbuf.view(n, offset=layer)

    def o(self, layer, n):
        return self.out[layer].view(n)

    def reference(self, layer, n, kv, ps):
        qo = np.arange(n + 1, dtype=np.int32)
        o, _ = reference_attention(self.q_host[layer:layer + n], self.k_host[layer:layer + self.pool],
                                   self.v_host[layer:layer + self.pool], qo, *kv, ps)
        return o


def _us(t0):
    return (time.perf_counter() - t0) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="max concurrent requests")
    ap.add_argument("--max-len", type=int, default=1024, help="max KV tokens per request")
    ap.add_argument("--heads", default="32/8", help="query/KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--check-every", type=int, default=20, help="check sampled layers every N steps")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    H, Hk = (int(x) for x in a.heads.split("/"))
    D, ps, L = a.head_dim, a.page_size, a.layers

    sim = DecodeBatch(a.batch, ps, a.max_len, seed=a.seed)
    s = Stream()
    model = Model(L, a.batch, sim.pool_pages, H, Hk, D, ps, np.random.default_rng(a.seed + 1), s)
    w = BatchDecodeWrapper(H, Hk, D, ps, max_batch=a.batch, max_pages=sim.pool_pages)
    graphs = DecodeGraphs(w, max_execs=1)   # the in-place update path (the default pool would keep one per layer)
    print(f"rtattn decode loop: {L} layers x {a.steps} steps, batch <= {a.batch}, heads {H}/{Hk}, D={D}, "
          f"page {ps}, pool {sim.pool_pages} pages, {w.num_ctas} x {Hk} CTAs, spec {w.spec.uri}")

    times = {k: [] for k in ("plan", "eager_enqueue", "eager_step", "layer_graph_enqueue", "layer_graph_step",
                             "step_graph_enqueue", "step_graph_step")}
    failures, checks, step_graph = [], 0, None
    sampled = sorted({0, L // 2, L - 1})
    for step in range(a.steps):
        kv = sim.kv()
        n = sim.size
        check = step % a.check_every == 0 or step == a.steps - 1
        t0 = time.perf_counter()
        w.plan(*kv, stream=s)
        times["plan"].append(_us(t0))

        results = {}
        for mode in ("eager", "layer_graph", "step_graph"):
            if check:
                for o in model.out:
                    o.fill_nan(s)
            s.synchronize()
            t0 = time.perf_counter()
            if mode == "eager":
                for l in range(L):
                    w.run(model.q(l, n), model.k[l], model.v[l], out=model.o(l, n), stream=s)
            elif mode == "layer_graph":
                for l in range(L):
                    graphs.step(model.q(l, n), model.k[l], model.v[l], out=model.o(l, n), stream=s)
            else:
                if step_graph is None:   # capture once over max-batch q/out: later plans use up to that
                    B = model.batch
                    step_graph = StepGraph([w.prepare(model.q(l, B), model.k[l], model.v[l], out=model.o(l, B),
                                                      stream=s) for l in range(L)], s)
                step_graph.replay()
            times[f"{mode}_enqueue"].append(_us(t0))
            s.synchronize()
            times[f"{mode}_step"].append(_us(t0))
            if check:
                results[mode] = [model.out[l].download(n, stream=s) for l in sampled]

        if check:
            checks += 1
            for i, l in enumerate(sampled):
                want = model.reference(l, n, kv, ps)
                for mode, outs in results.items():
                    got = outs[i]
                    err = float("inf") if np.isnan(got).any() else \
                        float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                    if err > TOL:
                        failures.append(f"step {step} layer {l} {mode}: relative error {err:.2e}")
                    if mode != "eager" and not np.array_equal(got, results["eager"][i]):
                        failures.append(f"step {step} layer {l} {mode}: differs bitwise from eager")
            lens = [r.length for r in sim.requests]
            print(f"step {step:4d}: batch {n:3d}, KV {min(lens)}..{max(lens)}, finished {sim.finished}, "
                  f"joined {sim.joined}, checked layers {sampled}: {'ok' if not failures else 'FAIL'}")
        sim.advance()

    warm = slice(min(3, a.steps - 1), None)   # first steps include capture/instantiate
    print(f"\nper-step latency over steps {warm.start}..{a.steps - 1} (us; one step = all {L} layers)")
    print(f"{'':24s}{'median':>10s}{'p90':>10s}")
    for k, v in times.items():
        v = np.array(v[warm])
        print(f"{k:24s}{np.median(v):10.1f}{np.percentile(v, 90):10.1f}")
    print(f"DecodeGraphs stats: {graphs.stats}")
    print(f"StepGraph stats: {step_graph.stats if step_graph else None}")
    print(f"{checks} checked steps x {len(sampled)} layers x 3 modes; requests finished {sim.finished}, "
          f"joined {sim.joined}")
    if graphs.stats["reinstantiations"]:
        failures.append(f"unexpected re-instantiations: {graphs.reasons}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures[:20]))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
