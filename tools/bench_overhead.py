"""What the paper left unmeasured: the host and launch overhead around decode attention.

    python tools/bench_overhead.py [--batches 1,4,16,64,256] [--kv 1024] [--layers 32] [--no-flashinfer]

Per batch size (KV ~1024 per request, 32/8 heads, D=128, page 16, bf16, pages scattered, a
distinct KV cache per layer so nothing stays in L2 between layers):

* plan_us        host time of one plan() (rtattn: fills the pinned plan, issues the H2D copy),
                 median of PLAN_SAMPLES after PLAN_WARMUP untimed plans
* planner_us     Planner.plan() alone on the same inputs into a host array (plan_us - planner_us: the
                 wrapper's copy, its event and the wait on the copy of two plans ago)
* plan_busy_us   plan() called right after a step (the whole-step graph) was enqueued, as a serving loop
                 plans step N+1 while step N runs (FlashInfer: after its graphed step; plan_host_busy_us
                 with host indptr): a plan that waits for the GPU pays the step's remaining time
* h2d_us         device time of rtattn's plan copy (events around one copy of the plan bytes)
* eager          one step = `layers` x run() (direct libcuda entry); eager_bindings: the same
                 through cuda.bindings' cuLaunchKernelEx
* graph          the same step replayed from one StepGraph (all layers captured once)
* layer_graph    DecodeGraphs.step() per layer with the default pool (one exec per layer: replays
                 only); layer_graph1: max_execs=1, one exec updated in place per layer (kernel-node
                 arguments); eager and these two in STEP_ROUNDS alternating rounds
* per path: *_us wall (enqueue -> stream synchronized), *_enqueue_us host time until the last
  launch returned, *_gpu_us device time (events): all per layer (step / layers)
* inv: the same for a batch-invariant wrapper (inv_vs_auto_gpu: its step graph's GPU time / auto's)
* pf: the same paths for BatchPrefillWrapper on PREFILL_QO query tokens per request (multi-token
  verification, causal; --no-prefill skips it)
* FlashInfer's BatchDecodeWithPagedKVCacheWrapper in the same run: plan_us, eager and a
  torch.cuda.CUDAGraph of the step (graph), when `import flashinfer` works; and the plan() of its
  BatchPrefillWithPagedKVCacheWrapper on the pf rows' inputs (pf_plan_us, causal). plan_us /
  pf_plan_us take the page table as CUDA tensors (as FlashInfer's examples do: the plan copies
  indptr and last_page_len to the host); *_host_us pass indptr, last_page_len (and qo_indptr) as
  CPU tensors, FlashInfer's cheapest plan (page ids stay on the GPU, where run() reads them).
  plan_interleaved / pf_plan_interleaved: rtattn's and FlashInfer's plan() (decode; prefill on the pf
  rows' inputs, CUDA tensors) in alternating rounds, the median of the rounds' ratios: the summary's
  ~ columns, the ratio least moved by this host's other work.
* The first batch is run once untimed before any row is measured (warm-up: the first row timed
  read ~1.4x high at batch 1 before).

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

from bench_common import page_table

H, HK, D, PS = 32, 8, 128, 16
PREFILL_QO = 4   # query tokens per request of the prefill wrapper's rows
PLAN_WARMUP, PLAN_SAMPLES = 10, 200   # plan() is cheap: many samples, after its first calls (view caches)
INTERLEAVE_ROUNDS, INTERLEAVE_CALLS = 20, 25   # plan() against FlashInfer's: alternating rounds
STEP_ROUNDS = 3   # eager and the DecodeGraphs paths: alternating rounds of reps / STEP_ROUNDS steps


def med(xs):
    return float(statistics.median(xs))




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
        rows = self.max_batch * PREFILL_QO   # decode uses the first batch rows, prefill batch x PREFILL_QO
        self.q = [torch.randn((rows, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
        self.o = [torch.empty((rows, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(self.L)]
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
        return tuple(med(xs) for xs in self.time_steps(fn, reps))

    def time_steps(self, fn, reps):
        """([wall µs], [enqueue µs], [gpu µs]) of `reps` runs of `fn` (one whole step) on self.stream."""
        s = self.stream
        walls, enq, gpu = [], [], []
        fn()
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
        return walls, enq, gpu

    def plan_while_busy(self, step, plan) -> list:
        """Host µs of plan() called right after a step was enqueued (a serving loop plans step N+1
        while step N runs): a plan that waits for the GPU pays the step's remaining time here."""
        s, out = self.stream, []
        for _ in range(self.args.reps):
            s.synchronize()
            step()
            t0 = time.perf_counter()
            plan()
            out.append((time.perf_counter() - t0) * 1e6)
        s.synchronize()
        return out

    # ------------------------------------------------------------------ rtattn
    def rtattn(self, batch, kv, mode="auto", family="decode", reps=None):
        """One wrapper in `mode` (of `family`: decode, or prefill on PREFILL_QO tokens per request):
        plan, then every way of running a step's layers."""
        from rtattn.graphs import DecodeGraphs, StepGraph
        from rtattn.prefill_wrapper import BatchPrefillWrapper
        from rtattn.runtime import libcuda, memcpy_htod_async
        from rtattn.wrapper import BatchDecodeWrapper
        L, s, reps = self.L, self.stream, reps or self.args.reps
        if family == "prefill":
            rows = batch * PREFILL_QO
            w = BatchPrefillWrapper(H, HK, D, PS, max_batch=batch, max_qo_tokens=rows, max_pages=self.pool,
                                    max_qo_len=PREFILL_QO, mode=mode, pdl=not self.args.no_pdl)
            qi = np.arange(0, rows + 1, PREFILL_QO, dtype=np.int32)

            def plan():
                w.plan(qi, *kv, stream=s)
        else:
            rows = batch
            w = BatchDecodeWrapper(H, HK, D, PS, max_batch=batch, max_pages=self.pool, mode=mode, pdl=not self.args.no_pdl)

            def plan():
                w.plan(*kv, stream=s)
        plans = time_calls(plan)
        s.synchronize()
        host_buf = w.layout.allocate()   # Planner.plan() alone on the same inputs: what plan() adds is the rest
        planner_args = ((qi,) if family == "prefill" else (None,)) + tuple(kv)
        planner = time_calls(lambda: w.planner.plan(*planner_args, out=host_buf))
        copies = []
        for _ in range(reps):
            e0, e1 = self.events()
            e0.record(s)
            memcpy_htod_async(w.workspace_ptr, w.pinned.ptr, w.layout.plan_bytes, s)
            e1.record(s)
            s.synchronize()
            copies.append(e0.elapsed_time(e1) * 1e3)
        q = [x[:rows] for x in self.q]
        o = [x[:rows] for x in self.o]
        res = dict(plan_us=med(plans), plan_p90_us=float(np.percentile(plans, 90)), planner_us=med(planner),
                   h2d_us=med(copies),
                   plan_bytes=int(w.layout.plan_bytes), chunk_tokens=int(w.info.chunk_tokens),
                   items=int(w.info.num_items), merge_rows=int(w.info.num_merge_rows))

        def record(name, fn):
            wall, enq, gpu = self.time_step(fn, reps)
            res.update({f"{name}_us": wall / L, f"{name}_enqueue_us": enq / L, f"{name}_gpu_us": gpu / L})

        def eager():
            for l in range(L):
                w.run(q[l], self.k[l], self.v[l], out=o[l], stream=s)
        entry = libcuda.ENTRY
        for name in ("bindings", "ctypes"):      # the direct entry last: it stays in use below
            try:
                libcuda.set_entry(name)
            except RuntimeError as e:
                res[f"eager_{name}_error"] = str(e)
                if name == "ctypes":             # no ctypes entry: eager below runs through the bindings
                    libcuda.set_entry(entry or "bindings")
                continue
            if name == "bindings":
                record("eager_bindings", eager)
        # eager and both DecodeGraphs pools (the default: one exec per layer, replays only;
        # max_execs=1: one exec updated in place per layer) in alternating rounds, so that a
        # burst of this host's other work lands on all three alike (interleaved()'s why)
        dgs = {"layer_graph": DecodeGraphs(w), "layer_graph1": DecodeGraphs(w, max_execs=1)}

        def stepper(dg):
            def per_layer():
                for l in range(L):
                    dg.step(q[l], self.k[l], self.v[l], out=o[l], stream=s)
            return per_layer
        paths = {"eager": eager, **{name: stepper(dg) for name, dg in dgs.items()}}
        samples = {name: ([], [], []) for name in paths}
        for _ in range(STEP_ROUNDS):
            for name, fn in paths.items():
                for acc, xs in zip(samples[name], self.time_steps(fn, max(1, -(-reps // STEP_ROUNDS)))):
                    acc += xs
        for name, (wall, enq, gpu) in samples.items():
            res.update({f"{name}_us": med(wall) / L, f"{name}_enqueue_us": med(enq) / L, f"{name}_gpu_us": med(gpu) / L})
        for name, dg in dgs.items():
            res[f"{name}_stats"] = dict(dg.stats)
            dg.close()
        eager()   # (the reference output: eager's, as before the rounds)
        s.synchronize()
        ref = o[0].float().clone()

        sg = StepGraph([w.prepare(q[l], self.k[l], self.v[l], out=o[l], stream=s) for l in range(L)], s)
        record("graph", sg.replay)
        err = float((o[0].float() - ref).norm() / ref.norm())
        res["plan_busy_us"] = med(self.plan_while_busy(sg.replay, plan))
        sg.close()
        res.update(graph_vs_eager_rel_diff=err, out0=ref, plan_fn=plan)   # (plan_fn: for interleaved())
        return res

    # -------------------------------------------------------------- FlashInfer
    def flashinfer(self, batch, kv, workspace):
        import flashinfer
        torch, L, s, reps = self.torch, self.L, self.stream, self.args.reps
        indptr, indices, last = (torch.from_numpy(a).cuda() for a in kv)
        indptr_h, last_h = torch.from_numpy(kv[0]), torch.from_numpy(kv[2])
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        types = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        def plan():
            w.plan(indptr, indices, last, H, HK, D, PS, **types)

        def plan_host():
            w.plan(indptr_h, indices, last_h, H, HK, D, PS, **types)
        with torch.cuda.stream(s):
            res_plan = dict(plan_us=med(time_calls(plan)))
            try:   # (a refusal of host tensors must not cost the row its other figures)
                res_plan["plan_host_us"] = med(time_calls(plan_host))
            except Exception as e:
                res_plan["plan_host_error"] = f"{type(e).__name__}: {e}"[:200]
            if not self.args.no_prefill:   # the prefill wrapper's plan on the pf rows' inputs
                try:
                    qi_h = torch.arange(0, batch * PREFILL_QO + 1, PREFILL_QO, dtype=torch.int32)
                    qi = qi_h.cuda()
                    pw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD",
                                                                        backend=self.args.fi_prefill_backend)
                    res_plan["pf_plan_host_us"] = med(time_calls(
                        lambda: pw.plan(qi_h, indptr_h, indices, last_h, H, HK, D, PS, causal=True, **types)))
                    res_plan["pf_plan_fn"] = lambda: pw.plan(qi, indptr, indices, last, H, HK, D, PS, causal=True,
                                                             **types)
                    res_plan["pf_plan_us"] = med(time_calls(res_plan["pf_plan_fn"]))
                except Exception as e:  # report, keep the decode numbers
                    res_plan["pf_plan_error"] = f"{type(e).__name__}: {e}"[:200]
            plan()
            q = [x[:batch] for x in self.q]
            o = [x[:batch] for x in self.o]

            def eager():
                for l in range(L):
                    w.run(q[l], (self.k[l], self.v[l]), out=o[l])
            e_wall, e_enq, e_gpu = self.time_step(eager, reps)
            out0 = o[0].float().clone()
            res_plan["plan_fn"] = plan
            res = dict(res_plan, eager_us=e_wall / L, eager_enqueue_us=e_enq / L, eager_gpu_us=e_gpu / L,
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
                res["plan_busy_us"] = med(self.plan_while_busy(g.replay, plan))
                if "plan_host_us" in res:
                    res["plan_host_busy_us"] = med(self.plan_while_busy(g.replay, plan_host))
            except Exception as e:  # report, keep the eager numbers
                res["graph_error"] = f"{type(e).__name__}: {e}"[:200]
        return res


def time_calls(fn, samples: int = PLAN_SAMPLES, warmup: int = PLAN_WARMUP) -> list:
    """Host µs of `samples` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def interleaved(fa, fb, rounds: int = INTERLEAVE_ROUNDS, per: int = INTERLEAVE_CALLS) -> tuple:
    """(median µs of fa, of fb, median of the rounds' ratios a / b): `rounds` alternating rounds of `per`
    calls each, so that both sides see the same state of a shared host (its other work comes and goes
    over seconds; two separate medians taken a second apart read 0.54 and 0.76 for the same code)."""
    a_all, b_all, ratios = [], [], []
    for _ in range(rounds):
        a, b = time_calls(fa, per, warmup=2), time_calls(fb, per, warmup=2)
        a_all += a
        b_all += b
        ratios.append(med(a) / med(b))
    return med(a_all), med(b_all), med(ratios)


def _table(title, cols, rows, extra=None):
    print(f"\n{title}")
    print(f"{'batch':>6s}" + "".join(f"{c[2]:>10s}" for c in cols) + (f"{extra[1]:>10s}" if extra else ""))
    for r in rows:
        cells = []
        for side, key, _ in cols:
            v = r.get(side, {}).get(key)
            cells.append(f"{v:10.1f}" if isinstance(v, (int, float)) else f"{'-':>10s}")
        if extra:
            v = r.get(extra[0])
            cells.append(f"{v:10.3f}" if isinstance(v, float) and v > 1e-3 else
                         (f"{v:10.1e}" if isinstance(v, float) else f"{'-':>10s}"))
        print(f"{r['batch']:6d}" + "".join(cells))


def _ratio(row, a, ka, b, kb):
    x, y = row.get(a, {}).get(ka), row.get(b, {}).get(kb)
    return x / y if isinstance(x, float) and isinstance(y, float) and y else None


def summary(rows) -> None:
    """The issue's targets in one block at the very end (under 40 lines: it has to survive a
    log's tail): host µs per run() on every path, plan() against FlashInfer's, invariant / auto."""
    print("\n== summary (targets: eager and dg.step host <= 25 us/layer, dg.step <= eager; plan rt/FI and "
          "pf/FIpf <= 0.5; inv/auto GPU <= 1.05) ==")
    _table("host us per layer, enqueue only (dg.step: DecodeGraphs default pool; stepgr: whole-step graph; "
           "pf: prefill wrapper, 4 tokens/request)",
           [("rt", "eager_enqueue_us", "eager"), ("rt", "layer_graph_enqueue_us", "dg.step"),
            ("rt", "graph_enqueue_us", "stepgr"), ("pf", "eager_enqueue_us", "pf eager"),
            ("pf", "layer_graph_enqueue_us", "pf dg"), ("fi", "eager_enqueue_us", "FI eager"),
            ("fi", "graph_enqueue_us", "FI graph")], rows)
    cols = [("rt", "plan_us", "fi", "plan_us", "rt/FI"), ("rt", "plan_us", "fi", "plan_host_us", "rt/FI-h"),
            ("pf", "plan_us", "fi", "pf_plan_us", "pf/FIpf"), ("pf", "plan_us", "fi", "pf_plan_host_us", "pf/FIpf-h"),
            ("inv", "graph_gpu_us", "rt", "graph_gpu_us", "inv/auto")]
    print("\nplan() host us per step (FI: page table as CUDA tensors, -h: host indptr) and ratios; ~: "
          f"rt and FI alternating, {INTERLEAVE_ROUNDS} rounds of {INTERLEAVE_CALLS} calls, the rounds' median ratio")
    heads = ("rt plan", "FI plan", "pf plan", "FI pf")
    print(f"{'batch':>6s}" + "".join(f"{h:>9s}" for h in heads) + "".join(f"{c[4]:>10s}" for c in cols)
          + f"{'rt/FI~':>9s}{'pf/FIpf~':>9s}")
    for r in rows:
        vals = (r.get("rt", {}).get("plan_us"), r.get("fi", {}).get("plan_us"), r.get("pf", {}).get("plan_us"),
                r.get("fi", {}).get("pf_plan_us"))
        cells = [f"{v:9.1f}" if isinstance(v, float) else f"{'-':>9s}" for v in vals]
        for c in cols:
            x = _ratio(r, *c[:4])
            cells.append(f"{x:10.2f}" if x is not None else f"{'-':>10s}")
        for key in ("plan_interleaved", "pf_plan_interleaved"):
            x = r.get(key, {}).get("ratio")
            cells.append(f"{x:9.2f}" if x is not None else f"{'-':>9s}")
        print(f"{r['batch']:6d}" + "".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256])
    ap.add_argument("--kv", type=int, default=1024, help="mean KV tokens per request (uniform +-25%%)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-pdl", action="store_true",
                    help="rtattn's kernels without programmatic dependent launch (an A/B of the launch attribute's host cost)")
    ap.add_argument("--no-invariant", action="store_true", help="skip the batch-invariant wrapper")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill wrapper's rows")
    ap.add_argument("--fi-prefill-backend", default="fa2",
                    help="FlashInfer prefill backend whose plan() is timed (fa2: the module bench_prefill builds)")
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
    rng = np.random.default_rng(0)   # warm-up: the first batch once, untimed (every rtattn path)
    with torch.cuda.stream(b.stream):
        b.rtattn(args.batches[0], page_table(rng, np.full(args.batches[0], args.kv), PS, b.pool), reps=2)
    for batch in args.batches:
        rng = np.random.default_rng(batch)
        kv_lens = rng.integers(int(args.kv * 0.75), b.kv_max + 1, batch)
        kv = page_table(rng, kv_lens, PS, b.pool)
        with torch.cuda.stream(b.stream):   # as FlashInfer runs: torch's current stream is the one timed
            row = dict(batch=batch, kv_tokens=int(kv_lens.sum()), rt=b.rtattn(batch, kv))
            if not args.no_invariant:
                row["inv"] = b.rtattn(batch, kv, mode="batch-invariant")
            if not args.no_prefill:
                row["pf"] = b.rtattn(batch, kv, family="prefill")
        if not args.no_invariant:
            row["inv_vs_auto_gpu"] = row["inv"]["graph_gpu_us"] / row["rt"]["graph_gpu_us"]
            a, i = row["rt"]["out0"], row["inv"]["out0"]
            row["inv_vs_auto_rel_diff"] = float((a - i).norm() / a.norm())
        if fi_ok:
            try:
                row["fi"] = b.flashinfer(batch, kv, workspace)
                a, f = row["rt"]["out0"], row["fi"]["out0"]
                row["rt_vs_fi_rel_diff"] = float((a - f).norm() / f.norm())
            except Exception as e:
                row["fi"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            fi = row["fi"]
            with torch.cuda.stream(b.stream):   # the same plans, alternating (interleaved's why)
                for key, ours, theirs in (("plan", "rt", "plan_fn"), ("pf_plan", "pf", "pf_plan_fn")):
                    fa, fb = row.get(ours, {}).get("plan_fn"), fi.get(theirs)
                    if fa is not None and fb is not None:
                        a_us, b_us, ratio = interleaved(fa, fb)
                        row[f"{key}_interleaved"] = dict(rt_us=a_us, fi_us=b_us, ratio=ratio)
        for side in ("rt", "inv", "pf", "fi"):
            for key in ("out0", "plan_fn", "pf_plan_fn"):
                row.get(side, {}).pop(key, None)
        rows.append(row)
        # (the whole row goes to $OUT/overhead.json when OUT is set: the log keeps a line, so the
        # summary at the end stays inside a short tail)
        detail = "" if os.environ.get("OUT") else f": {json.dumps(row, default=str)}"
        print(f"# batch {batch} done at {time.perf_counter() - t_start:.1f} s{detail}", flush=True)

    host = [("rt", "eager_enqueue_us", "eager"), ("rt", "eager_bindings_enqueue_us", "eager-b"),
            ("rt", "layer_graph_enqueue_us", "dg.step"), ("rt", "layer_graph1_enqueue_us", "dg.step1"),
            ("rt", "graph_enqueue_us", "stepgr"), ("pf", "eager_enqueue_us", "pf eager"),
            ("pf", "layer_graph_enqueue_us", "pf dg"), ("fi", "eager_enqueue_us", "FI eager"),
            ("fi", "graph_enqueue_us", "FI graph")]
    wall = [("rt", "eager_us", "eager"), ("rt", "layer_graph_us", "dg.step"), ("rt", "graph_us", "stepgr"),
            ("rt", "graph_gpu_us", "rt gpu"), ("inv", "graph_gpu_us", "inv gpu"), ("pf", "eager_us", "pf eager"),
            ("pf", "graph_gpu_us", "pf gpu"), ("fi", "eager_us", "FI eager"),
            ("fi", "graph_us", "FI graph"), ("fi", "graph_gpu_us", "FI gpu")]
    plan = [("rt", "plan_us", "rt plan"), ("rt", "planner_us", "planner"), ("inv", "plan_us", "inv plan"),
            ("rt", "h2d_us", "rt h2d"),
            ("fi", "plan_us", "FI plan"), ("fi", "plan_host_us", "FI plan-h"), ("pf", "plan_us", "pf plan"),
            ("fi", "pf_plan_us", "FI pf"), ("fi", "pf_plan_host_us", "FI pf-h")]
    print(f"\nDecode overhead, {args.layers} layers/step, {H}/{HK} heads, D={D}, page {PS}, KV ~{args.kv}. {fi_note}")
    _table("host µs per layer, enqueue only (eager-b: cuda.bindings entry; dg.step: DecodeGraphs' default "
           "pool, one exec per layer; dg.step1: max_execs=1, one exec updated per layer; stepgr: whole-step "
           f"graph / layers; pf: BatchPrefillWrapper, {PREFILL_QO} query tokens per request)", host, rows)
    _table("µs per layer, wall (enqueue to synchronized) and GPU (events), step / layers; "
           "inv = batch-invariant mode", wall, rows, extra=("inv_vs_auto_gpu", "inv/auto"))
    _table("plan() host µs and plan copy device µs, per step (FI: page table as CUDA tensors; -h: indptr and "
           "last_page_len as CPU tensors; pf: prefill plans on the pf rows' inputs)", plan, rows,
           extra=("rt_vs_fi_rel_diff", "rt~FI"))
    busy = [("rt", "plan_busy_us", "rt busy"), ("fi", "plan_busy_us", "FI busy"), ("fi", "plan_host_busy_us", "FI-h busy")]
    _table("plan() host µs called right after a step was enqueued (the GPU busy: a plan that waits pays the "
           "step's remaining time)", busy, rows)
    summary(rows)
    print(f"# total {time.perf_counter() - t_start:.1f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "overhead.json"), "w") as f:
            json.dump(dict(config=dict(layers=args.layers, heads=[H, HK], head_dim=D, page_size=PS, kv=args.kv,
                                       flashinfer=fi_note), rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
