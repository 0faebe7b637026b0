"""A CPU model of the L2 traffic of the persistent prefill kernel executing a plan (NOT a GPU
measurement: docs/perf-log.md "prefill queue order", issue 10).

    python tools/model_l2.py                                  # bench_prefill's rows x head groups x head dims
    python tools/model_l2.py --rows 16x1024 --shapes 32:32:128:16 --orders lpt request --l2-mb 30 50

Model. The plan is the real Planner's (the wrapper's tile, grid and planner on an H200). Kernel
grid (num_ctas, H_kv), all CTAs resident (num_ctas x H_kv <= SMs x CTAs per SM by
construction): CTA (c, h) runs queue c's items back to back; an item takes its planner cost in
KV-token time units (COST_ALPHA q + COST_GAMMA first, then one unit per KV token), reading its
KV range in ascending lines of `tile_kv` tokens (one line = K + V of tile_kv tokens of one KV
head). Every CTA of a queue runs in lockstep with the other heads'; reads at the same time are
ordered by (queue, head). The reads, (request, KV head, line), go through an LRU cache of
`--l2-mb` (the H200 has 60 MB in two partitions; a line may live in both, so 30 MB is the
conservative figure). HBM KV bytes = misses x line bytes; the ideal reads every (request, head)
line once. The "grid" order is a reference, not a plan: a non-persistent grid (x: the tiles in
request-major order, y: KV heads), blocks dispatched in that order onto SMs x CTAs-per-SM slots
as they free -- how FlashInfer's fa2 prefill is assumed to run (its tiles taken as ours).
"""
from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rtattn.families import prefill as family  # noqa: E402
from rtattn.plan import devices  # noqa: E402
from rtattn.plan.costs import COST_ALPHA, COST_GAMMA  # noqa: E402
from rtattn.plan.inspector import Planner  # noqa: E402
from rtattn.plan.layout import paged_kv  # noqa: E402

ROWS = ("16x1024", "32x512", "4x4096", "1x16384", "chunk16x4096+512", "16xheavy1024", "16xU512-1024")
SHAPES = tuple(f"32:{hkv}:{d}:16" for d in (128, 64, 256) for hkv in (32, 8, 4, 1))
BF16 = 2
HBM_TBPS, TFLOPS = 4.0, 300.0   # for scale only: HBM time of the bytes, compute time of the FLOPs (measured ballpark)


def planner_for(hq, hkv, d, page, qo, kv, device="h200", **kw) -> Planner:
    """BatchPrefillWrapper.__init__'s tile, grid and planner for bench_prefill's row (causal, paged)."""
    dev = devices.get_device(device)
    g = hq // hkv
    mql = int(qo.max())
    pages = int(((kv + page - 1) // page).sum())
    tile = family.choose_tile(dev, d, g, float(min(mql, 1024)), paged=True, avg_kv_len=pages * page / len(qo))
    cfg = family.tile_config(tile, d, g)
    num_ctas = max(1, dev.sm_count * cfg.ctas_per_sm // hkv)
    return Planner(len(qo), int(qo.sum()), pages, hq, hkv, d, page, device=dev, mode="auto", causal=True,
                   num_ctas=num_ctas, tile=cfg, kernel="prefill", max_qo_len=mql, **kw)


def plan_items(p: Planner, qo, kv):
    """(info, queues): queues[c] = int64 [n_c, 4] rows (request, kv_start, kv_end, cost) in queue order."""
    info = p.plan_lengths(qo, kv)
    v, n = info.views, info.num_items
    wi = v["work_indptr"][:p.num_ctas + 1].astype(np.int64)
    req, ql = v["item_request"][:n].astype(np.int64), v["item_qo_len"][:n].astype(np.int64)
    ks, ke = v["item_kv_start"][:n].astype(np.int64), v["item_kv_end"][:n].astype(np.int64)
    cost = ke - ks + COST_ALPHA * ql + COST_GAMMA
    rows = np.stack([req, ks, ke, cost], axis=1)
    return info, [rows[wi[c]:wi[c + 1]] for c in range(p.num_ctas)]


def item_reads(items: np.ndarray, start: np.ndarray, line: int, max_lines: int):
    """(time, line key without the head) of every line read by items [n, 4] starting at `start`."""
    req, ks, ke, cost = items.T
    first, last = ks // line, -(-ke // line)
    cnt = np.maximum(last - first, 0)
    owner = np.repeat(np.arange(items.shape[0]), cnt)
    pos = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    ln = first[owner] + pos
    fixed = cost - (ke - ks)
    t = start[owner] + fixed[owner] + np.maximum(ln * line - ks[owner], 0)
    return t, req[owner] * max_lines + ln


def persistent_reads(queues, H: int, line: int, max_lines: int) -> np.ndarray:
    """Line keys of the persistent kernel in time order (ties: queue, then head)."""
    ts, cs, keys = [], [], []
    for c, q in enumerate(queues):
        if not len(q):
            continue
        start = np.cumsum(q[:, 3]) - q[:, 3]
        t, k = item_reads(q, start, line, max_lines)
        ts.append(t)
        cs.append(np.full(t.shape[0], c))
        keys.append(k)
    t, c, k = (np.concatenate(a) for a in (ts, cs, keys))
    o = np.lexsort((c, t))
    t, c, k = t[o], c[o], k[o]
    # every head of a queue reads the same lines at the same times: expand heads innermost
    return (k[:, None] * H + np.arange(H)[None, :]).reshape(-1)


def grid_reads(tiles: np.ndarray, H: int, slots: int, line: int, max_lines: int) -> np.ndarray:
    """Line keys of a non-persistent grid (x: `tiles` [n, 4] in order, y: heads), blocks
    dispatched in (head, tile) order onto `slots` as they free."""
    n = tiles.shape[0]
    free = [(0, s) for s in range(slots)]
    start = np.empty(n * H, dtype=np.int64)
    for b in range(n * H):   # block b = (head b // n, tile b % n)
        t0, s = heapq.heappop(free)
        start[b] = t0
        heapq.heappush(free, (t0 + int(tiles[b % n, 3]), s))
    ts, keys = [], []
    for h in range(H):
        t, k = item_reads(tiles, start[h * n:(h + 1) * n], line, max_lines)
        ts.append(t)
        keys.append(k * H + h)
    t, k = np.concatenate(ts), np.concatenate(keys)
    return k[np.argsort(t, kind="stable")]


def lru_misses(keys: np.ndarray, capacity: int) -> int:
    cache, misses = OrderedDict(), 0
    move, pop = cache.move_to_end, cache.popitem
    for k in keys.tolist():
        if k in cache:
            move(k)
        else:
            misses += 1
            cache[k] = None
            if len(cache) > capacity:
                pop(last=False)
    return misses


def balance(queues) -> float:
    loads = np.array([int(q[:, 3].sum()) if len(q) else 0 for q in queues])
    return float(loads.max() / loads.mean())


def row_lengths(name: str):
    import bench_prefill as bp
    (row,) = bp.select_rows([name])
    qo = row.lengths()
    return qo, qo + row.cached


def model(row: str, shape: str, orders, l2_mb, device="h200", qo=None, kv=None):
    hq, hkv, d, page = (int(x) for x in shape.split(":"))
    if qo is None:
        qo, kv = row_lengths(row)
    qo, kv = np.asarray(qo, dtype=np.int64), np.asarray(kv, dtype=np.int64)
    p = planner_for(hq, hkv, d, page, qo, kv, device)
    dev = devices.get_device(device)
    slots = dev.sm_count * p.tile.ctas_per_sm
    info, queues = plan_items(p, qo, kv)
    lpt_top = info.max_load
    line = p.tile.tile_kv
    line_bytes = line * d * 2 * BF16
    max_lines = -(-int(kv.max()) // line) + 1
    ideal = int((-(-kv // line)).sum()) * hkv * line_bytes
    pairs = int(sum(sum(range(k - q + 1, k + 1)) for q, k in zip(qo.tolist(), kv.tolist())))   # causal
    v, n = info.views, info.num_items   # the tiles' products: every row of an item against its KV
    work = int((v["item_qo_len"][:n].astype(np.int64) * (v["item_kv_end"][:n] - v["item_kv_start"][:n])).sum())
    out = dict(row=row, shape=shape, tile=f"q{p.tile_q}x{p.tile.tile_kv}", ctas=p.num_ctas, items=info.num_items,
               mode=info.mode, ideal_mb=ideal / 1e6, qo_mb=int(qo.sum()) * hq * d * 2 * BF16 / 1e6,
               compute_us=4 * hq * d * pairs / (TFLOPS * 1e6), work=work / pairs, orders={})
    for o in orders:
        taken = ""
        if o == "lpt":
            qs, keys = queues, None
        elif o == "request":   # the planner's option (rtattn.plan.order)
            rinfo, qs = plan_items(planner_for(hq, hkv, d, page, qo, kv, device, queue_order="request"), qo, kv)
            taken = rinfo.queue_order
        elif o == "grid":
            qs = None
            tiles = np.concatenate([q for q in queues if len(q)])
            tiles = tiles[np.lexsort((tiles[:, 1], -tiles[:, 2], tiles[:, 0]))]   # request-major
            keys = grid_reads(tiles, hkv, slots, line, max_lines)
        else:
            raise SystemExit(f"unknown order {o!r}")
        if qs is not None:
            keys = persistent_reads(qs, hkv, line, max_lines)
        res = {"balance": balance(qs) if qs is not None else float("nan"), "taken": taken,
               "vs_lpt": max(int(q[:, 3].sum()) for q in qs if len(q)) / lpt_top if qs is not None else float("nan"),
               "reads_mb": keys.shape[0] * line_bytes / 1e6}
        for mb in l2_mb:
            res[mb] = lru_misses(keys, int(mb * 2**20) // line_bytes) * line_bytes / 1e6
        out["orders"][o] = res
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="HQ:HKV:D:PAGE")
    ap.add_argument("--orders", nargs="+", default=["lpt", "request", "grid"])
    ap.add_argument("--l2-mb", nargs="+", type=float, default=[30.0, 50.0])
    a = ap.parse_args(argv)
    print(f"KV MB read from HBM per order at L2 sizes {a.l2_mb} MB (x: over the ideal, every (request, head) line "
          f"once); us: the last size's bytes at {HBM_TBPS} TB/s (compute: the FLOPs at {TFLOPS} TFLOP/s); "
          f"bal: heaviest queue / LPT's; [lpt]: the planner kept LPT's order; work: (query, key) products of the "
          f"tiles over the attended pairs (the causal diagonal's waste)")
    for shape in a.shapes:
        for row in a.rows:
            r = model(row, shape, a.orders, a.l2_mb)
            cells = []
            for o, res in r["orders"].items():
                xs = "/".join(f"{res[mb]:.0f}" for mb in a.l2_mb)
                rel = "/".join(f"{res[mb] / r['ideal_mb']:.2f}" for mb in a.l2_mb)
                us = res[a.l2_mb[-1]] / HBM_TBPS   # (MB / (TB/s) = us)
                bal = f" bal {res['vs_lpt']:.3f}" if o != "lpt" and res["vs_lpt"] == res["vs_lpt"] else ""
                tag = f" [{res['taken']}]" if res["taken"] not in ("", o) else ""
                cells.append(f"{o}{tag} {xs} ({rel}x, {us:.0f} us){bal}")
            print(f"{shape:13s} {row:17s} {r['tile']:8s} C {r['ctas']:3d} n {r['items']:4d} {r['mode'][:4]} "
                  f"ideal {r['ideal_mb']:.0f} compute {r['compute_us']:.0f} us work {r['work']:.2f} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
