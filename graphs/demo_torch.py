"""rtattn as the attention of a small torch model, exchanging tensors through DLPack only.

    python -m rtattn.graphs.demo_torch [--steps 24] [--layers 4] [--cuda-graph]

A toy decoder (embedding -> layers of [RMSNorm, qkv projection, rtattn paged decode attention,
output projection] -> logits) decodes greedily for a few steps while requests join at different
times. The paged KV cache lives in torch tensors; rtattn reads them (and q) through DLPack, and
layer 0's output is allocated by rtattn and handed back with torch.from_dlpack. All work runs on
a side torch stream, which rtattn honours (plan() copies and run() launches on it). Every
layer's attention is checked against a torch float32 reference. With --cuda-graph the whole
model step (rtattn kernels included) is also captured by torch.cuda.CUDAGraph and replayed,
with plan() refreshing the device plan before each replay. Exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .decode_sim import PageAllocator

TOL = 2e-2


def build(torch, vocab, layers, H, Hk, D):
    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(H * D)
            self.qkv = nn.Linear(H * D, (H + 2 * Hk) * D, bias=False)
            self.o = nn.Linear(H * D, H * D, bias=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, H * D)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = RMSNorm(H * D)
            self.head = nn.Linear(H * D, vocab, bias=False)

        def forward(self, tokens, slots, attend):
            """tokens [n]; slots [n] flat KV slot (page * page_size + offset) of each new token;
            attend(layer, q, k_cache, v_cache) -> [n, H, D]."""
            x = self.embed(tokens)
            n = tokens.shape[0]
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(layer.norm(x)).split([H * D, Hk * D, Hk * D], dim=-1)
                kc, vc = caches[i]
                kc.view(-1, Hk, D)[slots] = k.reshape(n, Hk, D)   # append this step's K/V to the pages
                vc.view(-1, Hk, D)[slots] = v.reshape(n, Hk, D)
                a = attend(i, q.reshape(n, H, D).contiguous(), kc, vc)
                x = x + layer.o(a.reshape(n, H * D))
            return self.head(self.norm(x))

    caches = []
    return Model(), caches


def reference(torch, q, kc, vc, kv_indptr, kv_indices, last, ps, group):
    """Float32 paged decode attention: [n, H, D]."""
    out = []
    D = q.shape[-1]
    for b in range(q.shape[0]):
        pages = torch.as_tensor(kv_indices[kv_indptr[b]:kv_indptr[b + 1]], device=q.device, dtype=torch.long)
        n_tok = (len(pages) - 1) * ps + int(last[b])
        k = kc[pages].reshape(-1, kc.shape[2], D)[:n_tok].float().repeat_interleave(group, dim=1)
        v = vc[pages].reshape(-1, vc.shape[2], D)[:n_tok].float().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,lhd->hl", q[b].float(), k) / D ** 0.5).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--cuda-graph", action="store_true", help="also replay the whole step from a torch CUDA graph")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("demo_torch needs torch")
        return 1
    from rtattn.wrapper import BatchDecodeWrapper

    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    vocab, H, Hk, D, ps = 512, 8, 2, 64, 16
    max_len = a.steps + 40
    pool_pages = a.batch * (-(-max_len // ps)) + a.batch
    model, caches = build(torch, vocab, a.layers, H, Hk, D)
    model = model.to("cuda", torch.bfloat16).eval()
    for _ in range(a.layers):
        shape = (pool_pages, ps, Hk, D)
        caches.append((torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
                       torch.zeros(shape, device="cuda", dtype=torch.bfloat16)))
    w = BatchDecodeWrapper(H, Hk, D, ps, max_batch=a.batch, max_pages=pool_pages)
    alloc = PageAllocator(pool_pages, rng)
    # request r: a random prompt of 8..40 tokens, joining at step 2r
    reqs = [dict(tokens=list(rng.integers(0, vocab, int(rng.integers(8, 41)))), fed=0, pages=[], join=2 * r)
            for r in range(a.batch)]
    side = torch.cuda.Stream()
    failures, worst = [], 0.0
    out0 = {}

    def attend_checked(kv):
        def attend(i, q, kc, vc):
            if i == 0:   # rtattn allocates the output; torch takes it over through DLPack
                o = torch.from_dlpack(w.run(q, kc, vc, stream=torch.cuda.current_stream()))
                out0["o"] = o
            else:
                o = torch.empty_like(q)
                w.run(q, kc, vc, out=o, stream=torch.cuda.current_stream())
            ref = reference(torch, q, kc, vc, *kv, ps, H // Hk)
            err = float((o.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            nonlocal worst
            worst = max(worst, err)
            if not err < TOL:
                failures.append(f"layer {i}: attention relative error {err:.2e}")
            return o
        return attend

    with torch.no_grad(), torch.cuda.stream(side):
        for step in range(a.steps):
            active = [r for r in reqs if r["join"] <= step]
            toks, slots = [], []
            for r in active:      # each active request feeds its next token (prompt, then generated)
                pos = r["fed"]
                if pos % ps == 0:
                    r["pages"].append(alloc.alloc())
                slots.append(r["pages"][pos // ps] * ps + pos % ps)
                toks.append(r["tokens"][pos])
                r["fed"] += 1
            lens = [r["fed"] for r in active]
            kv_indptr = np.cumsum([0] + [len(r["pages"]) for r in active]).astype(np.int32)
            kv_indices = np.array([p for r in active for p in r["pages"]], np.int32)
            last = np.array([(n - 1) % ps + 1 for n in lens], np.int32)
            kv = (kv_indptr, kv_indices, last)
            w.plan(*kv, stream=side)
            t = torch.tensor(toks, device="cuda")
            s = torch.tensor(slots, device="cuda")
            logits = model(t, s, attend_checked(kv))
            nxt = logits.argmax(-1).tolist()
            for r, tok in zip(active, nxt):
                if r["fed"] == len(r["tokens"]):
                    r["tokens"].append(int(tok))
            assert isinstance(out0["o"], torch.Tensor) and out0["o"].dtype == torch.bfloat16
            print(f"step {step:3d}: batch {len(active)}, KV {min(lens)}..{max(lens)}, "
                  f"worst attention error so far {worst:.2e}")
        if a.cuda_graph:
            failures += graph_phase(torch, model, caches, w, reqs, alloc, side, ps, H, Hk, D, a.batch)
    torch.cuda.synchronize()
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures[:20]))
        return 1
    print(f"all checks passed (worst relative error {worst:.2e})")
    return 0


def graph_phase(torch, model, caches, w, reqs, alloc, stream, ps, H, Hk, D, max_batch) -> list:
    """Capture one whole model step with torch.cuda.CUDAGraph (rtattn's kernels are launched
    on the capturing stream, so they are part of it) and replay it for new tokens; the plan
    is refreshed by w.plan() before each replay. Static buffers sized for the full batch."""
    failures = []
    active = [r for r in reqs if r["fed"] > 0]
    n = len(active)
    tok_buf = torch.zeros(n, dtype=torch.long, device="cuda")
    slot_buf = torch.zeros(n, dtype=torch.long, device="cuda")
    outs = [torch.empty((n, H, D), device="cuda", dtype=torch.bfloat16) for _ in caches]
    qs = [None] * len(caches)

    def attend(i, q, kc, vc):
        qs[i] = q
        w.run(q, kc, vc, out=outs[i], stream=torch.cuda.current_stream())
        return outs[i]

    def prepare_step():
        slots, toks = [], []
        for r in active:
            pos = r["fed"]
            if pos % ps == 0:
                r["pages"].append(alloc.alloc())
            slots.append(r["pages"][pos // ps] * ps + pos % ps)
            toks.append(r["tokens"][pos] if pos < len(r["tokens"]) else r["tokens"][-1])
            r["fed"] += 1
        lens = [r["fed"] for r in active]
        kv = (np.cumsum([0] + [len(r["pages"]) for r in active]).astype(np.int32),
              np.array([p for r in active for p in r["pages"]], np.int32),
              np.array([(m - 1) % ps + 1 for m in lens], np.int32))
        tok_buf.copy_(torch.tensor(toks, device="cuda"))
        slot_buf.copy_(torch.tensor(slots, device="cuda"))
        w.plan(*kv, stream=torch.cuda.current_stream())
        return kv

    kv = prepare_step()
    model(tok_buf, slot_buf, attend)          # warm-up outside capture (torch recommends it)
    torch.cuda.current_stream().synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        logits = model(tok_buf, slot_buf, attend)
    for rep in range(4):
        kv = prepare_step()
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.current_stream().synchronize()
        for i, (kc, vc) in enumerate(caches):
            ref = reference(torch, qs[i], kc, vc, *kv, ps, H // Hk)
            err = float((outs[i].float() - ref).norm() / ref.norm().clamp_min(1e-30))
            if not err < TOL:
                failures.append(f"torch CUDA graph replay {rep} layer {i}: relative error {err:.2e}")
        print(f"torch CUDA graph replay {rep}: batch {n}, KV up to {max(r['fed'] for r in active)}, "
              f"logits finite: {bool(torch.isfinite(logits).all())}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
