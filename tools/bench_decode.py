#!/usr/bin/env python3
"""Decode benchmark: rtattn vs FlashInfer 0.7.4 on the shared/PERF.md rows, one process.

    source tools/peer_setup.sh && python tools/bench_decode.py            # every row but the n-* ones
    python tools/bench_decode.py --nbhd                                   # the neighbourhood (n-*), 14 rows
    python tools/bench_decode.py --quick                                  # 3 rows
    python tools/bench_decode.py --quick --fp8                            # 3 rows + the fp8 KV rows
    python tools/bench_decode.py --rows 'b16-*-kv4' s256x4096 --no-flashinfer
    python tools/bench_decode.py --rows 'g*' --rt-modes auto auto+prefill  # both families (family choice)
    python tools/bench_decode.py --selftest                               # no GPU needed

bf16, head_dim 128, page 16, NHD, pages scattered (random permutation of page ids), unless a
row says otherwise: variant rows (v*: soft-cap, sliding window, attention sinks), wide head
groups (g16-*, g32-*), token-level pages (p1-*) and the neighbourhood (n-*: heads 28/4, 40/8, 64/8,
16/8 d256 with soft-cap 50, 32/32 on 128-token pages, 8/1 on 2-token pages, batch 1 to 512; only with
--nbhd or --rows) name their variant, heads and page size.
Window rows count the bytes of the KV a query can see (min(kv, window + 1) tokens). FlashInfer
0.7.4's cc/tc decode has no attention sinks: sinks rows time its plain (or window) path, a
lower bound of what a sink would cost it. fp8 rows (f8-*, -e4m3 / -e5m2): bf16 q, a KV cache of
N(0,1) values rounded to fp8 by torch, scales 1 in both libraries (FlashInfer applies v_scale != 1
as an extra kernel), 1 byte per KV element; FlashInfer's fp8 decode (cc, tc) in the same run.
Lengths are drawn at stratified quantiles (the i-th smallest of B at p = (i + 0.5) / B, order
shuffled by a seeded rng): U(lo, hi) rows, and heavy-tailed rows = lognormal(sigma 1.2)
rescaled to mean exactly 1024, clipped to [1, 16384] (tools/bench_common.lengths_heavy). Bytes = K+V read + q + o (shared/PERF.md).

Two passes over the same cached inputs: FlashInfer first ("cc" = CUDA-core decode,
"tc" = tensor-core decode, backend defaults), then rtattn; so a crashing rtattn kernel
(sticky CUDA error) cannot take FlashInfer's numbers with it. Every output is checked
against a float32 torch reference (relative error norm < 2e-2) after an eager call and
again after the timed graph replays (outputs poisoned with NaN in between).
Timing: tools/bench_common.time_graph (CUDA-graph replays, events, median).
A watchdog prints whatever has been measured when --deadline seconds have passed.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

HEAD_DIM, PAGE = 128, 16
TOL = 2e-2
LIBS = ("fi-cc", "fi-tc", "rt")


# ---------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    name: str
    label: str
    hq: int
    hkv: int
    gen: Callable  # rng -> kv lengths
    perf_md: tuple  # PERF.md FlashInfer (cc µs, tc µs); None where not measured
    seed: str  # rows of one distribution share lengths and page tables across head counts
    head_dim: int = HEAD_DIM
    page: int = PAGE
    soft_cap: float | None = None
    window: int | None = None   # window_left
    sinks: bool = False
    twin: str | None = None     # the plain row reading the same KV (variant cost = this / twin)
    kv: str = "bfloat16"        # KV cache element type: bfloat16, float8_e4m3fn or float8_e5m2

    def lengths(self) -> np.ndarray:
        return self.gen(bc.rng_for(self.seed))

    @property
    def variant(self) -> str:
        """rtattn's built-in variant for the row."""
        if self.sinks:
            return "sliding_window_sinks" if self.window is not None else "sinks"
        if self.soft_cap is not None:
            return "soft_cap"
        return "plain" if self.window is None else "sliding_window"

    def visible(self, lens) -> np.ndarray:
        """KV tokens a decode query sees (all, or its window)."""
        return lens if self.window is None else np.minimum(lens, self.window + 1)


def _rows() -> list[Row]:
    dists = {"all1024": ("16x1024", lambda r: np.full(16, 1024, np.int64)),
             "u512": ("16xU(512,1024)", lambda r: bc.lengths_uniform(r, 16, 512, 1024)),
             "heavy": ("16xheavy(1024)", lambda r: bc.lengths_heavy(r, 16, 1024))}
    ref = {(32, "all1024"): (79.3, 76.7), (32, "u512"): (62.2, 61.4), (32, "heavy"): (84.7, 119.2),
           (8, "all1024"): (33.0, 29.0), (8, "u512"): (29.5, 24.8), (8, "heavy"): (35.8, 28.8),
           (4, "all1024"): (29.1, 20.1), (4, "u512"): (28.3, 17.7), (4, "heavy"): (34.2, 21.3)}
    rows = [Row(f"b16-{d}-kv{hkv}", f"{lab} 32/{hkv}", 32, hkv, gen, ref[hkv, d], f"b16-{d}")
            for hkv in (32, 8, 4) for d, (lab, gen) in dists.items()]
    serving = [("s64x4096", "64x4096", lambda r: np.full(64, 4096, np.int64), 392.6),
               ("s256x4096", "256x4096", lambda r: np.full(256, 4096, np.int64), 1421.2),
               ("s32xU4k-16k", "32xU(4096,16384)", lambda r: bc.lengths_uniform(r, 32, 4096, 16384), 503.9),
               ("s1x32k+63x512", "1x32768+63x512",
                lambda r: np.array([32768] + [512] * 63, np.int64), 108.3),
               ("s1x32k", "1x32768", lambda r: np.array([32768], np.int64), 59.1)]
    rows += [Row(n, f"{lab} 32/8", 32, 8, gen, (cc, None), n) for n, lab, gen, cc in serving]
    c1024 = lambda r: np.full(16, 1024, np.int64)  # noqa: E731
    c8192 = lambda r: np.full(16, 8192, np.int64)  # noqa: E731
    c4096 = lambda r: np.full(64, 4096, np.int64)  # noqa: E731
    c2048 = lambda r: np.full(64, 2048, np.int64)  # noqa: E731
    rows += [  # issue 11: variants (compare with the plain row of the same KV read), groups, pages
        Row("v16x1024-cap30", "16x1024 cap30 32/8", 32, 8, c1024, (None, 28.2), "b16-all1024", soft_cap=30.0,
            twin="b16-all1024-kv8"),
        Row("v64x4096-cap30", "64x4096 cap30 32/8", 32, 8, c4096, (401.8, 251.1), "s64x4096", soft_cap=30.0, twin="s64x4096"),
        Row("v16x8192-win1023", "16x8192 win1023 32/8", 32, 8, c8192, (None,), "v16x8192", window=1023,
            twin="b16-all1024-kv8"),
        Row("v16x1024-sinks", "16x1024 sinks 32/8", 32, 8, c1024, (None,), "b16-all1024", sinks=True,
            twin="b16-all1024-kv8"),
        Row("v16x8192-win127-sinks", "16x8192 win127+sinks 32/8", 32, 8, c8192, (None,), "v16x8192",
            window=127, sinks=True),
        Row("g16-64x2048", "64x2048 32/2 (g=16)", 32, 2, c2048, (170.5, 46.7), "g-64x2048"),
        Row("g32-64x2048", "64x2048 32/1 (g=32)", 32, 1, c2048, (None, 33.2), "g-64x2048"),
        Row("p1-16x1024-kv8", "16x1024 32/8 page 1", 32, 8, c1024, (None,), "b16-all1024", page=1),
        Row("p1-64x4096-kv8", "64x4096 32/8 page 1", 32, 8, c4096, (None,), "s64x4096", page=1),
        Row("d256-16x1024-kv8", "16x1024 32/8 d256", 32, 8, c1024, (None,), "b16-all1024", head_dim=256),
        Row("d256-16x1024-cap30", "16x1024 cap30 32/8 d256", 32, 8, c1024, (None,), "b16-all1024",
            head_dim=256, soft_cap=30.0, twin="d256-16x1024-kv8"),
    ]
    # fp8 KV against FlashInfer's fp8 decode (PERF.md: its CUDA-core path, e4m3)
    by_name = {r.name: r for r in rows}
    for name, base, kv, cc in (("f8-16x1024-kv8-e4m3", "b16-all1024-kv8", "float8_e4m3fn", 40.4),
                               ("f8-64x4096-e4m3", "s64x4096", "float8_e4m3fn", 486.2),
                               ("f8-256x4096-e4m3", "s256x4096", "float8_e4m3fn", 1811.0),
                               ("f8-256x4096-e5m2", "s256x4096", "float8_e5m2", None)):
        r = by_name[base]
        rows.append(Row(name, f"{r.label} {name[-4:]}", r.hq, r.hkv, r.gen, (cc, None), r.seed, kv=kv))
    return rows + _nbhd_rows(c1024, c4096, c2048)


def _nbhd_rows(c1024, c4096, c2048) -> list[Row]:
    """The neighbourhood (n-*): shapes of real models and batches no other row has -- head groups
    5 and 7, 64 query heads, Gemma-2's d256 16/8 with its soft-cap 50, MHA on 128-token pages, one
    KV head on 2-token pages, d64 on 64-token pages, batch 1 x 32K, 512 x 512, 128 heavy-tailed.
    No PERF.md figure for any; FlashInfer in the same run is the peer."""
    none = (None,)
    c16k4 = lambda r: np.full(16, 4096, np.int64)  # noqa: E731
    return [
        Row("n-q28k4-16x1024", "16x1024 28/4 (g=7)", 28, 4, c1024, none, "b16-all1024"),
        Row("n-q28k4-64x4096", "64x4096 28/4 (g=7)", 28, 4, c4096, none, "s64x4096"),
        Row("n-q40k8-16x1024", "16x1024 40/8 (g=5)", 40, 8, c1024, none, "b16-all1024"),
        Row("n-q40k8-64x4096", "64x4096 40/8 (g=5)", 40, 8, c4096, none, "s64x4096"),
        Row("n-q64k8-64x4096", "64x4096 64/8", 64, 8, c4096, none, "s64x4096"),
        Row("n-q16k8-d256-16x4096", "16x4096 16/8 d256", 16, 8, c16k4, none, "n-16x4096", head_dim=256),
        Row("n-q16k8-d256-cap50", "16x4096 cap50 16/8 d256", 16, 8, c16k4, none, "n-16x4096", head_dim=256,
            soft_cap=50.0, twin="n-q16k8-d256-16x4096"),
        Row("n-q32k32-p128-16x1024", "16x1024 32/32 page 128", 32, 32, c1024, none, "b16-all1024", page=128),
        Row("n-q8k1-p2-16x1024", "16x1024 8/1 page 2", 8, 1, c1024, none, "b16-all1024", page=2),
        Row("n-q28k4-p4-64x2048", "64x2048 28/4 page 4", 28, 4, c2048, none, "g-64x2048", page=4),
        Row("n-q28k4-1x32768", "1x32768 28/4 (g=7)", 28, 4, lambda r: np.array([32768], np.int64), none, "s1x32k"),
        Row("n-512x512", "512x512 32/8", 32, 8, lambda r: np.full(512, 512, np.int64), none, "n-512x512"),
        Row("n-128xheavy1024", "128xheavy(1024) 32/8", 32, 8, lambda r: bc.lengths_heavy(r, 128, 1024), none,
            "n-128xheavy1024"),
        Row("n-d64-p64-64x2048", "64x2048 32/8 d64 page 64", 32, 8, c2048, none, "g-64x2048", head_dim=64, page=64),
    ]


ROWS = _rows()
QUICK = ["b16-all1024-kv4", "b16-heavy-kv8", "s256x4096"]
NEW = ["b16-all1024-kv8", "s64x4096", "v*", "g*", "p1-*", "d256-*"]   # issue 11's rows and their plain twins
FP8 = ["f8-*"]
NBHD = ["n-*"]   # the neighbourhood (_nbhd_rows): only when asked for (--nbhd, --rows 'n-*')


def select_rows(patterns) -> list[Row]:
    if not patterns:   # every row but the neighbourhood's
        return [r for r in ROWS if not any(fnmatch.fnmatchcase(r.name, p) for p in NBHD)]
    picked = [r for r in ROWS if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in ROWS)]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; rows are: {' '.join(r.name for r in ROWS)}")
    return picked


def row_bytes(row: Row, lens) -> tuple[int, int]:
    return bc.decode_bytes(row.visible(lens), row.hq, row.hkv, row.head_dim,
                           kv_itemsize=1 if row.kv != "bfloat16" else None)


def gpu_seconds(rows, samples: int = 30, warmup: int = 5, passes: int = len(LIBS)) -> float:
    """A-priori GPU time of timing `rows` (each pass: one eager call per copy, the graph's capture
    run, `warmup` + `samples` replays of launches_per_graph calls, at bench_common.estimate_us per
    call). Host work (inputs, references, plans, FlashInfer's JIT builds) is not in it."""
    total_us = 0.0
    for row in rows:
        nbytes = sum(row_bytes(row, row.lengths()))
        est, copies = bc.estimate_us(nbytes), bc.rotation_copies(nbytes)
        n = bc.launches_per_graph(est, copies)
        total_us += passes * est * (2 * copies + n * (warmup + samples + 1))
    return total_us / 1e6


# ---------------------------------------------------------------- results and the table
def fi_best(r: dict):
    ts = [r[k]["us"] for k in ("fi-cc", "fi-tc") if bc.lib_state(r.get(k)) == "ok"]
    return min(ts) if ts else None


def ratio(r: dict):
    best, rt = fi_best(r), r.get("rt")
    if best is None or not rt or rt.get("us") is None:
        return None
    return best / rt["us"]


def _f(x, spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) and x is not None and math.isfinite(x) \
        else f"{'-':>{width}}"


def format_table(rows: list[Row], results: dict) -> str:
    head = (f"{'row':<22} {'MB':>7} {'rt us':>8} {'TB/s':>5} {'%4.25':>5} {'cc us':>8} {'tc us':>8}"
            f" {'ratio':>6} {'PERF.md':>8}  check")
    lines = [head, "-" * len(head)]
    for row in rows:
        r = results.get(row.name, {})
        rt = r.get("rt") or {}
        us = rt.get("us")
        tbps = r["bytes"] / (us * 1e6) if us and "bytes" in r else None
        pct = 100 * tbps / bc.HBM_TBPS if tbps else None
        cc, tc = ((r.get(k) or {}).get("us") for k in ("fi-cc", "fi-tc"))
        ref = min((x for x in row.perf_md if x is not None), default=None)
        states = {k: bc.lib_state(r.get(k)) for k in LIBS}
        bad = [f"{k.replace('fi-', '')}:{s}" for k, s in states.items() if s in ("FAIL", "ERR", "skip")]
        check = "PASS" if not bad and any(s == "ok" for s in states.values()) else (" ".join(bad) or "-")
        lines.append(f"{row.name:<22} {_f(r.get('bytes', 0) / 1e6 if 'bytes' in r else None, '.1f', 7)}"
                     f" {_f(us, '.1f', 8)} {_f(tbps, '.2f', 5)} {_f(pct, '.0f', 5)}"
                     f" {_f(cc, '.1f', 8)} {_f(tc, '.1f', 8)} {_f(ratio(r), '.2f', 6)} {_f(ref, '.1f', 8)}  {check}")
    return "\n".join(lines)


def format_summary(rows: list[Row], results: dict) -> str:
    """The issue-4 targets, judged on the rows that ran with a correct rtattn."""
    got = {row.name: ratio(results.get(row.name, {})) for row in rows}
    ok = {n: x for n, x in got.items() if x is not None and bc.lib_state(results[n].get("rt")) == "ok"}
    if not ok:
        return "targets: no row with both a correct rtattn and a FlashInfer time"
    below = [f"{n} {x:.2f}" for n, x in ok.items() if x < 1.0]
    gm = bc.geomean(ok.values())
    small = [f"{n} {ok[n]:.2f}" for n in ok if n.startswith("b16-") and n.endswith("-kv4")]
    small_bad = [s for s in small if float(s.split()[-1]) < 1.5]
    lines = [f"targets over {len(ok)} rows: geomean ratio {gm:.2f} (>= 1.20: {'yes' if gm >= 1.2 else 'NO'});"
             f" min {min(ok.values()):.2f}; rows < 1.0: {', '.join(below) or 'none'}",
             f"  32/4 rows >= 1.5x: {'yes' if small and not small_bad else 'NO'} ({', '.join(small) or 'not run'})"]
    by_name = {row.name: row for row in rows}
    costs = []
    for row in rows:
        a, b = (results.get(n, {}).get("rt") or {} for n in (row.name, row.twin))
        if row.twin in by_name and a.get("us") and b.get("us"):
            costs.append(f"{row.name} {100 * (a['us'] / b['us'] - 1):+.1f}%")
    if costs:
        lines.append(f"  variant cost over its plain twin (same KV read; target <= +3%): {', '.join(costs)}")
    big = results.get("s256x4096", {})
    if big.get("rt", {}).get("us"):
        pct = 100 * big["bytes"] / (big["rt"]["us"] * 1e6) / bc.HBM_TBPS
        lines.append(f"  256x4096 at {pct:.0f}% of 4.25 TB/s (>= 85%: {'yes' if pct >= 85 else 'NO'})")
    fp8 = results.get("f8-256x4096-e4m3", {})
    if fp8.get("rt", {}).get("us") and bc.lib_state(fp8.get("rt")) == "ok":
        us = fp8["rt"]["us"]
        lines.append(f"  fp8 e4m3 256x4096: {us:.0f} us, {fp8['bytes'] / (us * 1e6):.2f} TB/s (<= 800 us: "
                     f"{'yes' if us <= 800 else 'NO'})")
    return "\n".join(lines)


def format_modes(rows: list[Row], results: dict, modes) -> str:
    """µs of every --rt-modes config per row, and its ratio to the first (the table's) config."""
    head = f"{'row':<22}" + "".join(f" {m[:22]:>22}" for m in modes)
    lines = [f"rtattn configs (µs, and / {modes[0]}):", head]
    for row in rows:
        r = results.get(row.name, {})
        base = (r.get("rt") or {}).get("us")
        cells = []
        for i, m in enumerate(modes):
            us = (r.get("rt" if i == 0 else f"rt:{m}") or {}).get("us")
            ok = bc.lib_state(r.get("rt" if i == 0 else f"rt:{m}")) == "ok"
            cell = f"{us:.1f}" + (f" ({us / base:.3f})" if base and i else "") + ("" if ok else " !") if us else "-"
            cells.append(f" {cell:>22}")
        lines.append(f"{row.name:<22}" + "".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU inputs and reference
class Inputs:
    """One row's inputs on the GPU: `copies` identical copies (distinct addresses) of q and the
    K/V page pools for L2 rotation, the page table, and a float32 reference output."""

    def __init__(self, row: Row):
        import torch
        self.row = row
        self.lens = row.lengths()
        self.indptr, self.indices, self.last = bc.page_table(bc.rng_for(row.seed, 1), self.lens, row.page)
        kv, qo = row_bytes(row, self.lens)
        self.bytes = kv + qo
        self.copies = bc.rotation_copies(self.bytes)
        B, N, dt = len(self.lens), int(self.indptr[-1]), torch.bfloat16
        self.batch, self.pages = B, N
        g = torch.Generator(device="cuda").manual_seed(int(bc.rng_for(row.name, 2).integers(2**31)))
        self.q = torch.empty(self.copies, B, row.hq, row.head_dim, device="cuda", dtype=dt)
        self.kv_dtype = getattr(torch, row.kv)
        self.k = torch.empty(self.copies * N, row.page, row.hkv, row.head_dim, device="cuda", dtype=self.kv_dtype)
        self.v = torch.empty_like(self.k)
        for t, n in ((self.q, 1), (self.k, N), (self.v, N)):
            if t.dtype == dt:
                t[:n].normal_(generator=g)
            else:  # fp8: N(0,1) in float32, rounded by torch, a slice of pages at a time
                for i in range(0, n, 4096):
                    t[i:min(n, i + 4096)].copy_(torch.randn(t[i:min(n, i + 4096)].shape, generator=g, device="cuda"))
            for c in range(1, self.copies):
                t[c * n:(c + 1) * n].copy_(t[:n])
        self.kv = [(self.k[c * N:(c + 1) * N], self.v[c * N:(c + 1) * N]) for c in range(self.copies)]
        self.sinks = (torch.linspace(-1.0, 3.0, row.hq, device="cuda", dtype=torch.float32)
                      if row.sinks else None)
        self.q *= 4.0 if row.soft_cap else 1.0   # logits large enough for the cap to bite
        self.ref = self._reference()
        torch.cuda.synchronize()

    def _reference(self):
        import torch
        row = self.row
        D = row.head_dim
        g, scale = row.hq // row.hkv, 1.0 / math.sqrt(D)
        pages = torch.from_numpy(self.indices.astype(np.int64)).cuda()
        k0, v0 = self.kv[0]
        out = torch.empty(self.batch, row.hq, D, device="cuda", dtype=torch.float32)
        for b in range(self.batch):
            p = pages[int(self.indptr[b]):int(self.indptr[b + 1])]
            L = int(self.lens[b])
            k = k0[p].reshape(-1, row.hkv, D)[:L].float()
            v = v0[p].reshape(-1, row.hkv, D)[:L].float()
            qb = self.q[0, b].float().view(row.hkv, g, D)
            s = torch.einsum("hgd,lhd->hgl", qb, k) * scale
            if row.soft_cap:
                s = row.soft_cap * torch.tanh(s / row.soft_cap)
            if row.window is not None:
                s[..., :max(0, L - 1 - row.window)] = -float("inf")
            if self.sinks is not None:   # one more key of logit sinks[h] and value 0
                s = torch.cat([s, self.sinks.view(row.hkv, g, 1)], dim=-1)
                v = torch.cat([v, torch.zeros_like(v[:1])])
            w = torch.softmax(s, dim=-1)
            out[b] = torch.einsum("hgl,lhd->hgd", w, v).reshape(row.hq, D)
        return out

    def rel_err(self, outs) -> float:
        """Largest relative error norm over the outputs (inf if any is not finite)."""
        import torch
        worst = 0.0
        for o in outs:
            o = o.float()
            if not torch.isfinite(o).all():
                return float("inf")
            worst = max(worst, float((o - self.ref).norm() / self.ref.norm()))
        return worst

    def new_outs(self):
        import torch
        return [torch.full_like(self.q[c], float("nan")) for c in range(self.copies)]


def _plan_us(plan, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan()
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts))


def _measure(ctx, x: Inputs, calls, outs, eager) -> dict:
    """Eager correctness, then graph timing, then correctness of what the replays wrote."""
    import torch
    eager()
    torch.cuda.synchronize()
    err0 = x.rel_err(outs[:1])
    for o in outs:
        o.fill_(float("nan"))
    ctx.warm_clocks()
    n = bc.launches_per_graph(bc.estimate_us(x.bytes), x.copies)
    t = bc.time_graph(calls, ctx.stream, n, samples=ctx.args.samples)
    ctx.last_gpu = time.perf_counter()
    err = max(err0, x.rel_err(outs))
    return {"us": t["median"], "p10": t["p10"], "p90": t["p90"], "launches_per_graph": n,
            "rel_err": err, "ok": err < TOL}


def bench_flashinfer(ctx, x: Inputs, tc: bool) -> dict:
    import flashinfer
    import torch
    row = x.row
    if ctx.fi_workspace is None:
        ctx.fi_workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ctx.fi_workspace, kv_layout="NHD", use_tensor_cores=tc)
    indptr, indices, last = (torch.from_numpy(a).cuda() for a in (x.indptr, x.indices, x.last))

    def plan():
        w.plan(indptr, indices, last, row.hq, row.hkv, row.head_dim, row.page,
               q_data_type=torch.bfloat16, kv_data_type=x.kv_dtype,
               window_left=-1 if row.window is None else row.window, logits_soft_cap=row.soft_cap)
    plan()                                   # the first one JIT-builds the module
    plan_us = _plan_us(plan)
    outs = x.new_outs()
    calls = [lambda c=c: w.run(x.q[c], x.kv[c], out=outs[c]) for c in range(x.copies)]
    res = _measure(ctx, x, calls, outs, eager=calls[0])
    res.update(plan_us=plan_us, backend=getattr(w, "resolved_backend", "?"))
    if row.sinks:   # it ran without the sinks: timed, but its output is not the row's
        res.update(ok=True, note="no sinks in FI cc/tc: its path without them timed")
    return res


def rt_config(name: str) -> dict:
    """'MODE[+nopdl][+fused][+nomerge][+xN][+cN][+D<NAME>...]' -> BatchDecodeWrapper keyword
    arguments. '+fused' merges split rows inside the decode kernel (fused_merge=True); '+xN'
    runs N times the default grid (num_ctas); '+cN' sets chunk_tokens=N (the batch-invariant
    chunk; default: from the grid); '+nomerge' never launches the merge kernel (wrong
    output wherever KV is split: a timing probe); '+prefill' runs the row on the prefill family
    (BatchPrefillWrapper, one query token per request: the family choice's A/B); '+DX' compiles the
    kernels with -DX (experiments behind a #ifdef, A/B in one run; kernels.py reads
    RTATTN_DEV_DEFINES)."""
    mode, *flags = name.split("+")
    defines = " ".join("-" + f for f in flags if f.startswith("D"))
    waves = [int(f[1:]) for f in flags if f[:1] == "x" and f[1:].isdigit()]
    chunks = [int(f[1:]) for f in flags if f[:1] == "c" and f[1:].isdigit()]
    unknown = {f for f in flags if not f.startswith("D") and not (f[:1] in "xc" and f[1:].isdigit())} \
        - {"nopdl", "nomerge", "fused", "prefill"}
    if unknown:
        raise ValueError(f"unknown rtattn config flags {sorted(unknown)} in {name!r}")
    if os.environ.get("RTATTN_DEV_DEFINES", "") != defines:
        from rtattn.kernels import decode_kernels
        os.environ["RTATTN_DEV_DEFINES"] = defines
        decode_kernels.cache_clear()
    return dict(mode=mode, pdl="nopdl" not in flags, waves=waves[-1] if waves else 1, merge="nomerge" not in flags,
                fused_merge="fused" in flags, chunk_tokens=chunks[-1] if chunks else None,
                family="prefill" if "prefill" in flags else "decode")


def make_rt_wrapper(row: Row, x: Inputs, config: str):
    from rtattn.wrapper import BatchDecodeWrapper
    kw = rt_config(config)
    waves, merge = kw.pop("waves"), kw.pop("merge")
    if kw.pop("family") == "prefill":
        from rtattn.prefill_wrapper import BatchPrefillWrapper
        kw.pop("fused_merge")
        kw["chunk_tokens"] = kw["chunk_tokens"] or 2048
        return BatchPrefillWrapper(row.hq, row.hkv, row.head_dim, row.page, max_batch=x.batch, max_qo_tokens=x.batch,
                                   max_pages=x.pages, max_qo_len=1, variant=row.variant, dtype="bfloat16", **kw)
    kw.update(variant=row.variant, dtype="bfloat16", kv_dtype=row.kv, kv_layout="NHD")
    w = BatchDecodeWrapper(row.hq, row.hkv, row.head_dim, row.page, max_batch=x.batch, max_pages=x.pages, **kw)
    if waves != 1:
        w = BatchDecodeWrapper(row.hq, row.hkv, row.head_dim, row.page, max_batch=x.batch, max_pages=x.pages,
                               num_ctas=waves * w.num_ctas, **kw)
    w._may_split = w._may_split and merge   # probe only: see rt_config
    return w


def bench_rtattn(ctx, x: Inputs, config: str = "auto") -> dict:
    import torch
    row = x.row
    w = make_rt_wrapper(row, x, config)
    from rtattn.prefill_wrapper import BatchPrefillWrapper
    # the prefill family's plan() takes the one query per request explicitly (decode's: None)
    qo_indptr = np.arange(x.batch + 1, dtype=np.int32) if isinstance(w, BatchPrefillWrapper) else None
    plan_us = _plan_us(lambda: w.plan(qo_indptr=qo_indptr, kv_indptr=x.indptr, kv_indices=x.indices,
                                      kv_last_page_len=x.last, window_left=row.window))
    torch.cuda.synchronize()
    outs = x.new_outs()
    params = {k: v for k, v in (("soft_cap", row.soft_cap), ("sinks", x.sinks)) if v is not None}
    launches = [w.prepare(x.q[c], *x.kv[c], out=outs[c], stream=ctx.stream, params=params)
                for c in range(x.copies)]
    calls = [lambda l=l: l(torch.cuda.current_stream()) for l in launches]
    res = _measure(ctx, x, calls, outs, eager=lambda: launches[0](ctx.stream))
    info = w.info
    res.update(plan_us=plan_us, num_ctas=w.num_ctas, planned_kv_tokens=info.planned_kv_tokens,
               items=getattr(info, "num_items", None), merge_rows=getattr(info, "num_merge_rows", None))
    return res


def prebuild_flashinfer(rows) -> int:
    """JIT-build FlashInfer's decode modules for `rows` (one tiny plan + run per distinct module:
    head_dim, soft-cap on/off, window on/off, cc/tc), so that a later run's first plans find
    them built; meant to run beside other work (the GPU tier) before the timed run."""
    import flashinfer
    import torch
    seen = {}
    for r in rows:
        for tc in (False, True):
            seen.setdefault((r.head_dim, r.soft_cap is not None, r.window is not None, r.kv, tc), r)
    from concurrent.futures import ThreadPoolExecutor

    def build(key) -> int:   # separate modules build side by side (each JIT build is its own ninja)
        (D, _, _, kv, tc), r = key, seen[key]
        kv_dtype = getattr(torch, kv)
        t0 = time.perf_counter()
        ws = torch.zeros(64 * 2**20, dtype=torch.uint8, device="cuda")
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", use_tensor_cores=tc)
            i32 = dict(dtype=torch.int32, device="cuda")
            w.plan(torch.tensor([0, 1], **i32), torch.zeros(1, **i32), torch.ones(1, **i32), 8, 8, D, 16,
                   q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                   window_left=-1 if r.window is None else r.window, logits_soft_cap=r.soft_cap)
            k = torch.randn(1, 16, 8, D, device="cuda").to(kv_dtype)
            w.run(torch.randn(1, 8, D, device="cuda", dtype=torch.bfloat16), (k, k))
            torch.cuda.synchronize()
            print(f"prebuilt FI {'tc' if tc else 'cc'} d{D} cap={r.soft_cap} window={r.window} kv={kv}: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            return 0
        except Exception as e:  # noqa: BLE001 -- the timed run builds what is missing
            print(f"prebuild FI {'tc' if tc else 'cc'} d{D}: {type(e).__name__}: {e}"[:300], flush=True)
            return 1

    with ThreadPoolExecutor(max_workers=3) as pool:
        return 1 if sum(pool.map(build, list(seen))) else 0


# ---------------------------------------------------------------- driver
class Context:
    def __init__(self, args, rows):
        self.args, self.rows, self.t0 = args, rows, time.perf_counter()
        self.results: dict = {}
        self.meta: dict = {"argv": sys.argv[1:]}
        self.inputs: dict = {}
        self.stream = None
        self.fi_workspace = None
        self.last_gpu = None  # when the GPU last ran timed work (None: not yet)
        self._done = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def warm_clocks(self, idle_s: float = 5.0) -> None:
        """Warm before the first timing, and again after the GPU sat idle (JIT builds, compiles)."""
        if self.last_gpu is None or time.perf_counter() - self.last_gpu > idle_s:
            tf = bc.warm_clocks(self.args.warm)
            self.last_gpu = time.perf_counter()
            self.meta.setdefault("warm_tflops", []).append(round(tf, 1))
            self.log(f"clocks warmed: {tf:.0f} TFLOP/s bf16 matmul")

    def finish(self, reason: str = "") -> bool:
        """Print the table and write JSON once (main thread or watchdog, whichever is first)."""
        if not self._done.acquire(blocking=False):
            return False
        if reason:
            print(f"\n!! {reason}", flush=True)
        self.meta["elapsed_s"] = round(self.elapsed(), 1)
        out_dir = self.args.json_dir or os.environ.get("OUT")
        try:
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                path = os.path.join(out_dir, "bench_decode.json")
                with open(path, "w") as f:
                    json.dump({"meta": self.meta, "rows": self.results}, f, indent=1, default=str)
                print(f"wrote {path}")
        except Exception as e:  # noqa: BLE001 -- the table below matters more
            print(f"could not write JSON: {e}")
        print("\n" + format_table(self.rows, self.results))
        print(format_summary(self.rows, self.results))
        if len(self.args.rt_modes) > 1:
            print(format_modes(self.rows, self.results, self.args.rt_modes))
        print(f"(us: median per call over graph replays; ratio = min(FI cc, FI tc) / rtattn; "
              f"PERF.md: FI best there; {self.meta['elapsed_s']} s)", flush=True)
        return True


def _error(ctx, where: str, e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    msg = f"{type(e).__name__}: {e}"[:400]
    ctx.log(f"{where}: {msg}")
    if not ctx.meta.setdefault("tracebacks", {}).get(where.split()[0]):
        ctx.meta["tracebacks"][where.split()[0]] = "".join(tb)[-3000:]
        print("".join(tb[-4:])[-1500:], flush=True)
    return {"error": msg}


def run_pass(ctx, libs) -> None:
    import torch
    for row in ctx.rows:
        r = ctx.results.setdefault(row.name, {"label": row.label})
        if ctx.elapsed() > ctx.args.deadline - 20:
            for lib in libs:
                r[lib] = {"skipped": "deadline near"}
            ctx.log(f"{row.name}: skipped {'/'.join(libs)} (deadline near)")
            continue
        try:
            if row.name not in ctx.inputs:
                ctx.inputs[row.name] = Inputs(row)
            x = ctx.inputs[row.name]
        except Exception as e:  # noqa: BLE001
            for lib in libs:
                r[lib] = _error(ctx, f"{lib} {row.name} inputs", e)
            continue
        r.update(bytes=x.bytes, copies=x.copies, batch=x.batch, kv_tokens=int(x.lens.sum()),
                 max_kv=int(x.lens.max()))
        for lib in libs:
            try:
                if lib.startswith("rt"):   # "rt" = the first --rt-modes entry, "rt:MODE" the others
                    res = bench_rtattn(ctx, x, lib.split(":")[1] if ":" in lib else ctx.args.rt_modes[0])
                else:
                    res = bench_flashinfer(ctx, x, tc=(lib == "fi-tc"))
                r[lib] = res
                ctx.log(f"{lib:5} {row.name:<16} {res['us']:9.1f} us  (p10 {res['p10']:.1f} p90 {res['p90']:.1f})"
                        f"  err {res['rel_err']:.1e} {'ok' if res['ok'] else 'FAIL'}  plan {res['plan_us']:.0f} us")
            except Exception as e:  # noqa: BLE001
                r[lib] = _error(ctx, f"{lib} {row.name}", e)
            try:  # a sticky CUDA error surfaces here too; every later call will report it
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                r[lib] = r[lib] if r[lib].get("error") else _error(ctx, f"{lib} {row.name} sync", e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="rows: " + " ".join(r.name for r in ROWS))
    ap.add_argument("--quick", action="store_true", help=f"only {' '.join(QUICK)}")
    ap.add_argument("--new", action="store_true", help=f"issue 11's rows: {' '.join(NEW)} (with --quick: both)")
    ap.add_argument("--fp8", action="store_true", help="add the fp8 KV rows (f8-*)")
    ap.add_argument("--nbhd", action="store_true",
                    help="add the neighbourhood rows (n-*: other heads, groups, head dims, pages, batches)")
    ap.add_argument("--prebuild-fi", action="store_true",
                    help="only JIT-build FlashInfer's modules for the selected rows, then exit")
    ap.add_argument("--rows", nargs="+", metavar="NAME", help="row names or glob patterns")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer pass")
    ap.add_argument("--no-rtattn", action="store_true", help="skip the rtattn pass")
    ap.add_argument("--rt-modes", nargs="+", default=["auto"],
                    help="rtattn configs MODE[+nopdl] (planner mode, no PDL); "
                         "the first fills the table, the others are logged")
    ap.add_argument("--samples", type=int, default=30, help="graph replays timed per measurement")
    ap.add_argument("--warm", type=float, default=2.0,
                    help="seconds of matmul that warm the clocks (first timing, and after >5 s idle)")
    ap.add_argument("--deadline", type=float, default=225.0,
                    help="seconds after start: skip rows near it, print partial results at it")
    ap.add_argument("--json-dir", help="where bench_decode.json goes (default: $OUT if set)")
    ap.add_argument("--selftest", action="store_true", help="check workloads/bytes/table; no GPU")
    args = ap.parse_args(argv)
    if args.selftest:
        return selftest()
    picks = args.rows or ((QUICK if args.quick else []) + (NEW if args.new else []) + (FP8 if args.fp8 else [])
                          + (NBHD if args.nbhd else [])) or None
    rows = select_rows(picks)
    if args.prebuild_fi:
        return prebuild_flashinfer(rows)
    ctx = Context(args, rows)
    watchdog = threading.Timer(args.deadline, lambda: ctx.finish(f"deadline {args.deadline:.0f} s: partial results")
                               and os._exit(3))
    watchdog.daemon = True
    watchdog.start()

    import torch
    ctx.stream = torch.cuda.Stream()
    ctx.meta.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=[r.name for r in rows])
    ctx.log(f"{ctx.meta['gpu']}, torch {torch.__version__}, {len(rows)} rows "
            f"(~{gpu_seconds(rows, args.samples):.0f} s of timed GPU work predicted)")
    if not args.no_flashinfer:
        try:
            import flashinfer
            ctx.meta["flashinfer"] = getattr(flashinfer, "__version__", "?")
            ctx.log(f"FlashInfer {ctx.meta['flashinfer']} pass (first plan JIT-builds its modules)")
            run_pass(ctx, ("fi-cc", "fi-tc"))
        except Exception as e:  # noqa: BLE001
            _error(ctx, "fi import", e)
    if not args.no_rtattn:
        ctx.log("rtattn pass")
        run_pass(ctx, ("rt",) + tuple(f"rt:{m}" for m in args.rt_modes[1:]))
    watchdog.cancel()
    ctx.finish()
    return 0


# ---------------------------------------------------------------- selftest (no GPU)
def selftest() -> int:
    import random
    # lengths: heavy-tailed rows have mean exactly 1024, bounded, deterministic
    for seed in range(50):
        x = bc.lengths_heavy(np.random.default_rng(seed), 16, 1024)
        assert x.sum() == 16 * 1024 and x.min() >= 1 and x.max() <= bc.HEAVY_MAX, (seed, x)
        assert 3000 < x.max() < 8000 and x.min() < 300, x  # a tail, but not a 1-in-100 draw
        y = bc.lengths_heavy(np.random.default_rng(seed + 1), 16, 1024)
        assert sorted(x) == sorted(y), "stratified: only the order depends on the seed"
    x = bc.lengths_heavy(np.random.default_rng(0), 4, 8192, sigma=3.0)  # clipping must be absorbed
    assert x.sum() == 4 * 8192 and x.max() <= bc.HEAVY_MAX and x.min() >= 1, x
    heavy = [r for r in ROWS if "heavy" in r.name and r.name.startswith("b16-")]
    assert all((r.lengths() == heavy[0].lengths()).all() for r in heavy), "same lengths for every head count"
    assert all((r.lengths() == r.lengths()).all() for r in heavy)
    assert max(int(r.lengths().max()) for r in heavy) > 2 * 1024, "heavy rows should have a tail"
    u = bc.lengths_uniform(np.random.default_rng(1), 10000, 512, 1024)
    assert u.min() == 512 and u.max() == 1024 and abs(u.mean() - 768) < 0.5
    u = bc.lengths_uniform(np.random.default_rng(1), 16, 512, 1024)
    assert abs(u.mean() - 768) < 1 and len(set(u.tolist())) == 16
    # page tables: a scattered permutation covering every page once, lengths recoverable
    rng = np.random.default_rng(3)
    for _ in range(50):
        lens = rng.integers(1, 5000, size=rng.integers(1, 70))
        ip, idx, last = bc.page_table(rng, lens, PAGE)
        assert ip.dtype == idx.dtype == last.dtype == np.int32
        assert ip[0] == 0 and (np.diff(ip) >= 1).all()
        assert sorted(idx.tolist()) == list(range(int(ip[-1])))
        assert ((1 <= last) & (last <= PAGE)).all()
        assert ((np.diff(ip) - 1) * PAGE + last == lens).all()
    _, idx, _ = bc.page_table(np.random.default_rng(0), [16 * 1000], PAGE)
    assert (idx != np.arange(1000)).mean() > 0.9, "pages must be scattered"
    # bytes: PERF.md's 16 x 1024 at 32/4 moves 33 MB (7.9 us at 4.25 TB/s)
    kv, qo = bc.decode_bytes(np.full(16, 1024), 32, 4, 128)
    assert kv == 16 * 1024 * 4 * 128 * 2 * 2 == 33554432 and qo == 16 * 32 * 128 * 2 * 2
    assert abs((kv + qo) / 4.25e6 - 7.9) < 0.1
    kv, qo = bc.decode_bytes(np.full(64, 4096), 32, 8, 128)    # PERF.md: 392.6 us -> 2.74 TB/s
    assert abs((kv + qo) / 392.6e6 - 2.74) < 0.01
    kv, qo = bc.decode_bytes(np.full(16, 1024), 32, 32, 128)   # 79.3 us -> 3.39 TB/s
    assert abs((kv + qo) / 79.3e6 - 3.39) < 0.01
    # rotation: the copies of one row touch >= 4 x L2
    for b in (1, 10**6, 33 * 10**6, 240 * 10**6, 2 * 10**9):
        c = bc.rotation_copies(b)
        assert c >= 2 and c * b >= 4 * bc.L2_BYTES and (c == 2 or (c - 1) * b < 4 * bc.L2_BYTES)
    for est in (0.5, 20, 1500, 10**5):
        for copies in (2, 3, 8):
            n = bc.launches_per_graph(est, copies)
            assert n % copies == 0 and n >= copies
    st = bc.summarize([5, 1, 3, 2, 4])
    assert st["median"] == 3 and st["p10"] == 1 and st["p90"] == 5
    assert abs(bc.geomean([1, 4]) - 2) < 1e-12
    # rows: unique names, selection by name and glob; the neighbourhood only when asked for
    assert len(ROWS) == 43 and len({r.name for r in ROWS}) == 43
    nb = select_rows(NBHD)
    assert len(nb) == 14 and all(r.name.startswith("n-") for r in nb) and len(select_rows(None)) == 29
    assert not set(select_rows(None)) & set(nb) and [r.name for r in select_rows(["n-*"])] == [r.name for r in nb]
    groups = {r.hq // r.hkv for r in nb}
    assert {5, 7, 8, 2, 1, 4} <= groups and {2, 4, 16, 64, 128} <= {r.page for r in nb}
    assert {64, 128, 256} == {r.head_dim for r in nb} and {1, 512, 128} <= {len(r.lengths()) for r in nb}
    cap = next(r for r in nb if r.soft_cap)
    assert (cap.soft_cap, cap.head_dim, cap.hq, cap.hkv, cap.variant) == (50.0, 256, 16, 8, "soft_cap")
    twin = next(r for r in nb if r.name == cap.twin)
    assert (twin.lengths() == cap.lengths()).all() and row_bytes(twin, twin.lengths()) == row_bytes(cap, cap.lengths())
    heavy = next(r for r in nb if "heavy" in r.name)
    assert heavy.lengths().sum() == 128 * 1024 and heavy.lengths().max() > 4 * 1024 and heavy.lengths().max() <= bc.HEAVY_MAX
    for r in nb:   # page tables at the row's own page size: every token, pages scattered
        lens = r.lengths()
        ip, idx, last = bc.page_table(bc.rng_for(r.seed, 1), lens, r.page)
        assert ((np.diff(ip) - 1) * r.page + last == lens).all() and r.hq % r.hkv == 0, r.name
        assert len(r.name) <= 22 and r.perf_md == (None,), r.name   # the table's row column; no PERF.md figure
    # bytes: 28/4 moves the same KV as 32/4 (7/8 of its q and o); 64/8 the KV of 32/8, twice the q and o
    by = {r.name: r for r in ROWS}
    kv7, qo7 = row_bytes(by["n-q28k4-16x1024"], np.full(16, 1024))
    kv4, qo4 = row_bytes(by["b16-all1024-kv4"], np.full(16, 1024))
    assert kv7 == kv4 and 8 * qo7 == 7 * qo4
    assert sum(row_bytes(by["n-512x512"], by["n-512x512"].lengths())) == 512 * 512 * 8 * 128 * 4 + 512 * 32 * 128 * 4
    # the neighbourhood's timed GPU work (3 passes, graph-timed) stays well inside gpu_all's stage
    t_nb = gpu_seconds(nb)
    assert 1.0 < t_nb < 30.0, t_nb
    print(f"neighbourhood: {len(nb)} rows, {sum(sum(row_bytes(r, r.lengths())) for r in nb) / 1e9:.1f} GB per "
          f"call set, ~{t_nb:.1f} s of timed GPU work (3 passes)")
    for r in nb:
        print(f"  {r.name:<22} {r.label:<26} {sum(row_bytes(r, r.lengths())) / 1e6:8.1f} MB  "
              f"{gpu_seconds([r]):5.2f} s")
    f8 = select_rows(FP8)
    assert [r.kv for r in f8] == ["float8_e4m3fn"] * 3 + ["float8_e5m2"] and f8[2].seed == "s256x4096"
    assert sum(row_bytes(f8[2], f8[2].lengths())) == 256 * 4096 * 8 * 128 * 2 + 256 * 32 * 128 * 2 * 2
    assert all(r.twin in {x.name for x in ROWS} for r in ROWS if r.twin)
    win = next(r for r in ROWS if r.window == 1023)
    assert row_bytes(win, win.lengths())[0] == row_bytes(ROWS[3], ROWS[3].lengths())[0], "a window counts what it sees"
    assert [r.variant for r in ROWS if r.name.startswith("v")] == [
        "soft_cap", "soft_cap", "sliding_window", "sinks", "sliding_window_sinks"]
    assert len(select_rows(NEW)) == 13
    assert [r.name for r in select_rows(QUICK)] == [r.name for r in ROWS if r.name in QUICK]
    assert len(select_rows(["b16-*-kv4"])) == 3 and len(select_rows(["s*"])) == 5
    try:
        select_rows(["nope"])
        raise AssertionError("unknown row accepted")
    except SystemExit:
        pass
    # table and summary: ok, FAIL, ERR, missing, skipped rows all render
    res, rnd = {}, random.Random(0)
    for i, row in enumerate(ROWS):
        lens = row.lengths()
        r = res[row.name] = {"bytes": sum(row_bytes(row, lens))}
        r["fi-cc"] = {"us": rnd.uniform(10, 100), "ok": True}
        r["fi-tc"] = {"us": rnd.uniform(10, 100), "ok": i != 3}
        if i == 2:
            r["rt"] = {"error": "CudaError: CUDA_ERROR_ILLEGAL_ADDRESS"}
        elif i == 5:
            r["rt"] = {"skipped": "deadline near"}
        elif i != 7:
            r["rt"] = {"us": rnd.uniform(10, 100), "ok": i != 4}
    table = format_table(ROWS, res)
    lines = table.splitlines()
    assert len(lines) == 2 + len(ROWS) and max(map(len, lines)) < 120, table
    assert "rt:ERR" in lines[4] and "tc:FAIL" in lines[5] and "rt:FAIL" in lines[6] and "rt:skip" in lines[7]
    assert lines[2].rstrip().endswith("PASS")
    r0 = res[ROWS[0].name]
    want = min(r0["fi-cc"]["us"], r0["fi-tc"]["us"]) / r0["rt"]["us"]
    assert f"{want:.2f}" in lines[2]
    for i, row in enumerate(ROWS):
        res[row.name]["rt:batch-invariant"] = {"us": 1.01 * (res[row.name].get("rt") or {}).get("us", 1.0), "ok": True}
    modes = format_modes(ROWS, res, ["auto", "batch-invariant"])
    assert "(1.010)" in modes and len(modes.splitlines()) == len(ROWS) + 2, modes
    summary = format_summary(ROWS, res)
    assert "geomean" in summary and "256x4096" in summary
    print(table)
    print(summary)
    print("selftest ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
