"""Prefill benchmark: rtattn's tensor-core prefill vs FlashInfer (fa2, fa3) and torch SDPA on
the prefill rows of shared/PERF.md, one process, the same inputs for every library.

    python tools/bench_prefill.py                      # every row, rtattn + FlashInfer fa2
    python tools/bench_prefill.py --rows 16x1024 2x8192 --libs rt fa2 fa3 sdpa
    python tools/bench_prefill.py --rt-tiles default q128_kv32_w8_s3 q64_kv32_w4_s3_b3   # tile A/B
    python tools/bench_prefill.py --rt-tiles default sync   # the family's kernel vs mma.sync
    python tools/bench_prefill.py --libs rt fa2 --rt-tiles default x   # the KV stream across items (tile cross)
    python tools/bench_prefill.py --rows 16x1024 32x512 --shapes 32:32:128:16 --queue-order lpt request   # plan queue order A/B
    python tools/bench_prefill.py --rows 'mtd*' --libs rt rtdec fa2        # multi-token decode
    python tools/bench_prefill.py --rows '8x2048*'          # 8 x 2048 causal and its variant rows
    python tools/bench_prefill.py --rows '*-window' 8x2048  # every window row and a causal twin
    python tools/bench_prefill.py --rows 16x1024 --shapes 32:8:64:16 32:32:128:1   # the neighbourhood, one process
    python tools/bench_prefill.py --rows 16x1024 chunk16x4096+512 --shapes nbhd   # SHAPE_SETS["nbhd"]: model shapes

32/8 heads, D = 128, bf16, page 16, pages scattered (--heads, --head-dim, --page change them, --shapes runs several;
rows named *-plain are non-causal; NAME-softcap/-alibi/-window are causal with that variant and
run right after their causal twin NAME, and the run ends with each variant's TFLOP/s over its
twin's). TFLOP/s = 4 * H * D * attended (q, k)
pairs / time (causal: L(L+1)/2 per square request; a window of 1024 attends <= 1025 keys).
Every library's output is checked against a float32 reference on sampled query rows before it
is timed; a wrong output is reported, not timed. Timing: CUDA-graph replays (tools/bench_common).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
TOL = 2e-2
SAMPLE_ROWS = 192
WINDOW, SOFTCAP = 1024, 50.0   # the window and soft-cap rows' parameters


@dataclass(frozen=True)
class Row:
    name: str
    batch: int
    dist: str            # "const:N" | "uniform:A:B" | "heavy:MEAN"
    cached: int = 0      # cached prefix tokens per request (chunked prefill)
    variant: str = "causal"   # causal | softcap | alibi | window | plain (no mask)

    def lengths(self) -> np.ndarray:
        rng = bc.rng_for(self.name)
        kind, *a = self.dist.split(":")
        if kind == "const":
            return np.full(self.batch, int(a[0]), np.int64)
        if kind == "uniform":
            return bc.lengths_uniform(rng, self.batch, int(a[0]), int(a[1]))
        return bc.lengths_heavy(rng, self.batch, int(a[0]))


VARIANTS = ("softcap", "alibi", "window", "plain")


def _rows() -> list[Row]:
    """Every row, in the order they run. Each of the sizes 32x512, 8x2048, 2x8192 and 1x16384
    runs causal and then its variant rows (NAME-softcap, -alibi, -window, -plain) on the same
    lengths, back to back: a variant's cost is read against its causal twin measured moments
    before, and a budget that stops the run drops whole sizes, never only their variants. (No
    window row where the window covers the whole request: it would time the causal row again.)"""
    def sized(name, batch, dist):
        length = int(dist.split(":")[1])
        return [Row(name, batch, dist)] + [Row(f"{name}-{v}", batch, dist, variant=v) for v in VARIANTS
                                           if v != "window" or length > WINDOW + 1]

    return [Row("16x1024", 16, "const:1024"), Row("16xU512-1024", 16, "uniform:512:1024"),
            Row("16xheavy1024", 16, "heavy:1024"), Row("4x4096", 4, "const:4096"),
            *sized("32x512", 32, "const:512"), *sized("8x2048", 8, "const:2048"),
            *sized("2x8192", 2, "const:8192"), *sized("1x16384", 1, "const:16384"),
            Row("chunk16x4096+512", 16, "const:512", cached=4096),
            # multi-token decode (speculative verification): q_len 4 over a 4092-token prefix
            Row("mtd64x4096-q4", 64, "const:4", cached=4092), Row("mtd64x4096-q1", 64, "const:1", cached=4095),
            # the family choice's rows (rtattn.families.choice; --libs rt rtdec): 8/16/32/64 fused rows
            # and a small batch (fixed costs)
            Row("mtd64x4096-q2", 64, "const:2", cached=4094), Row("mtd64x4096-q8", 64, "const:8", cached=4088),
            Row("mtd64x4096-q16", 64, "const:16", cached=4080), Row("mtd16x1024-q4", 16, "const:4", cached=1020)]


def select_rows(patterns) -> list[Row]:
    """The rows whose names match any of the glob patterns, in run order ('8x2048*': the size and
    its variants; '*-window': every window row). A pattern that matches nothing is refused."""
    rows = _rows()
    for pat in patterns:
        if not any(fnmatch.fnmatch(r.name, pat) for r in rows):
            raise SystemExit(f"--rows {pat!r} matches no row (rows: {' '.join(r.name for r in rows)})")
    return [r for r in rows if any(fnmatch.fnmatch(r.name, pat) for pat in patterns)]


def causal_twin(name: str) -> str | None:
    """The causal row a variant row is measured against ('8x2048-alibi' -> '8x2048')."""
    base, _, variant = name.rpartition("-")
    return base if base and variant in VARIANTS else None


def variant_costs(results: dict, lib: str = "rt") -> list[tuple[str, float]]:
    """(variant row, its TFLOP/s over its causal twin's) for every variant row whose twin ran too
    (the issue's targets: soft-cap and ALiBi >= 0.95, window 1.0, on attended pairs)."""
    out = []
    for name, res in results.items():
        twin = causal_twin(name)
        a, b = res.get(lib, {}), results.get(twin, {}).get(lib, {})
        if twin and a.get("ok") and b.get("ok"):
            out.append((name, a["tflops"] / b["tflops"]))
    return out


def set_shape(heads: str, head_dim: int, page: int) -> None:
    """--heads 'HQ:HKV', --head-dim, --page: the module's shape, read by every library's call."""
    global HQ, HKV, D, PAGE
    hq, hkv = (int(v) for v in heads.split(":"))
    if hq % hkv or head_dim not in (64, 128, 256) or page < 1 or page & (page - 1):
        raise SystemExit(f"bad shape: heads {heads} (HQ a multiple of HKV), head dim {head_dim} (64/128/256), "
                         f"page {page} (a power of two)")
    HQ, HKV, D, PAGE = hq, hkv, head_dim, page


def attended_pairs(qo, kv, variant: str) -> int:
    total = 0
    for lq, lk in zip(qo, kv):
        pos = np.arange(lk - lq, lk, dtype=np.int64)   # query positions
        seen = np.full_like(pos, lk) if variant == "plain" else pos + 1
        if variant == "window":
            seen = np.minimum(seen, WINDOW + 1)
        total += int(seen.sum())
    return total


class Inputs:
    def __init__(self, row: Row):
        import torch
        self.row = row
        self.qo = row.lengths()
        self.kv = self.qo + row.cached
        self.qo_indptr = np.concatenate([[0], np.cumsum(self.qo)]).astype(np.int32)
        self.indptr, self.indices, self.last = bc.page_table(bc.rng_for(row.name, 1), self.kv, PAGE)
        T, N = int(self.qo.sum()), int(self.indptr[-1])
        self.tokens, self.pages = T, N
        self.flops = 4 * HQ * D * attended_pairs(self.qo, self.kv, row.variant)
        nbytes = (N * PAGE * HKV * 2 + 2 * T * HQ) * D * 2
        self.copies = min(4, bc.rotation_copies(nbytes))
        g = torch.Generator(device="cuda").manual_seed(int(bc.rng_for(row.name, 2).integers(2**31)))
        dt = torch.bfloat16
        self.q = [torch.randn(T, HQ, D, device="cuda", dtype=dt, generator=g) for _ in range(self.copies)]
        self.k = [torch.randn(N, PAGE, HKV, D, device="cuda", dtype=dt, generator=g) for _ in range(self.copies)]
        self.v = [torch.randn(N, PAGE, HKV, D, device="cuda", dtype=dt, generator=g) for _ in range(self.copies)]
        self.slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)], device="cuda")
        self._sample = np.random.default_rng(5).choice(T, size=min(T, SAMPLE_ROWS), replace=False)
        self.ref = [self._reference(c) for c in range(self.copies)]

    def _reference(self, c: int):
        """float32 attention of the sampled query rows (all heads)."""
        import torch
        out = torch.empty(len(self._sample), HQ, D, device="cuda")
        req = np.searchsorted(self.qo_indptr, self._sample, side="right") - 1
        pages = torch.from_numpy(self.indices.astype(np.int64)).cuda()
        g, scale = HQ // HKV, 1.0 / math.sqrt(D)
        for b in np.unique(req):
            p = pages[int(self.indptr[b]):int(self.indptr[b + 1])]
            L = int(self.kv[b])
            k = self.k[c][p].reshape(-1, HKV, D)[:L].float().repeat_interleave(g, 1)
            v = self.v[c][p].reshape(-1, HKV, D)[:L].float().repeat_interleave(g, 1)
            sel = np.nonzero(req == b)[0]
            rows = self._sample[sel]
            qpos = torch.from_numpy(rows - self.qo_indptr[b] + L - self.qo[b]).cuda()
            qb = self.q[c][torch.from_numpy(rows).cuda()].float()
            s = torch.einsum("nhd,lhd->hnl", qb, k) * scale
            j = torch.arange(L, device="cuda")
            if self.row.variant == "alibi":
                s = s + self.slopes[:, None, None] * (j[None, None, :] - qpos[None, :, None])
            if self.row.variant == "softcap":
                s = SOFTCAP * torch.tanh(s / SOFTCAP)
            keep = j[None, :] <= (qpos[:, None] if self.row.variant != "plain" else L)
            if self.row.variant == "window":
                keep &= j[None, :] >= qpos[:, None] - WINDOW
            s = s.masked_fill(~keep[None], float("-inf"))
            out[torch.from_numpy(sel).cuda()] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
        return out

    def rel_err(self, outs) -> float:
        import torch
        worst = 0.0
        idx = torch.from_numpy(self._sample).cuda()
        for o, r in zip(outs, self.ref):
            o = o[idx].float()
            if not torch.isfinite(o).all():
                return float("inf")
            worst = max(worst, float((o - r).norm() / r.norm()))
        return worst

    def new_outs(self):
        import torch
        return [torch.full_like(q, float("nan")) for q in self.q]


def _measure(ctx, x: Inputs, calls, outs) -> dict:
    import torch
    for c in calls:
        c()
    torch.cuda.synchronize()
    err = x.rel_err(outs)
    if not err < TOL:
        return {"ok": False, "rel_err": err}
    if hasattr(outs, "poison"):
        outs.poison()
    else:
        for o in outs:
            o.fill_(float("nan"))
    est = x.flops / 300e12 * 1e6
    n = max(x.copies, int(math.ceil(min(64, max(1, 4000 / est)) / x.copies)) * x.copies)
    t = bc.time_graph(calls, ctx.stream, n, samples=ctx.samples)
    err = max(err, x.rel_err(outs))
    us = t["median"]
    return {"ok": err < TOL, "rel_err": err, "us": us, "tflops": x.flops / us / 1e6}


def rt_spec(variant: str):
    from rtattn.codegen import spec as S
    kw = {"causal": dict(causal=True), "plain": {}, "softcap": dict(causal=True, soft_cap=True),
          "alibi": dict(causal=True, alibi=True), "window": dict(causal=True, window=True)}[variant]
    return S.standard(head_dim=D, **kw)   # the module's head dim (--head-dim)


def rt_params(x: Inputs) -> dict | None:
    v = x.row.variant
    return {"soft_cap": SOFTCAP} if v == "softcap" else {"alibi_slopes": x.slopes} if v == "alibi" else \
        {"window_left": WINDOW} if v == "window" else None


# tag parts that set one tile field to a fixed value (parse_tile)
TAG_FLAGS = {"wg": ("mma", "wgmma"), "ws": ("mma", "ws"), "sync": ("mma", "sync"), "x": ("cross", True), "pp": ("pingpong", True),
             "fe": ("fma_exp2", True)}


def parse_tile(tag: str) -> dict:
    """'q128_kv64_w4_s2' (optionally '_b3': CTAs per SM compiled for) -> tile overrides; a part
    'wg', 'ws' (warp-specialized) or 'sync' picks the kernel ('sync' alone: the mma.sync kernel under its own policy); a part
    'x' the KV stream across items ('x' alone: the policy's tile with it); a part 'pp' the two
    warpgroups' turns (wgmma, 128 rows); 'fe' half the softmax's exp2 on the FMA pipe."""
    out = {}
    for part in tag.split("_"):
        if part in TAG_FLAGS:
            field, value = TAG_FLAGS[part]
            out[field] = value
        for key, name in (("kv", "tile_kv"), ("q", "rows"), ("w", "num_warps"), ("s", "stages"),
                          ("b", "ctas_per_sm")):
            if part.startswith(key) and part[len(key):].isdigit():
                out[name] = int(part[len(key):])
                break
    return out


def bench_rtattn(ctx, x: Inputs, tile: str | None, queue_order: str = "lpt") -> dict:
    import torch
    from rtattn.prefill_wrapper import BatchPrefillWrapper
    w = BatchPrefillWrapper(HQ, HKV, D, PAGE, max_batch=len(x.qo), max_qo_tokens=x.tokens, max_pages=x.pages,
                            max_qo_len=int(x.qo.max()), variant=rt_spec(x.row.variant),
                            tile=parse_tile(tile) if tile else None, queue_order=queue_order)
    t0 = time.perf_counter()
    w.plan(x.qo_indptr, x.indptr, x.indices, x.last, window_left=WINDOW if x.row.variant == "window" else None)
    plan_us = (time.perf_counter() - t0) * 1e6
    outs = x.new_outs()
    launches = [w.prepare(x.q[c], x.k[c], x.v[c], out=outs[c], stream=ctx.stream, params=rt_params(x))
                for c in range(x.copies)]
    calls = [lambda l=l: l(torch.cuda.current_stream()) for l in launches]
    res = _measure(ctx, x, calls, outs)
    res.update(plan_us=plan_us, tile=w.tile.tag, num_ctas=w.num_ctas, items=w.info.num_items,
               merge_rows=w.info.num_merge_rows, regs=w.kernels.attention.attributes()["num_regs"],
               ctas_per_sm=w.kernels.ctas_per_sm, queue_order=w.info.queue_order, queue_order_asked=queue_order)
    return res


def prebuild(rows, tiles, arch: str) -> int:
    """Compile, without a GPU, the rtattn instances a run of these rows and tiles loads, into the
    CUBIN cache (RTATTN_CACHE_DIR) a device call then carries: each tile as BatchPrefillWrapper
    picks it (average query length min(longest, 1024), KV bound pages x page / batch) with the
    tag's overrides. A tile picked differently on the device only compiles there."""
    from rtattn.families import prefill as family
    from rtattn.families import resources
    dev = resources.device_for_arch(arch)
    built = set()
    for row in rows:
        qo = row.lengths()
        pages = int(((qo + row.cached + PAGE - 1) // PAGE).sum())
        for tag in tiles:
            try:
                tile = family.choose_tile(dev, D, HQ // HKV, float(min(int(qo.max()), 1024)),
                                          avg_kv_len=pages * PAGE / len(qo),
                                          **(parse_tile(tag) if tag not in (None, "default") else {}))
            except ValueError as e:   # a tag this shape cannot take: the timed run reports it the same way
                print(f"{shape_name()} {tag}: skipped ({e})", flush=True)
                continue
            if (row.variant, tile) not in built:
                built.add((row.variant, tile))
                family.compile_prefill(rt_spec(row.variant), tile, arch, quiet=True)
    print(f"prebuilt {len(built)} rtattn prefill instances for {arch}", flush=True)
    return 0


def bench_rt_decode(ctx, x: Inputs) -> dict:
    """The decode family on the same batch (multi-token decode: its tile holds 16 or 32 fused
    rows; longer queries are split into tiles that each read the KV)."""
    import torch
    from rtattn.wrapper import BatchDecodeWrapper
    if x.row.variant != "causal":
        return {"ok": False, "rel_err": float("nan"), "note": "causal rows only"}
    w = BatchDecodeWrapper(HQ, HKV, D, PAGE, max_batch=len(x.qo), max_pages=x.pages, max_qo_tokens=x.tokens,
                           max_qo_len=int(x.qo.max()), variant="causal")
    w.plan(x.indptr, x.indices, x.last, qo_indptr=x.qo_indptr)
    outs = x.new_outs()
    launches = [w.prepare(x.q[c], x.k[c], x.v[c], out=outs[c], stream=ctx.stream) for c in range(x.copies)]
    res = _measure(ctx, x, [lambda l=l: l(torch.cuda.current_stream()) for l in launches], outs)
    res.update(items=w.info.num_items, merge_rows=w.info.num_merge_rows, rows=w.spec.rows)
    return res


def family_choice(x: Inputs) -> str:
    """What rtattn.families.choice predicts for the row (to compare with the rt / rtdec times)."""
    from rtattn.families.choice import choose_family
    c = choose_family(HQ, HKV, D, int(x.qo.max()), float(x.kv.mean()), len(x.qo))
    return f"choice {c.family} (model: decode {c.estimates_us['decode']:.0f}, prefill {c.estimates_us['prefill']:.0f} us)"


def bench_flashinfer(ctx, x: Inputs, backend: str) -> dict:
    import flashinfer
    import torch
    if ctx.fi_ws is None:
        ctx.fi_ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ctx.fi_ws, kv_layout="NHD", backend=backend)
    v = x.row.variant
    if v == "alibi" and backend == "fa3":
        return {"ok": False, "rel_err": float("nan"), "note": "fa3 has no ALiBi"}
    kw = dict(causal=v != "plain", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if v == "softcap":
        kw["logits_soft_cap"] = SOFTCAP
    if v == "window":
        kw["window_left"] = WINDOW
    if v == "alibi":
        kw["pos_encoding_mode"] = "ALIBI"
    t = lambda a: torch.from_numpy(a.astype(np.int32)).cuda()  # noqa: E731
    w.plan(t(x.qo_indptr), t(x.indptr), t(x.indices), t(x.last), HQ, HKV, D, PAGE, **kw)
    outs = x.new_outs()
    calls = [lambda c=c: w.run(x.q[c], (x.k[c], x.v[c]), out=outs[c]) for c in range(x.copies)]
    return _measure(ctx, x, calls, outs)


class _DenseOuts:
    """SDPA's outputs [B, H, L, D] as the [tokens, H, D] rows the check reads (a copy outside the
    timed region: the timed call writes SDPA's own layout, as a dense-attention user would)."""

    def __init__(self, n, shape):
        self.held, self.shape = [None] * n, shape

    def __iter__(self):
        B, L, H, Dh = self.shape
        return iter(o.transpose(1, 2).reshape(B * L, H, Dh) for o in self.held)

    def poison(self):
        for o in self.held:
            o.fill_(float("nan"))


def bench_sdpa(ctx, x: Inputs, backend: str = "cudnn") -> dict:
    """torch SDPA (cuDNN or flash backend) on dense [B, H, L, D] copies of the same q/K/V (square
    causal rows; K/V repeated to the 32 query heads)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if x.row.variant not in ("causal", "plain") or x.row.cached or len(set(x.qo.tolist())) != 1:
        return {"ok": False, "rel_err": float("nan"), "note": "dense equal-length causal or plain rows only"}
    B, L = len(x.qo), int(x.qo[0])
    pages = torch.from_numpy(x.indices.astype(np.int64)).cuda()
    dense = []
    for c in range(x.copies):
        q = x.q[c].view(B, L, HQ, D).transpose(1, 2).contiguous()
        k = x.k[c][pages].view(B, -1, HKV, D)[:, :L].transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        vv = x.v[c][pages].view(B, -1, HKV, D)[:, :L].transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        dense.append((q, k, vv))
    outs = _DenseOuts(x.copies, (B, L, HQ, D))
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def call(c):
        with sdpa_kernel([kind]):
            outs.held[c] = F.scaled_dot_product_attention(*dense[c], is_causal=x.row.variant == "causal")
    return _measure(ctx, x, [lambda c=c: call(c) for c in range(x.copies)], outs)


class Ctx:
    def __init__(self, samples):
        import torch
        self.stream = torch.cuda.Stream()
        self.samples, self.fi_ws = samples, None


# Named --shapes sets. nbhd: real models' heads the other rows lack -- Qwen2.5-7B 28/4 (g=7),
# Qwen2.5-14B 40/8 (g=5), Llama-3-70B 64/8, Gemma-2 16/8 d256, Phi-3 32/32 on 128-token pages --
# and d64 32/8 on 2-token pages.
SHAPE_SETS = {"nbhd": ("28:4:128:16", "40:8:128:16", "64:8:128:16", "16:8:256:16", "32:32:128:128", "32:8:64:2")}


def parse_shapes(specs) -> list[tuple[str, int, int]]:
    """--shapes 'HQ:HKV:D:PAGE' or a SHAPE_SETS name ... -> [(heads, head dim, page)] (the
    neighbourhood in one process)."""
    out = []
    for spec in (x for name in specs for x in SHAPE_SETS.get(name, (name,))):
        parts = spec.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--shapes {spec!r}: write HQ:HKV:D:PAGE, e.g. 32:8:64:16, or one of {sorted(SHAPE_SETS)}")
        out.append((f"{parts[0]}:{parts[1]}", int(parts[2]), int(parts[3])))
    return out


def queue_taken(r: dict) -> str:
    """', q=ORDER' for a plan whose queue order is not LPT's, or that asked for another and kept LPT's."""
    asked, took = r.get("queue_order_asked", "lpt"), r.get("queue_order", "lpt")
    return "" if asked == took == "lpt" else f", q={took}" + ("" if took == asked else f" (asked {asked})")


def shape_name() -> str:
    return f"{HQ}/{HKV} d{D} p{PAGE}"


def run_rows(ctx, rows, args, t0: float) -> dict:
    """Every row at the module's shape, each library (and rtattn tile) on the same inputs."""
    import torch
    results = {}
    for row in rows:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget reached: {row.name} and later rows skipped", flush=True)
            break
        x = Inputs(row)
        res = {}
        for lib in args.libs:
            for tile, order in ([(t, o) for t in args.rt_tiles for o in args.queue_order] if lib == "rt" else [(None, "lpt")]):
                tile = None if tile == "default" else tile
                key = (lib if tile is None else f"rt:{tile}") + ("" if order == "lpt" else f"+{order}")
                try:
                    with torch.cuda.stream(ctx.stream):
                        if lib == "rt":
                            res[key] = bench_rtattn(ctx, x, tile, order)
                        elif lib in ("fa2", "fa3"):
                            res[key] = bench_flashinfer(ctx, x, lib)
                        elif lib in ("sdpa", "sdpa-flash"):
                            res[key] = bench_sdpa(ctx, x, "flash" if lib == "sdpa-flash" else "cudnn")
                        elif lib == "rtdec":
                            res[key] = bench_rt_decode(ctx, x)
                except Exception as e:  # report and go on: one failing peer must not hide the rest
                    res[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results[row.name] = res
        cells = []
        for key, r in res.items():
            tile = f" [{r['tile']}{queue_taken(r)}]" if r.get("ok") and "tile" in r else ""   # the kernel and tile that ran
            cells.append(f"{key} {r['tflops']:.0f} ({r['us']:.0f} us){tile}" if r.get("ok") and "tflops" in r else
                         f"{key} {'ERR' if 'error' in r else 'WRONG' if r.get('rel_err') == r.get('rel_err') else '-'}")
        rt = next((r for k, r in res.items() if k.startswith("rt") and r.get("ok")), None)
        fa2 = res.get("fa2", {})
        ratio = f" ratio vs fa2 {rt['tflops'] / fa2['tflops']:.2f}" if rt and fa2.get("ok") else ""
        ratio += "".join(f" | {k} / {k.rsplit('+', 1)[0]} {r['tflops'] / res[k.rsplit('+', 1)[0]]['tflops']:.3f}"
                         for k, r in res.items() if k.startswith("rt") and "+" in k and r.get("ok")
                         and res.get(k.rsplit("+", 1)[0], {}).get("ok"))   # a queue order against LPT's
        choice = f" | {family_choice(x)}" if "rtdec" in args.libs and row.variant == "causal" else ""
        print(f"{row.name:22s} " + " | ".join(cells) + ratio + choice, flush=True)
        for key, r in res.items():
            if not r.get("ok"):
                print(f"    {key}: {r}", flush=True)
        del x
        torch.cuda.empty_cache()
    return results


def report(results: dict, libs) -> None:
    ratios = [r["rt"]["tflops"] / r["fa2"]["tflops"] for r in results.values()
              if r.get("rt", {}).get("ok") and r.get("fa2", {}).get("ok")]
    if ratios:
        print(f"rt/fa2: geomean {bc.geomean(ratios):.2f}, min {min(ratios):.2f} over {len(ratios)} rows")
    peers = [k for k in ("fa2", "fa3", "sdpa", "sdpa-flash") if k in libs]
    if "rt" in libs and peers:   # one compact table last: rtattn TFLOP/s and its ratio to each peer
        print("row | rt TFLOP/s | " + " | ".join(f"rt/{k}" for k in peers))
        for name, r in results.items():
            rt = r.get("rt", {})
            cells = [f"{rt['tflops'] / r[k]['tflops']:.2f}" if rt.get("ok") and r.get(k, {}).get("ok") else "-"
                     for k in peers]
            print(f"{name} | {rt['tflops']:.0f} | " + " | ".join(cells) if rt.get("ok") else f"{name} | - | ...")
    for lib in [k for k in ("rt", "fa2", "fa3") if k in libs]:
        costs = variant_costs(results, lib)
        if costs:
            print(f"{lib} variant / causal twin (TFLOP/s over attended pairs): "
                  + ", ".join(f"{n} {r:.3f}" for n, r in costs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["*"], help="row names or glob patterns")
    ap.add_argument("--libs", nargs="*", default=["rt", "fa2"],
                    help="rt (prefill family), rtdec (decode family, <= 32 fused rows), fa2, fa3, "
                         "sdpa (torch SDPA, cuDNN backend), sdpa-flash (torch SDPA, flash backend)")
    ap.add_argument("--rt-tiles", nargs="*", default=[None],
                    help="tile overrides to A/B, e.g. default q128_kv32_w8_s3 ('default': the policy's tile, key rt)")
    ap.add_argument("--queue-order", nargs="*", default=["lpt"], choices=["lpt", "request"],
                    help="plan queue orders to A/B for every rt tile (lpt: the default, key rt; request: key rt+request)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting rows after this many seconds")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--heads", default=f"{HQ}:{HKV}", help="query:KV heads (the neighbourhood: 32:32, 32:4 ...)")
    ap.add_argument("--head-dim", type=int, default=D, help="64, 128 or 256")
    ap.add_argument("--page", type=int, default=PAGE, help="page size (1 to 128, a power of two)")
    ap.add_argument("--shapes", nargs="*", metavar="HQ:HKV:D:PAGE",
                    help="run the rows at each of these shapes in turn, one process (instead of --heads/--head-dim/"
                         f"--page); a name of {sorted(SHAPE_SETS)} stands for its shapes")
    ap.add_argument("--prebuild", metavar="ARCH", help="only compile rtattn's instances for ARCH (sm_90), no GPU")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes) if args.shapes else [(args.heads, args.head_dim, args.page)]
    for shape in shapes:
        set_shape(*shape)   # every shape checked before anything runs
    rows = select_rows(args.rows)
    if args.prebuild:
        for shape in shapes:
            set_shape(*shape)
            prebuild(rows, args.rt_tiles, args.prebuild)
        return 0
    t0 = time.perf_counter()
    print(f"clocks: {bc.warm_clocks(3.0):.0f} TFLOP/s bf16 matmul", flush=True)
    ctx = Ctx(args.samples)
    results = {}
    for shape in shapes:
        set_shape(*shape)
        print(f"shape: {HQ}/{HKV} heads, D = {D}, page {PAGE}", flush=True)
        shape_results = run_rows(ctx, rows, args, t0)
        report(shape_results, args.libs)
        results.update({(f"{shape_name()} {k}" if len(shapes) > 1 else k): v for k, v in shape_results.items()})
    if len(shapes) > 1:
        print("all shapes:")
        report(results, args.libs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
