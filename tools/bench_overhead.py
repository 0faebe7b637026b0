"""What the paper left unmeasured: the host and launch overhead around decode attention.

    python tools/bench_overhead.py [--batches 1,4,16,64,256] [--kv 1024] [--layers 32] [--no-flashinfer]

Per batch size (KV ~1024 per request, 32/8 heads, D=128, page 16, bf16, pages scattered, a
distinct KV cache per layer so nothing stays in L2 between layers):

* plan_us        host time of one plan() (rtattn: fills the pinned plan, issues the H2D copy)
* h2d_us         device time of rtattn's plan copy (events around one copy of the plan bytes)
* eager_us       one step = `layers` x run(), wall time enqueue -> stream synchronized, / layers
* graph_us       the same step replayed from one StepGraph (all layers captured once), / layers
* layer_graph_us DecodeGraphs.step() per layer (one exec, kernel-node args updated per layer)
* *_gpu_us       device time of the step (events), / layers: what remains without host overhead
* FlashInfer's BatchDecodeWithPagedKVCacheWrapper in the same run: plan_us, eager_us and a
  torch.cuda.CUDAGraph of the step (graph_us), when `import flashinfer` works.

Prints a compact table last; writes $OUT/overhead.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

H, HK, D, PS = 32, 8, 128, 16


def med(xs):
    return float(statistics.median(xs))


def page_table(rng, kv_lens, pool_pages):
    pages = -(-np.asarray(kv_lens) // PS)
    indptr = np.zeros(len(pages) + 1, np.int32)
    np.cumsum(pages, out=indptr[1:])
    ids = rng.permutation(pool_pages)[: int(indptr[-1])].astype(np.int32)
    last = (np.asarray(kv_lens) - (pages - 1) * PS).astype(np.int32)
    return indptr, ids, last


class Bench:
    def __init__(self, args):
        import torch
        self.torch, self.args = torch, args
        self.L = args.layers
        self.max_batch = max(args.batches)
        self.kv_max = int(args.kv * 1.25)
        self.pool = self.max_batch * (-(-self.kv_max // PS)) + 16
        t0 = time.perf_counter()
        shape = (self.pool, PS, HK, D)
        self.k = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
        self.v = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
        self.q = [torch.randn((self.max_batch, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
        self.o = [torch.empty((self.max_batch, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
        torch.cuda.synchronize()
        self.stream = torch.cuda.Stream()
        print(f"# {self.L} layers, KV pool {self.pool} pages/layer "
              f"({2 * self.L * self.k[0].numel() * 2 / 2**30:.1f} GiB), set up in {time.perf_counter() - t0:.1f} s",
              flush=True)

    def events(self):
        t = self.torch
        return t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)

    def time_step(self, fn, reps):
        """(wall µs, enqueue µs, gpu µs) medians of `fn` (one whole step) on self.stream."""
        s = self.stream
        walls, enq, gpu = [], [], []
        fn()
        s.synchronize()
        for _ in range(reps):
            e0, e1 = self.events()
            s.synchronize()
            t0 = time.perf_counter()
            e0.record(s)
            fn()
            e1.record(s)
            enq.append((time.perf_counter() - t0) * 1e6)
            s.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
            gpu.append(e0.elapsed_time(e1) * 1e3)
        return med(walls), med(enq), med(gpu)

    # ------------------------------------------------------------------ rtattn
    def rtattn(self, batch, kv):
        from rtattn.graphs import DecodeGraphs, StepGraph
        from rtattn.runtime import memcpy_htod_async
        from rtattn.wrapper import BatchDecodeWrapper
        L, s, reps = self.L, self.stream, self.args.reps
        w = BatchDecodeWrapper(H, HK, D, PS, max_batch=batch, max_pages=self.pool)
        plans = []
        for _ in range(reps * 2):
            t0 = time.perf_counter()
            w.plan(*kv, stream=s)
            plans.append((time.perf_counter() - t0) * 1e6)
        s.synchronize()
        copies = []
        for _ in range(reps):
            e0, e1 = self.events()
            e0.record(s)
            memcpy_htod_async(w.workspace_ptr, w.pinned.ptr, w.layout.plan_bytes, s)
            e1.record(s)
            s.synchronize()
            copies.append(e0.elapsed_time(e1) * 1e3)
        q = [x[:batch] for x in self.q]
        o = [x[:batch] for x in self.o]

        def eager():
            for l in range(L):
                w.run(q[l], self.k[l], self.v[l], out=o[l], stream=s)
        e_wall, e_enq, e_gpu = self.time_step(eager, reps)
        ref = o[0].float().clone()

        sg = StepGraph([w.prepare(q[l], self.k[l], self.v[l], out=o[l], stream=s) for l in range(L)], s)
        g_wall, g_enq, g_gpu = self.time_step(sg.replay, reps)
        err = float((o[0].float() - ref).norm() / ref.norm())

        dg = DecodeGraphs(w)

        def per_layer():
            for l in range(L):
                dg.step(q[l], self.k[l], self.v[l], out=o[l], stream=s)
        lg_wall, lg_enq, _ = self.time_step(per_layer, reps)
        sg.close()
        dg.close()
        return dict(plan_us=med(plans), plan_p90_us=float(np.percentile(plans, 90)), h2d_us=med(copies),
                    plan_bytes=int(w.layout.plan_bytes), eager_us=e_wall / L, eager_enqueue_us=e_enq / L,
                    eager_gpu_us=e_gpu / L, graph_us=g_wall / L, graph_enqueue_us=g_enq / L, graph_gpu_us=g_gpu / L,
                    layer_graph_us=lg_wall / L, layer_graph_enqueue_us=lg_enq / L,
                    graph_vs_eager_rel_diff=err, dg_stats=dict(dg.stats), out0=ref)

    # -------------------------------------------------------------- FlashInfer
    def flashinfer(self, batch, kv, workspace):
        import flashinfer
        torch, L, s, reps = self.torch, self.L, self.stream, self.args.reps
        indptr, indices, last = (torch.from_numpy(a).cuda() for a in kv)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")

        def plan():
            w.plan(indptr, indices, last, H, HK, D, PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        with torch.cuda.stream(s):
            plan()
            plans = []
            for _ in range(reps * 2):
                t0 = time.perf_counter()
                plan()
                plans.append((time.perf_counter() - t0) * 1e6)
            q = [x[:batch] for x in self.q]
            o = [x[:batch] for x in self.o]

            def eager():
                for l in range(L):
                    w.run(q[l], (self.k[l], self.v[l]), out=o[l])
            e_wall, e_enq, e_gpu = self.time_step(eager, reps)
            out0 = o[0].float().clone()
            res = dict(plan_us=med(plans), eager_us=e_wall / L, eager_enqueue_us=e_enq / L, eager_gpu_us=e_gpu / L,
                       out0=out0)
            try:  # a CUDA-graph wrapper needs fixed-size index buffers
                gw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, kv_layout="NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr.clone(),
                    paged_kv_indices_buffer=indices.clone(), paged_kv_last_page_len_buffer=last.clone())
                gw.plan(indptr, indices, last, H, HK, D, PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                for l in range(L):   # warm-up outside the capture
                    gw.run(q[l], (self.k[l], self.v[l]), out=o[l])
                s.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    for l in range(L):
                        gw.run(q[l], (self.k[l], self.v[l]), out=o[l])
                g_wall, g_enq, g_gpu = self.time_step(g.replay, reps)
                res.update(graph_us=g_wall / L, graph_enqueue_us=g_enq / L, graph_gpu_us=g_gpu / L)
            except Exception as e:  # report, keep the eager numbers
                res["graph_error"] = f"{type(e).__name__}: {e}"[:200]
        return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256])
    ap.add_argument("--kv", type=int, default=1024, help="mean KV tokens per request (uniform +-25%%)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_overhead needs torch (tensors, events)")
        return 1
    t_start = time.perf_counter()
    fi_note = "skipped (--no-flashinfer)"
    fi_ok = False
    if not args.no_flashinfer:
        try:
            import flashinfer
            fi_ok, fi_note = True, f"FlashInfer {getattr(flashinfer, '__version__', '?')}"
        except Exception as e:
            fi_note = f"FlashInfer not importable ({type(e).__name__}: {e}); FI columns skipped"
    print(f"# {fi_note}", flush=True)
    b = Bench(args)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda") if fi_ok else None
    rows = []
    for batch in args.batches:
        rng = np.random.default_rng(batch)
        kv_lens = rng.integers(int(args.kv * 0.75), b.kv_max + 1, batch)
        kv = page_table(rng, kv_lens, b.pool)
        row = dict(batch=batch, kv_tokens=int(kv_lens.sum()), rt=b.rtattn(batch, kv))
        if fi_ok:
            try:
                row["fi"] = b.flashinfer(batch, kv, workspace)
                a, f = row["rt"]["out0"], row["fi"]["out0"]
                row["rt_vs_fi_rel_diff"] = float((a - f).norm() / f.norm())
            except Exception as e:
                row["fi"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        for side in ("rt", "fi"):
            row.get(side, {}).pop("out0", None)
        rows.append(row)
        print(f"# batch {batch} done at {time.perf_counter() - t_start:.1f} s: {json.dumps(row, default=str)}",
              flush=True)

    cols = [("rt", "plan_us", "rt plan"), ("rt", "h2d_us", "rt h2d"), ("rt", "eager_us", "rt eager"),
            ("rt", "graph_us", "rt graph"), ("rt", "layer_graph_us", "rt lgraph"), ("rt", "eager_gpu_us", "rt gpu"),
            ("fi", "plan_us", "FI plan"), ("fi", "eager_us", "FI eager"), ("fi", "graph_us", "FI graph"),
            ("fi", "eager_gpu_us", "FI gpu")]
    print(f"\nDecode overhead, {args.layers} layers/step, {H}/{HK} heads, D={D}, page {PS}, KV ~{args.kv}; "
          f"plan/h2d: µs per step; eager/graph/gpu: µs per layer (step / {args.layers}). {fi_note}")
    print(f"{'batch':>6s}" + "".join(f"{c[2]:>11s}" for c in cols) + f"{'rt~FI':>9s}")
    for r in rows:
        cells = []
        for side, key, _ in cols:
            v = r.get(side, {}).get(key)
            cells.append(f"{v:11.1f}" if isinstance(v, (int, float)) else f"{'-':>11s}")
        d = r.get("rt_vs_fi_rel_diff")
        print(f"{r['batch']:6d}" + "".join(cells) + (f"{d:9.1e}" if d is not None else f"{'-':>9s}"))
    print(f"# total {time.perf_counter() - t_start:.1f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "overhead.json"), "w") as f:
            json.dump(dict(config=dict(layers=args.layers, heads=[H, HK], head_dim=D, page_size=PS, kv=args.kv,
                                       flashinfer=fi_note), rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
