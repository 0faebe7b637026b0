"""Host time of Planner.plan() vs batch size, decode and prefill.

    python tools/bench_plan.py [--device h200] [--heads 32/8] [--reps 400]

Median over many runs of the full plan() call (validation + Algorithm 1 +
writing the plan into a reused host buffer), heavy-tailed KV lengths (mean
~1024, up to 32K), page size 16.  FlashInfer's decode plan() takes 75-165 us
for batch 16-256 on our machine (shared/PERF.md).

verify: bench_overhead's prefill rows (4 query tokens per request, KV U(768, 1280), causal, the
prefill family's tile) on --verify-ctas CTAs (66: the H200's prefill wrapper grid), planned by the
tile-table path (rtattn.plan.tile_table) and, in the `numpy us` column, by the numpy path
(Planner.tile_table_path = False) on the same inputs: byte-identical plans, docs/perf-log.md "Host path v6".
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from rtattn.plan.inspector import Planner
from rtattn.plan.layout import indptr_from_lengths, paged_kv


def kv_lengths(rng, batch):
    return np.clip((rng.pareto(1.5, batch) + 1) * 350, 16, 32768).astype(np.int64)


def bench(planner, qo, kv, reps):
    kvp, idx, last = paged_kv(kv, planner.page_size, shuffle_seed=0)
    args = (indptr_from_lengths(qo).astype(np.int32), kvp, idx, last)
    buf = planner.layout.allocate()
    for _ in range(20):
        planner.plan(*args, out=buf)
    ts = np.empty(reps)
    for i in range(reps):
        t = time.perf_counter()
        info = planner.plan(*args, out=buf)
        ts[i] = time.perf_counter() - t
    return float(np.median(ts) * 1e6), float(np.percentile(ts, 90) * 1e6), info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h200")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--verify-ctas", type=int, default=66, help="grid of the verify rows (the H200 prefill wrapper's)")
    a = ap.parse_args(argv)
    hq, hk = (int(x) for x in a.heads.split("/"))
    rng = np.random.default_rng(0)
    print(f"plan() host time, {a.device}, heads {a.heads}, D={a.head_dim}, page "
          f"{a.page_size}, mode {a.mode}, heavy-tailed KV (median / p90 us)")
    print(f"{'kind':8} {'batch':>6} {'q len':>8} {'tile_q':>6} {'items':>6} {'splits':>6} "
          f"{'median us':>10} {'p90 us':>8} {'numpy us':>9}")
    for kind in ("decode", "prefill", "verify"):
        for batch in (1, 4, 16, 64, 128, 256, 512, 1024):
            kv = kv_lengths(rng, batch)
            ctas = None
            if kind == "decode":
                qo = np.ones(batch, np.int64)
                qdesc = "1"
            elif kind == "verify":
                qo = np.full(batch, 4, np.int64)
                kv = rng.integers(768, 1281, batch)
                qdesc, ctas = "4", a.verify_ctas
            else:
                qo = rng.integers(128, 513, batch)
                kv = kv + qo
                qdesc = "128-512"
            max_pages = int(sum(-(-kv // a.page_size))) + 1
            def planner():
                return Planner(batch, int(qo.sum()), max_pages, hq, hk, a.head_dim, a.page_size,
                               device=a.device, mode=a.mode, max_qo_len=int(qo.max()),
                               causal=kind != "decode", kernel="decode" if kind == "decode" else "prefill",
                               num_ctas=ctas)
            reps = a.reps if batch <= 256 else a.reps // 4
            p = planner()
            med, p90, info = bench(p, qo, kv, reps)
            numpy_us = "-"
            if kind == "verify":
                ref = planner()
                ref.tile_table_path = False
                numpy_us = f"{bench(ref, qo, kv, reps)[0]:.1f}"
            print(f"{kind:8} {batch:6d} {qdesc:>8} {p.tile_q:6d} {info.num_items:6d} "
                  f"{info.num_split_tiles:6d} {med:10.1f} {p90:8.1f} {numpy_us:>9}")


if __name__ == "__main__":
    main()
