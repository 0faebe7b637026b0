"""Tensor-parallel decode: a Llama-shaped model over every visible GPU, attention by rtattn.

    python tools/demo_tp.py [--simulate 2] [--layers 4] [--steps 24] [--batch 16] [--heads 32/8]

Each rank holds 1/world of the query and KV heads (and of the MLP): column-parallel q/k/v and
gate/up projections, row-parallel output and down projections, one all-reduce after attention
and one after the MLP of every layer (torch.distributed over NCCL, one process per GPU). The
paged KV cache of a rank holds its KV heads only; rtattn's BatchDecodeWrapper on the rank's
device runs its heads' attention, each layer from its CUDA graph pool (DecodeGraphs: capture
per rank). Every step decodes one token per request (inputs fixed per step: teacher forcing),
so each request's KV grows by one token a step.

Checks (exit status 1 if one fails):
  * rank 0 runs the same model unsplit on its GPU (the one-GPU run): every step's output of the
    TP run matches it within the bf16 tolerance (bitwise when world = 1);
  * each rank's attention from graphs is bitwise its eager run() (first and last step);
  * --simulate R: in this process, R ranks on one device (heads split R ways, one SharedPlan
    for their wrappers, the all-reduce a sum on the device), the same comparison with the
    unsplit run; and one attention call split R ways against the unsplit call on the same
    q/k/v (bitwise expected: the same grid plans the same split for every head).
Printed per rank: step time, attention time, all-reduce time (CUDA events, mean over steps),
attention alone (this rank's last plan replayed while the other ranks wait) against attention
with every rank running, and the imbalance across ranks (slowest / fastest - 1).

NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the PyTorch/NVSHMEM twins, set below
before torch loads): on shared machines it can take the host's GPUs out of service.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v   # forced, not defaulted: inherited by the rank processes

TOL = 3e-2   # bf16: relative L2 error of a step's output against the unsplit run


@dataclass(frozen=True)
class Config:
    layers: int = 4
    steps: int = 24
    batch: int = 16
    heads: tuple = (32, 8)
    head_dim: int = 128
    page_size: int = 16
    ffn_mult: int = 2
    min_len: int = 128
    max_len: int = 2048
    seed: int = 0
    graphs: bool = True

    @property
    def hidden(self) -> int:
        return self.heads[0] * self.head_dim


def split_heads(num_qo_heads: int, num_kv_heads: int, world: int) -> tuple[int, int]:
    """Query and KV heads per rank; every rank keeps whole KV heads and their query groups."""
    if world < 1:
        raise ValueError(f"world size {world}: need at least one rank")
    if num_kv_heads % world or num_qo_heads % world:
        raise ValueError(f"{num_qo_heads}/{num_kv_heads} heads do not split over {world} ranks "
                         f"(each rank needs whole KV heads and their query heads)")
    return num_qo_heads // world, num_kv_heads // world


class PageTables:
    """Each request's pages, drawn once from a shuffled pool (the same on every rank: every rank
    plans the same batch); per step the page table of the lengths so far."""

    def __init__(self, init_lens, steps: int, page_size: int, seed: int):
        self.lens = np.asarray(init_lens, dtype=np.int64).copy()
        self.page_size = page_size
        per_req = -(-(self.lens + steps + 1) // page_size)   # one token spare: the timing pass after the steps
        self.num_pages = int(per_req.sum())
        pool = np.random.default_rng(seed).permutation(self.num_pages).astype(np.int32)
        starts = np.concatenate([[0], np.cumsum(per_req)])
        self.pages = [pool[starts[b]:starts[b + 1]] for b in range(len(self.lens))]

    def append(self):
        """One token more per request: (page, slot) of each new token, then the page table
        (kv_indptr, kv_indices, kv_last_page_len) over the lengths with it."""
        ps = self.page_size
        pos = self.lens.copy()
        page = np.array([self.pages[b][p // ps] for b, p in enumerate(pos)], dtype=np.int64)
        slot = pos % ps
        self.lens += 1
        used = -(-self.lens // ps)
        kv_indptr = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
        kv_indices = np.concatenate([self.pages[b][:used[b]] for b in range(len(self.lens))]).astype(np.int32)
        last = ((self.lens - 1) % ps + 1).astype(np.int32)
        return page, slot, (kv_indptr, kv_indices, last)


def init_lengths(cfg: Config) -> np.ndarray:
    """Skewed context lengths (log-uniform between min_len and max_len), the same on every rank."""
    rng = np.random.default_rng(cfg.seed + 1)
    lo = min(cfg.min_len, cfg.max_len)
    return np.exp(rng.uniform(np.log(lo), np.log(cfg.max_len), cfg.batch)).astype(np.int64)


# ------------------------------------------------------------------------------------ torch part
def _full(torch, shape, seed: int, device, scale: float):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(torch.bfloat16)


def rms_norm(torch, x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class RankModel:
    """Rank `rank` of `world`: its slices of every layer's weights, its KV heads' paged caches,
    and its rtattn wrapper (on `device`). world = 1 is the unsplit model."""

    def __init__(self, torch, cfg: Config, rank: int, world: int, device, tables: PageTables, num_ctas=None):
        import rtattn
        from rtattn.graphs import DecodeGraphs
        self.torch, self.cfg, self.rank, self.world, self.device = torch, cfg, rank, world, device
        Hq, Hk = cfg.heads
        D, hid, ffn = cfg.head_dim, cfg.hidden, cfg.ffn_mult * cfg.hidden
        self.hq, self.hk = split_heads(Hq, Hk, world)
        self.ffn = ffn // world
        r = rank
        q_cols = slice(r * self.hq * D, (r + 1) * self.hq * D)
        k_cols = slice(Hq * D + r * self.hk * D, Hq * D + (r + 1) * self.hk * D)
        v_cols = slice((Hq + Hk) * D + r * self.hk * D, (Hq + Hk) * D + (r + 1) * self.hk * D)
        f_cols = slice(r * self.ffn, (r + 1) * self.ffn)
        self.layers = []
        for l in range(cfg.layers):   # the full weights from a seed (the same everywhere), then this rank's slice
            s = cfg.seed * 1000 + l * 10
            wqkv = _full(torch, (hid, (Hq + 2 * Hk) * D), s, device, hid ** -0.5)
            wo = _full(torch, (Hq * D, hid), s + 1, device, (Hq * D) ** -0.5)
            wgu = _full(torch, (hid, 2 * ffn), s + 2, device, hid ** -0.5)
            wd = _full(torch, (ffn, hid), s + 3, device, ffn ** -0.5)
            k0 = _full(torch, (tables.num_pages, cfg.page_size, Hk, D), s + 4, device, 1.0)
            v0 = _full(torch, (tables.num_pages, cfg.page_size, Hk, D), s + 5, device, 1.0)
            heads = slice(r * self.hk, (r + 1) * self.hk)
            self.layers.append(dict(
                wqkv=torch.cat([wqkv[:, q_cols], wqkv[:, k_cols], wqkv[:, v_cols]], 1).contiguous(),
                wo=wo[q_cols].contiguous(),
                wgu=torch.cat([wgu[:, f_cols], wgu[:, ffn + f_cols.start:ffn + f_cols.stop]], 1).contiguous(),
                wd=wd[f_cols].contiguous(),
                k=k0[:, :, heads].contiguous(), v=v0[:, :, heads].contiguous(),
                out=torch.empty(cfg.batch, self.hq, D, dtype=torch.bfloat16, device=device)))
        self.wrapper = rtattn.BatchDecodeWrapper(self.hq, self.hk, D, cfg.page_size, max_batch=cfg.batch,
                                                 max_pages=tables.num_pages, num_pages_pool=tables.num_pages,
                                                 device=device.index, num_ctas=num_ctas)
        self.graphs = DecodeGraphs(self.wrapper) if cfg.graphs else None
        self.attn_events = []   # (start, end) per attention call of the current step

    def attention_part(self, l: int, x, page, slot, stream, check_eager: bool = False):
        """Layer l up to the row-parallel output projection: this rank's partial sum [B, hidden]."""
        torch, cfg, L = self.torch, self.cfg, self.layers[l]
        B, D = x.shape[0], cfg.head_dim
        qkv = rms_norm(torch, x) @ L["wqkv"]
        q = qkv[:, :self.hq * D].view(B, self.hq, D)
        L["k"][page, slot] = qkv[:, self.hq * D:(self.hq + self.hk) * D].view(B, self.hk, D)
        L["v"][page, slot] = qkv[:, (self.hq + self.hk) * D:].view(B, self.hk, D)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.attend(q, L, stream)
        end.record()
        self.attn_events.append((start, end))
        if check_eager and self.graphs is not None:
            eager = torch.empty_like(L["out"])
            self.wrapper.run(q, L["k"], L["v"], out=eager, stream=stream)
            if not torch.equal(eager, L["out"]):
                raise AssertionError(f"rank {self.rank} layer {l}: the graph replay differs from eager run()")
        return L["out"].view(B, self.hq * D) @ L["wo"]

    def attend(self, q, L: dict, stream):
        """Layer L's attention into L["out"]: from its graph pool (DecodeGraphs), else eager run()."""
        if self.graphs is not None:
            self.graphs.step(q, L["k"], L["v"], out=L["out"], stream=stream)
        else:
            self.wrapper.run(q, L["k"], L["v"], out=L["out"], stream=stream)

    def mlp_part(self, l: int, x):
        torch, L = self.torch, self.layers[l]
        g, u = (rms_norm(torch, x) @ L["wgu"]).split(self.ffn, dim=1)
        return (torch.nn.functional.silu(g) * u) @ L["wd"]

    def attention_ms(self) -> float:
        ms = sum(s.elapsed_time(e) for s, e in self.attn_events)
        self.attn_events = []
        return ms


def step_inputs(torch, cfg: Config, steps: int, device):
    """The hidden state fed at each step (teacher forcing: the same for every run)."""
    return _full(torch, (steps, cfg.batch, cfg.hidden), cfg.seed + 7, device, 1.0)


def run_model(torch, ranks, reduce, cfg: Config, tables: PageTables, inputs, stream, plan, timer=None):
    """Decode cfg.steps tokens with the local ranks (all of the model's ranks in one process, or
    this process's one); `reduce(partials)` sums the ranks' partial outputs (all-reduce).
    Returns the outputs per step [steps, B, hidden] and per-step times."""
    outs, times = [], []
    for t in range(cfg.steps):
        page, slot, table = tables.append()
        page = torch.as_tensor(page, device=ranks[0].device)
        slot = torch.as_tensor(slot, device=ranks[0].device)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        plan(table)
        x = inputs[t]
        check = t in (0, cfg.steps - 1)
        for l in range(cfg.layers):
            x = x + reduce([r.attention_part(l, x, page, slot, stream, check_eager=check) for r in ranks])
            x = x + reduce([r.mlp_part(l, x) for r in ranks])
        outs.append(rms_norm(torch, x))
        t1.record()
        t1.synchronize()
        times.append((t0.elapsed_time(t1), [r.attention_ms() for r in ranks],
                      timer.step_ms() if timer is not None else 0.0))
    return torch.stack(outs), times


def unsplit_run(torch, cfg: Config, device, inputs, stream):
    """The reference: the same steps (page tables from cfg.seed, `inputs`) by one rank holding
    every head, on `device`. Returns run_model's (outputs, times)."""
    tables = PageTables(init_lengths(cfg), cfg.steps, cfg.page_size, cfg.seed)
    ref = RankModel(torch, cfg, 0, 1, device, tables)
    return run_model(torch, [ref], lambda p: p[0], cfg, tables, inputs, stream,
                     lambda table: ref.wrapper.plan(*table, stream=stream))


def rel_err(torch, a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class AllReduce:
    """dist.all_reduce with CUDA events around each call (the all-reduce time per step)."""

    def __init__(self, torch, dist):
        self.torch, self.dist, self.events = torch, dist, []

    def __call__(self, partials):
        (y,) = partials
        s, e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        s.record()
        self.dist.all_reduce(y)
        e.record()
        self.events.append((s, e))
        return y

    def step_ms(self) -> float:
        ms = sum(s.elapsed_time(e) for s, e in self.events)
        self.events = []
        return ms


def attention_alone_ms(torch, model: RankModel, table, stream, reps: int = 20) -> float:
    """This rank's attention over every layer on one plan, replayed `reps` times: ms per pass."""
    model.wrapper.plan(*table, stream=stream)
    B, D = model.cfg.batch, model.cfg.head_dim
    q = torch.randn(B, model.hq, D, device=model.device, dtype=torch.bfloat16)
    layers = model.layers

    def one():
        for L in layers:
            model.attend(q, L, stream)
    one()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        one()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


# ------------------------------------------------------------------------------ the TP run
def rank_main(rank: int, world: int, cfg: Config, rdzv: str, result_path: str) -> None:
    """One rank of the NCCL run (rank 0 also runs the unsplit model and prints the report)."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    stream = torch.cuda.Stream(device)
    lines, ok = [], True
    with torch.cuda.stream(stream):
        tables = PageTables(init_lengths(cfg), cfg.steps, cfg.page_size, cfg.seed)
        model = RankModel(torch, cfg, rank, world, device, tables)
        inputs = step_inputs(torch, cfg, cfg.steps, device)
        reduce = AllReduce(torch, dist)
        dist.barrier()
        outs, times = run_model(torch, [model], reduce, cfg, tables, inputs, stream,
                                lambda table: model.wrapper.plan(*table, stream=stream), timer=reduce)
        last = tables.append()[2]   # the next step's table: attention alone vs with every rank
        dist.barrier()
        with_all = attention_alone_ms(torch, model, last, stream)
        alone = None
        for r in range(world):        # each rank alone while the others wait
            dist.barrier()
            if r == rank:
                alone = attention_alone_ms(torch, model, last, stream)
            torch.cuda.synchronize()
        dist.barrier()
        steady = times[1:] or times
        mine = torch.tensor([np.mean([t[0] for t in steady]), np.mean([t[1][0] for t in steady]),
                             np.mean([t[2] for t in steady]), alone, with_all], device=device, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            ref_outs, _ = unsplit_run(torch, cfg, device, inputs, stream)
            err = max(rel_err(torch, outs[t], ref_outs[t]) for t in range(cfg.steps))
            bitwise = torch.equal(outs, ref_outs)   # expected at world 1 (reported, not required)
            ok = err < TOL
            Hq, Hk = cfg.heads
            lines.append(f"TP decode: world {world}, {cfg.layers} layers, batch {cfg.batch}, heads {Hq}/{Hk} "
                         f"({Hq // world}/{Hk // world} per rank), D={cfg.head_dim}, {cfg.steps} steps, "
                         f"graphs={'on' if cfg.graphs else 'off'}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
            lines.append(f"{'rank':>4} {'step ms':>9} {'attn ms':>9} {'allreduce ms':>13} {'attn alone ms':>14} "
                         f"{'attn with all':>14} {'with/alone':>10}")
            for r, g in enumerate(gathered):
                s_ms, a_ms, ar_ms, al, wa = g.tolist()
                lines.append(f"{r:>4} {s_ms:9.3f} {a_ms:9.3f} {ar_ms:13.3f} {al:14.3f} {wa:14.3f} {wa / al:10.3f}")
            steps_ms = [g[0].item() for g in gathered]
            attn_ms = [g[1].item() for g in gathered]
            lines.append(f"imbalance across ranks: step {max(steps_ms) / min(steps_ms) - 1:.1%}, "
                         f"attention {max(attn_ms) / min(attn_ms) - 1:.1%}")
            lines.append(f"vs the one-GPU run: max relative error {err:.2e} over {cfg.steps} steps "
                         f"(tolerance {TOL:g}; bitwise {'yes' if bitwise else 'no'})  "
                         f"{'PASS' if ok else 'FAIL'}")
            print("\n".join(lines), flush=True)
            with open(result_path, "w") as f:
                f.write("PASS\n" if ok else "FAIL\n")
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(cfg: Config, world: int) -> bool:
    """One process per GPU (in this process when world = 1); True if rank 0's checks passed."""
    with tempfile.TemporaryDirectory() as tmp:
        rdzv, result = os.path.join(tmp, "rdzv"), os.path.join(tmp, "result")
        if world == 1:
            rank_main(0, 1, cfg, rdzv, result)
        else:
            import torch.multiprocessing as mp
            mp.spawn(rank_main, args=(world, cfg, rdzv, result), nprocs=world, join=True)
        with open(result) as f:
            return f.read().strip() == "PASS"


# --------------------------------------------------------------------- simulated split on one GPU
def run_simulated(cfg: Config, world: int) -> bool:
    """`world` ranks in this process on cuda:0, sharing one plan per step; checked against the
    unsplit run on the same device."""
    import torch
    import rtattn
    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream(device)
    ok = True
    with torch.cuda.stream(stream):
        ok &= attention_split_check(torch, cfg, world, device, stream)
        tables = PageTables(init_lengths(cfg), cfg.steps, cfg.page_size, cfg.seed)
        ranks = [RankModel(torch, cfg, r, world, device, tables) for r in range(world)]
        shared = rtattn.SharedPlan([r.wrapper for r in ranks])
        inputs = step_inputs(torch, cfg, cfg.steps, device)
        outs, times = run_model(torch, ranks, lambda p: torch.stack(p).sum(0), cfg, tables, inputs, stream,
                                lambda table: shared.plan(*table, streams=[stream] * world))
        ref_outs, ref_times = unsplit_run(torch, cfg, device, inputs, stream)
    err = max(rel_err(torch, outs[t], ref_outs[t]) for t in range(cfg.steps))
    good = err < TOL
    steady = times[1:] or times
    attn = [np.mean([t[1][r] for t in steady]) for r in range(world)]
    ref_attn = np.mean([t[1][0] for t in (ref_times[1:] or ref_times)])
    print(f"simulated split: {world} ranks on cuda:0, one SharedPlan per step: attention per rank "
          + ", ".join(f"{a:.3f}" for a in attn) + f" ms/step (sum {sum(attn):.3f}, unsplit {ref_attn:.3f}); "
          f"max relative error vs unsplit {err:.2e} (tolerance {TOL:g})  {'PASS' if good else 'FAIL'}", flush=True)
    return ok and good


def attention_split_check(torch, cfg: Config, world: int, device, stream) -> bool:
    """One decode attention call split `world` ways over the heads (same grid as the unsplit
    wrapper, one SharedPlan) against the unsplit call on the same q/k/v."""
    import rtattn
    Hq, Hk = cfg.heads
    hq, hk = split_heads(Hq, Hk, world)
    D, ps = cfg.head_dim, cfg.page_size
    tables = PageTables(init_lengths(cfg), 1, ps, cfg.seed + 3)
    _, _, table = tables.append()
    g = torch.Generator(device=device).manual_seed(cfg.seed + 11)
    q = torch.randn(cfg.batch, Hq, D, generator=g, device=device).to(torch.bfloat16)
    k, v = (torch.randn(tables.num_pages, ps, Hk, D, generator=g, device=device).to(torch.bfloat16) for _ in "kv")
    full = rtattn.BatchDecodeWrapper(Hq, Hk, D, ps, max_batch=cfg.batch, max_pages=tables.num_pages, device=0)
    full.plan(*table, stream=stream)
    want = full.run(q, k, v, stream=stream, out=torch.full_like(q, float("nan")))
    parts = [rtattn.BatchDecodeWrapper(hq, hk, D, ps, max_batch=cfg.batch, max_pages=tables.num_pages, device=0,
                                       num_ctas=full.num_ctas) for _ in range(world)]
    rtattn.SharedPlan(parts).plan(*table, streams=[stream] * world)
    got = torch.full_like(q, float("nan"))
    for r, w in enumerate(parts):
        heads, kv = slice(r * hq, (r + 1) * hq), slice(r * hk, (r + 1) * hk)
        w.run(q[:, heads], k[:, :, kv], v[:, :, kv], out=got[:, heads], stream=stream)
    stream.synchronize()
    err = rel_err(torch, got, want)
    bitwise = torch.equal(got, want)
    good = bool(torch.isfinite(got).all()) and err < 1e-2
    print(f"attention split {world} ways (grid {full.num_ctas} x {hk} per rank) vs unsplit: relative error "
          f"{err:.2e}, bitwise {'yes' if bitwise else 'no'}  {'PASS' if good else 'FAIL'}", flush=True)
    return good


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--batch", type=int, default=Config.batch)
    ap.add_argument("--heads", default="32/8", help="query/KV heads of the whole model")
    ap.add_argument("--head-dim", type=int, default=Config.head_dim)
    ap.add_argument("--max-len", type=int, default=Config.max_len)
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU)")
    ap.add_argument("--simulate", type=int, default=0, metavar="R",
                    help="also split the model R ways on cuda:0 in this process")
    ap.add_argument("--no-graphs", action="store_true", help="eager run() instead of DecodeGraphs")
    args = ap.parse_args(argv)
    try:
        hq, hk = (int(x) for x in args.heads.split("/"))
    except ValueError:
        ap.error(f"--heads {args.heads!r}: expected QO/KV, e.g. 32/8")
    cfg = Config(layers=args.layers, steps=args.steps, batch=args.batch, heads=(hq, hk), head_dim=args.head_dim,
                 max_len=args.max_len, graphs=not args.no_graphs)
    try:
        import torch
    except ImportError:
        print("demo_tp: needs torch (with CUDA and NCCL)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("demo_tp: no CUDA device", file=sys.stderr)
        return 2
    world = args.world or torch.cuda.device_count()
    try:
        for r in {world, args.simulate or 1}:
            split_heads(hq, hk, r)
    except ValueError as e:
        ap.error(str(e))
    if world > torch.cuda.device_count():
        ap.error(f"--world {world}: only {torch.cuda.device_count()} GPU(s) visible")
    ok = True
    if args.simulate:
        ok &= run_simulated(cfg, args.simulate)
    ok &= run_distributed(cfg, world)
    print("demo_tp: all checks passed" if ok else "demo_tp: a check FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
