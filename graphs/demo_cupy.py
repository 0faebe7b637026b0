"""rtattn inside a cupy program: cupy arrays in, cupy arrays out, on a cupy stream, via DLPack.

    python -m rtattn.graphs.demo_cupy [--steps 12] [--layers 4]

A paged float16 KV cache per layer in cupy arrays, fed by cupy kernels each step (the new
token's K/V written into its page slot); rtattn plans on the host, runs decode attention on a
non-blocking cupy stream (eager run() and DecodeGraphs replay on the same plan), and hands
its own output back as a cupy array through cupy.from_dlpack. Checked against the float64
reference each step; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from rtattn.plan.reference import reference_attention

from .decode_graphs import DecodeGraphs
from .decode_sim import DecodeBatch

TOL = 5e-3   # float16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("demo_cupy needs cupy")
        return 1
    from rtattn.wrapper import BatchDecodeWrapper

    H, Hk, D, ps = 16, 4, 128, 16
    sim = DecodeBatch(a.batch, ps, 512, seed=a.seed, max_new_tokens=8)
    stream = cp.cuda.Stream(non_blocking=True)
    w = BatchDecodeWrapper(H, Hk, D, ps, max_batch=a.batch, max_pages=sim.pool_pages, dtype="float16")
    graphs = DecodeGraphs(w)
    failures, worst = [], 0.0
    with stream:
        rs = cp.random.RandomState(a.seed)
        shape = (sim.pool_pages, ps, Hk, D)
        k = [rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(a.layers)]
        v = [rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(a.layers)]
        q = [cp.empty((a.batch, H, D), cp.float16) for _ in range(a.layers)]
        outs = [cp.empty((a.batch, H, D), cp.float16) for _ in range(a.layers)]
        for step in range(a.steps):
            kv_indptr, kv_indices, last = sim.kv()
            n = sim.size
            # this step's token of every request: fresh K/V written into its page slot by cupy
            slot = np.array([r.pages[(r.length - 1) // ps] * ps + (r.length - 1) % ps for r in sim.requests])
            slot_d = cp.asarray(slot)
            for l in range(a.layers):
                k[l].reshape(-1, Hk, D)[slot_d] = rs.standard_normal((n, Hk, D), dtype=cp.float32).astype(cp.float16)
                v[l].reshape(-1, Hk, D)[slot_d] = rs.standard_normal((n, Hk, D), dtype=cp.float32).astype(cp.float16)
                q[l][:n] = rs.standard_normal((n, H, D), dtype=cp.float32).astype(cp.float16)
            w.plan(kv_indptr, kv_indices, last, stream=stream)
            eager, graphed = [], []
            for l in range(a.layers):
                o = cp.from_dlpack(w.run(q[l][:n], k[l], v[l], stream=stream))   # rtattn-allocated
                eager.append(o)
            for l in range(a.layers):
                outs[l][:n] = cp.nan
                graphs.step(q[l][:n], k[l], v[l], out=outs[l][:n], stream=stream)
                graphed.append(outs[l][:n])
            stream.synchronize()
            qo = np.arange(n + 1, dtype=np.int32)
            for l in range(a.layers):
                want, _ = reference_attention(cp.asnumpy(q[l][:n]).astype(np.float64),
                                              cp.asnumpy(k[l]).astype(np.float64),
                                              cp.asnumpy(v[l]).astype(np.float64),
                                              qo, kv_indptr, kv_indices, last, ps)
                for name, got in (("eager", eager[l]), ("graph", graphed[l])):
                    got = cp.asnumpy(got).astype(np.float64)
                    err = float("inf") if np.isnan(got).any() else \
                        float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                    worst = max(worst, err)
                    if not err < TOL:
                        failures.append(f"step {step} layer {l} {name}: relative error {err:.2e}")
            print(f"step {step:3d}: batch {n}, KV {min(r.length for r in sim.requests)}.."
                  f"{max(r.length for r in sim.requests)}, worst error so far {worst:.2e}")
            sim.advance()
    print(f"DecodeGraphs stats: {graphs.stats}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures[:20]))
        return 1
    print(f"all checks passed (worst relative error {worst:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
