"""Shared benchmark helpers: workloads, byte counts, L2 rotation, clock warm-up, graph timing.

The workload half (lengths, page tables, bytes) is numpy only and runs anywhere; the
timing half imports torch lazily, so `--help` and `--selftest` work on a GPU-less machine.

How a number is made (shared/PERF.md, "How to measure"):
  * K input copies (L2 rotation) so the bytes touched between two reads of the same
    address exceed ~4x the 60 MB L2; each copy is one prepared call.
  * One CUDA graph holds N calls cycling over the copies (N a multiple of K, sized so a
    replay takes ~2 ms); events bracket each replay; the result is the median replay
    time / N. Warm-up replays first, clocks warmed with matrix work before the first row.
"""
from __future__ import annotations

import math
import statistics
import zlib

import numpy as np

L2_BYTES = 60 * 2**20          # H200
ROTATE_FACTOR = 4              # bytes touched per rotation >= 4 x L2
HBM_TBPS = 4.25                # shared/PERF.md memory ceiling
BF16 = 2                       # bytes per element

HEAVY_SIGMA = 1.2              # lognormal shape of the heavy-tailed rows
HEAVY_MAX = 16384


# ---------------------------------------------------------------- workloads
def rng_for(name: str, salt: int = 0) -> np.random.Generator:
    """A generator seeded from a row name: the same row gives the same lengths in every run."""
    return np.random.default_rng(zlib.crc32(name.encode()) + salt)


def _stratified(rng, batch: int) -> np.ndarray:
    """Probabilities (i + 0.5) / batch in a seeded random order: a batch drawn at these
    quantiles has its distribution's shape without sampling luck (no 1-in-100 tail draws)."""
    return rng.permutation((np.arange(batch) + 0.5) / batch)


def lengths_uniform(rng, batch: int, lo: int, hi: int) -> np.ndarray:
    """U(lo, hi), both ends inclusive, at stratified quantiles (mean ~ (lo + hi) / 2)."""
    return lo + np.floor(_stratified(rng, batch) * (hi - lo + 1)).astype(np.int64)


def lengths_heavy(rng, batch: int, mean: int, sigma: float = HEAVY_SIGMA, hi: int = HEAVY_MAX) -> np.ndarray:
    """Heavy-tailed lengths with an exact mean: lognormal(sigma) quantiles at stratified
    probabilities, rescaled so the batch sums to exactly batch*mean, rounded, clipped to
    [1, hi]; the rounding/clipping residual goes to the shortest (or longest) request."""
    z = np.array([statistics.NormalDist().inv_cdf(p) for p in _stratified(rng, batch)])
    x = np.exp(sigma * z)
    x = np.clip(np.rint(x * (batch * mean / x.sum())), 1, hi).astype(np.int64)
    residual = batch * mean - int(x.sum())
    while residual:
        i = int(np.argmin(x)) if residual > 0 else int(np.argmax(x))
        step = min(residual, hi - int(x[i])) if residual > 0 else max(residual, 1 - int(x[i]))
        x[i] += step
        residual -= step
    return x


def page_table(rng, kv_lens, page_size: int, pool_pages: int | None = None):
    """Paged KV for `kv_lens`: pages scattered by a random permutation of page ids (of a pool of
    `pool_pages`; None: the nnz pages used). Returns int32 (kv_indptr [B+1], kv_indices [nnz],
    kv_last_page_len [B])."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    if (kv_lens < 1).any():
        raise ValueError("every request needs at least one KV token")
    pages = (kv_lens + page_size - 1) // page_size
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = rng.permutation(pool_pages or int(indptr[-1]))[: int(indptr[-1])].astype(np.int32)
    last = (kv_lens - (pages - 1) * page_size).astype(np.int32)
    return indptr, indices, last


def decode_bytes(kv_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, itemsize: int = BF16,
                 kv_itemsize: int | None = None):
    """(K+V bytes read, q+o bytes) of one decode call, as shared/PERF.md counts them (KV elements
    of kv_itemsize bytes: 1 for an fp8 cache)."""
    kv = int(np.sum(kv_lens)) * num_kv_heads * head_dim * 2 * (kv_itemsize or itemsize)
    qo = len(kv_lens) * num_qo_heads * head_dim * 2 * itemsize
    return kv, qo


def rotation_copies(bytes_per_call: int, l2_bytes: int = L2_BYTES, factor: int = ROTATE_FACTOR) -> int:
    """How many input copies one rotation needs so it touches >= factor * L2 (at least 2)."""
    return max(2, math.ceil(factor * l2_bytes / max(bytes_per_call, 1)))


def launches_per_graph(est_us: float, copies: int, target_us: float = 2000.0, cap: int = 512) -> int:
    """Calls captured in one graph: a multiple of `copies`, ~target_us of work, at most ~cap."""
    n = max(1, math.ceil(target_us / max(est_us, 1e-3)))
    n = min(n, cap)
    return max(copies, math.ceil(n / copies) * copies)


def estimate_us(total_bytes: int, tbps: float = 2.0, overhead_us: float = 5.0) -> float:
    """A rough a-priori call time, only used to size the graph."""
    return total_bytes / (tbps * 1e6) + overhead_us


def summarize(samples_us) -> dict:
    s = sorted(samples_us)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "n": len(s)}


def lib_state(res: dict | None) -> str:
    """One library's result on one row: ok, FAIL (wrong output), ERR (raised), skip, - (none)."""
    if not res:
        return "-"
    if res.get("skipped"):
        return "skip"
    if res.get("error"):
        return "ERR"
    return "ok" if res.get("ok") else "FAIL"


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ---------------------------------------------------------------- GPU side (torch, lazy)
def worst_rel_err(outs, ref) -> float:
    """Largest relative error norm of the outputs against `ref` (inf if one is not finite)."""
    import torch
    errs = [float((o.float() - ref).norm() / ref.norm()) if torch.isfinite(o.float()).all() else float("inf")
            for o in outs]
    return max(errs, default=0.0)


def warm_clocks(seconds: float = 2.0, n: int = 8192) -> float:
    """Run bf16 matrix products for `seconds` so the GPU leaves its idle clocks; TFLOP/s."""
    import time
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        done += 10
    el = time.perf_counter() - t0
    del a, b
    return 2 * n**3 * done / el / 1e12


def time_graph(calls, stream, n_launch: int, samples: int = 30, warmup: int = 5) -> dict:
    """Capture `n_launch` calls (cycling over `calls`, each enqueuing one library call on the
    current torch stream) into one torch CUDA graph on `stream`, replay it `warmup` times,
    then `samples` times with events around each replay. Returns per-call µs statistics."""
    import torch
    for c in calls:                      # eager once: lazy allocations happen outside capture
        with torch.cuda.stream(stream):
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(n_launch):
            calls[i % len(calls)]()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            g.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(samples)]
        for start, end in ev:
            start.record(stream)
            g.replay()
            end.record(stream)
    stream.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / n_launch for s, e in ev]
    del g
    out = summarize(per_call)
    out["launches_per_graph"] = n_launch
    return out
