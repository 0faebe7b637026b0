#!/usr/bin/env python3
"""Cascade benchmark: rtattn's CascadeWrapper vs FlashInfer's cascade and single-format decode.

    source tools/peer_setup.sh && python tools/bench_cascade.py        # PERF.md rows + tree rows
    python tools/bench_cascade.py --rows 'p8192*' --no-flashinfer
    python tools/bench_cascade.py --plan                                # plan() host time, no GPU

Rows (shared/PERF.md "Composable formats"): decode, one shared prefix of 1K/8K/32K tokens x
batch 16/64, each request's own suffix 128 tokens, 32/8 heads, head_dim 128, page 16, bf16,
pages scattered. Tree rows ("automatic-level plans"): a system prompt shared by all, groups of
requests sharing their own prompt, suffix 128; rtattn builds the levels itself
(share_prefixes=True) and FlashInfer's cascade is given the same levels.

Libraries, one process, same inputs: fi-casc (MultiLevelCascadeAttentionWrapper), fi-cc and
fi-tc (BatchDecodeWithPagedKVCacheWrapper over each request's whole page table: single
format), rt-single (BatchDecodeWrapper, single format), rt-casc (CascadeWrapper, levels from
share_prefixes=True; m_tiles 2) and rt-m1 (the same with m_tiles 1). Every output is checked
against a float32 torch reference (relative error < 2e-2) after an eager call and after the
timed replays. Timing: tools/bench_common.time_graph (CUDA-graph replays, events, median).
"""
from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

HQ, HKV, D, PAGE, SUFFIX = 32, 8, 128, 16, 128
TOL = 2e-2
LIBS = ("rt-casc", "rt-m1", "rt-single", "fi-casc", "fi-cc", "fi-tc")
# PERF.md: FlashInfer cascade µs, single-format µs
PERF_MD = {(1024, 16): (24.3, 36.6), (1024, 64): (44.6, 119.0), (8192, 16): (36.0, 196.0),
           (8192, 64): (72.7, 750.4), (32768, 16): (64.8, 735.2), (32768, 64): (148.0, 2906.4)}


def rows():
    out = [(f"p{p}x{b}", dict(system=p, groups=((b, 0),))) for p in (1024, 8192, 32768) for b in (16, 64)]
    out += [("tree-1Kx8x8K", dict(system=1024, groups=((8, 8192),) * 8)),
            ("tree-4Kx16x1K", dict(system=4096, groups=((4, 1024),) * 16))]
    return out


def page_tables(spec: dict, seed: int = 0):
    """Requests = system prompt + their group's prompt + own suffix; page ids scattered."""
    rng = np.random.default_rng(seed)
    sp, gp, own = spec["system"] // PAGE, [g // PAGE for _, g in spec["groups"]], SUFFIX // PAGE
    B = sum(n for n, _ in spec["groups"])
    total = sp + sum(gp) + B * own
    ids = rng.permutation(total).astype(np.int32)
    system, at, reqs = ids[:sp], sp, []
    for (n, _), p in zip(spec["groups"], gp):
        group, at = ids[at:at + p], at + p
        for _ in range(n):
            reqs.append(np.concatenate([system, group, ids[at:at + own]]))
            at += own
    kv_indptr = np.zeros(B + 1, np.int32)
    kv_indptr[1:] = np.cumsum([len(r) for r in reqs])
    return kv_indptr, np.concatenate(reqs), np.full(B, PAGE, np.int32), total


# ---------------------------------------------------------------- plan() host time (CPU)
def bench_plan(reps: int) -> None:
    from rtattn.plan.cascade import CascadePlanner
    from rtattn.plan.inspector import Planner
    from rtattn.plan.prefix_tree import share_prefixes

    def med(f):
        for _ in range(20):
            f()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts) * 1e6)

    print(f"plan() host time, h200 description, {HQ}/{HKV} heads, page {PAGE} (median us of {reps}; "
          f"plain and cascade interleaved)")
    print(f"{'row':>14} {'batch':>5} {'levels':>6} {'plain':>8} {'cascade':>8} {'ratio':>6} {'levels given':>12}")
    for name, spec in rows():
        kv_indptr, idx, last, total = page_tables(spec)
        B = len(last)
        qo = np.arange(B + 1, dtype=np.int32)
        plain = Planner(B, B, int(kv_indptr[-1]), HQ, HKV, D, PAGE)
        pbuf = plain.layout.allocate()
        casc = CascadePlanner.create(B, B, total, HQ, HKV, D, PAGE, num_levels=3, max_rows=32)
        cbuf = casc.planset.allocate()
        lv = share_prefixes(kv_indptr, idx, last, PAGE, max_levels=3)
        a = b = c = None
        for _ in range(3):   # interleaved: a busy shared CPU slows all alike
            a1 = med(lambda: plain.plan(qo, kv_indptr, idx, last, out=pbuf))
            b1 = med(lambda: casc.plan_shared(None, kv_indptr, idx, last, out=cbuf))
            c1 = med(lambda: casc.plan(lv, out=cbuf))
            a, b, c = min(a or a1, a1), min(b or b1, b1), min(c or c1, c1)
        print(f"{name:>14} {B:5d} {len(lv):6d} {a:8.1f} {b:8.1f} {b / a:6.2f} {c:12.1f}")


# ---------------------------------------------------------------- GPU
class Inputs:
    def __init__(self, spec: dict, seed: int = 0):
        import torch
        self.kv_indptr, self.idx, self.last, self.pages = page_tables(spec, seed)
        self.B = len(self.last)
        self.lens = np.diff(self.kv_indptr).astype(np.int64) * PAGE
        self.unique_bytes = self.pages * PAGE * HKV * D * 2 * bc.BF16 + 2 * self.B * HQ * D * bc.BF16
        self.copies = bc.rotation_copies(self.unique_bytes)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        dt = torch.bfloat16
        self.q = torch.randn(self.copies, self.B, HQ, D, generator=g, device="cuda").to(dt)
        kv = torch.randn(2, self.pages, PAGE, HKV, D, generator=g, device="cuda").to(dt)
        self.k = kv[0].repeat(self.copies, 1, 1, 1)
        self.v = kv[1].repeat(self.copies, 1, 1, 1)
        P = self.pages
        self.kv = [(self.k[c * P:(c + 1) * P], self.v[c * P:(c + 1) * P]) for c in range(self.copies)]
        self.ref = self._reference()

    def _reference(self):
        import torch
        pages = torch.from_numpy(self.idx.astype(np.int64)).cuda()
        k0, v0 = self.kv[0]
        out = torch.empty(self.B, HQ, D, device="cuda")
        g = HQ // HKV
        for b in range(self.B):
            p = pages[int(self.kv_indptr[b]):int(self.kv_indptr[b + 1])]
            k, v = k0[p].reshape(-1, HKV, D).float(), v0[p].reshape(-1, HKV, D).float()
            qb = self.q[0, b].float().view(HKV, g, D)
            w = torch.softmax(torch.einsum("hgd,lhd->hgl", qb, k) / math.sqrt(D), dim=-1)
            out[b] = torch.einsum("hgl,lhd->hgd", w, v).reshape(HQ, D)
        return out

    def rel_err(self, outs) -> float:
        return bc.worst_rel_err(outs, self.ref)

    def new_outs(self):
        import torch
        return [torch.full_like(self.q[c], float("nan")) for c in range(self.copies)]


def measure(x: Inputs, stream, calls, outs, samples: int) -> dict:
    import torch
    calls[0]()
    torch.cuda.synchronize()
    err0 = x.rel_err(outs[:1])
    for o in outs:
        o.fill_(float("nan"))
    n = bc.launches_per_graph(bc.estimate_us(x.unique_bytes), x.copies)
    t = bc.time_graph(calls, stream, n, samples=samples)
    err = max(err0, x.rel_err(outs))
    return {"us": t["median"], "err": err, "ok": err < TOL}


def fi_levels(x: Inputs):
    import torch
    from rtattn.plan.prefix_tree import share_prefixes
    lv = share_prefixes(x.kv_indptr, x.idx, x.last, PAGE, max_levels=3)
    return [[torch.from_numpy(np.ascontiguousarray(getattr(l, f))).int().cuda() for l in lv]
            for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")]


def bench_lib(lib: str, x: Inputs, stream, ws, samples: int) -> dict:
    import torch
    outs = x.new_outs()
    info = {}
    if lib == "fi-casc":
        import flashinfer
        qo, kvp, ids, last = fi_levels(x)
        w = flashinfer.MultiLevelCascadeAttentionWrapper(len(qo), ws, "NHD")
        w.plan(qo, kvp, ids, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        try:   # write into our output where this version takes out= (else one copy, ~1 µs)
            w.run(x.q[0], x.kv[0], out=outs[0])
            calls = [lambda c=c: w.run(x.q[c], x.kv[c], out=outs[c]) for c in range(x.copies)]
        except TypeError:
            calls = [lambda c=c: outs[c].copy_(w.run(x.q[c], x.kv[c])) for c in range(x.copies)]
            info["copy"] = True
        info["levels"] = len(qo)
    elif lib in ("fi-cc", "fi-tc"):
        import flashinfer
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=lib == "fi-tc")
        a = [torch.from_numpy(t).cuda() for t in (x.kv_indptr, x.idx, x.last)]
        w.plan(*a, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        calls = [lambda c=c: w.run(x.q[c], x.kv[c], out=outs[c]) for c in range(x.copies)]
    elif lib == "rt-single":
        from rtattn import BatchDecodeWrapper
        w = BatchDecodeWrapper(HQ, HKV, D, PAGE, max_batch=x.B, max_pages=int(x.kv_indptr[-1]))
        w.plan(x.kv_indptr, x.idx, x.last, stream=stream)
        launches = [w.prepare(x.q[c], *x.kv[c], out=outs[c], stream=stream) for c in range(x.copies)]
        calls = [lambda l=l: l(torch.cuda.current_stream()) for l in launches]
    else:
        from rtattn import CascadeWrapper
        w = CascadeWrapper(3, HQ, HKV, D, PAGE, max_batch=x.B, max_pages=x.pages, m_tiles=1 if lib == "rt-m1" else 2)
        t0 = time.perf_counter()
        w.plan(None, x.kv_indptr, x.idx, x.last, share_prefixes=True, stream=stream)
        info.update(plan_us=(time.perf_counter() - t0) * 1e6, levels=w.info.num_levels,
                    items=w.info.plan.num_items, kv_tokens=w.info.level_kv_tokens.tolist())
        launches = [w.prepare(x.q[c], *x.kv[c], out=outs[c], stream=stream) for c in range(x.copies)]
        calls = [lambda l=l: l(torch.cuda.current_stream()) for l in launches]
    torch.cuda.synchronize()
    res = measure(x, stream, calls, outs, samples)
    res.update(info)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["*"], help="row name patterns (fnmatch)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated subset of " + ",".join(LIBS))
    ap.add_argument("--plan", action="store_true", help="plan() host time only (no GPU)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds; later rows are skipped")
    a = ap.parse_args(argv)
    if a.plan:
        bench_plan(a.reps)
        return 0
    import torch
    t_start = time.perf_counter()
    libs = [x for x in a.libs.split(",") if not (a.no_flashinfer and x.startswith("fi-"))]
    if set(libs) - set(LIBS):
        ap.error(f"--libs: unknown {sorted(set(libs) - set(LIBS))}; choose from {LIBS}")
    stream = torch.cuda.Stream()
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"warm clocks: {bc.warm_clocks():.0f} TFLOP/s", flush=True)
    table, failed = [], False
    for name, spec in rows():
        if not any(fnmatch.fnmatch(name, p) for p in a.rows):
            continue
        if time.perf_counter() - t_start > a.deadline:
            print(f"{name}: skipped (deadline)", flush=True)
            continue
        x = Inputs(spec)
        res = {}
        for lib in libs:
            try:
                res[lib] = bench_lib(lib, x, stream, ws, a.samples)
            except Exception as e:   # a peer that fails is reported, the row goes on
                res[lib] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc(limit=2)
            r = res[lib]
            print(f"{name:>14} {lib:>9}: " + (f"{r['us']:8.1f} us err {r['err']:.1e}" if "us" in r else r["error"])
                  + "".join(f" {k}={r[k]}" for k in ("levels", "items", "kv_tokens", "plan_us") if k in r), flush=True)
            failed |= "us" in r and not r["ok"] and lib.startswith("rt")
        table.append((name, res))
        del x
        torch.cuda.empty_cache()
    us = lambda r: r.get("us") if r and r.get("ok") else None  # noqa: E731
    print("\n| row | rt cascade µs | rt m1 µs | FI cascade µs | rt / FI cascade | rt single µs | FI single (best) µs "
          "| rt speedup vs FI single | FI speedup (PERF.md) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, res in table:
        rc, m1, fc, rs = (us(res.get(k, {})) for k in ("rt-casc", "rt-m1", "fi-casc", "rt-single"))
        fs = min([v for v in (us(res.get("fi-cc", {})), us(res.get("fi-tc", {}))) if v], default=None)
        best = min([v for v in (rc, m1) if v], default=None)
        pm = PERF_MD.get(tuple(int(t) for t in name[1:].split("x"))) if name.startswith("p") else None
        f = lambda v, s="{:.1f}": s.format(v) if v else "—"  # noqa: E731
        print(f"| {name} | {f(rc)} | {f(m1)} | {f(fc)} | {f(best / fc if best and fc else None, '{:.2f}')} | {f(rs)} "
              f"| {f(fs)} | {f(fs / best if fs and best else None, '{:.2f}')} | "
              f"{f(pm[1] / pm[0] if pm else None, '{:.2f}')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
