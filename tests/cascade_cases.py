"""Batches with shared prefixes for the cascade tests: page tables whose requests share
leading pages in a tree (a system prompt, per-prompt groups of samples, loners); and the GPU
cases (inputs, a run into poisoned outputs, the float64 check) that tests/test_cascade.py and
tools/smoke_cascade.py share."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from rtattn.plan.reference import Variant, reference_attention


def shared_batch(rng, page_size: int, *, groups=((3, 2), (2, 1)), system_pages: int = 2, loners: int = 1,
                 suffix_pages=(1, 3), pool: int | None = None):
    """groups: (requests, own shared pages) per group, all after `system_pages` shared by every
    grouped request; loners share nothing. Returns (kv_indptr, kv_indices, last, num_pages)."""
    need = system_pages + sum(p for _, p in groups) + (sum(n for n, _ in groups) + loners) * (suffix_pages[1] + 1)
    pool = pool or need + 7
    ids = rng.permutation(pool).astype(np.int32)
    at = 0

    def take(n):
        nonlocal at
        at += n
        return ids[at - n:at]

    system = take(system_pages)
    reqs = []
    for n, p in groups:
        g = take(p)
        for _ in range(n):
            reqs.append(np.concatenate([system, g, take(int(rng.integers(suffix_pages[0], suffix_pages[1] + 1)))]))
    for _ in range(loners):
        reqs.append(take(int(rng.integers(suffix_pages[0], suffix_pages[1] + 2))))
    kv_indptr = np.zeros(len(reqs) + 1, np.int32)
    kv_indptr[1:] = np.cumsum([len(r) for r in reqs])
    last = rng.integers(1, page_size + 1, len(reqs)).astype(np.int32)
    return kv_indptr, np.concatenate(reqs), last, pool


def one_prefix_batch(batch: int, prefix_tokens: int, suffix_tokens: int, page_size: int, seed: int = 0):
    """`batch` requests over one shared prefix, each with its own suffix; pages scattered."""
    pp, sp = -(-prefix_tokens // page_size), -(-suffix_tokens // page_size)
    ids = np.random.default_rng(seed).permutation(pp + batch * sp).astype(np.int32)
    prefix = ids[:pp]
    idx = np.concatenate([np.concatenate([prefix, ids[pp + b * sp:pp + (b + 1) * sp]]) for b in range(batch)])
    kv_indptr = np.arange(batch + 1, dtype=np.int32) * (pp + sp)
    last = np.full(batch, suffix_tokens - (sp - 1) * page_size, np.int32)
    return kv_indptr, idx, last, pp + batch * sp


def unequal_suffix_batch(B: int, prefix_tokens: int, ps: int, rng, scale: int = 4):
    """`B` requests over one shared prefix with suffixes of 3-32 x `scale` tokens (unequal page
    counts: plan_union's path, not the one-prefix one). Returns (kv_indptr, kv_indices, last, pool pages)."""
    own = rng.integers(3, 33, B) * scale
    at, reqs = prefix_tokens // ps, []
    for n in own:
        k = -(-int(n) // ps)
        reqs.append(np.concatenate([np.arange(prefix_tokens // ps), np.arange(at, at + k)]))
        at += k
    kv_indptr = np.concatenate([[0], np.cumsum([len(r) for r in reqs])]).astype(np.int32)
    return kv_indptr, np.concatenate(reqs).astype(np.int32), (own - (-(-own // ps) - 1) * ps).astype(np.int32), at


# ----------------------------------------------------------------------------- GPU cases
TOL = {"bfloat16": 2e-2, "float16": 5e-3}
REF = {"plain": Variant(), "causal": Variant(causal=True), "sliding_window": Variant(window_left=37),
       "soft_cap": Variant(logits_soft_cap=8.0), "alibi": Variant(alibi=True),
       "sigmoid": Variant(sigmoid=True, sigmoid_bias=0.25)}


def variant_params(variant, H):
    import torch
    from rtattn.plan.reference import alibi_slopes
    return {"plain": None, "causal": None, "sliding_window": {"window_left": 37}, "soft_cap": {"soft_cap": 8.0},
            "alibi": {"alibi_slopes": torch.tensor(alibi_slopes(H), dtype=torch.float32, device="cuda")},
            "sigmoid": {"sigmoid_bias": 0.25}}[variant]


def gpu_case(batch, H, Hk, D, ps, dtype="bfloat16", qo=None, seed=0):
    import torch
    kv_indptr, idx, last, pool = batch
    B = len(kv_indptr) - 1
    qo = np.arange(B + 1, dtype=np.int32) if qo is None else np.asarray(qo, np.int32)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    k, v = (torch.randn((pool, ps, Hk, D), generator=gen, device="cuda").to(tdt) for _ in range(2))
    q = torch.randn((int(qo[-1]), H, D), generator=gen, device="cuda").to(tdt)
    return SimpleNamespace(q=q, k=k, v=v, kv_indptr=kv_indptr, idx=idx, last=last, qo=qo, ps=ps, pool=pool,
                           B=B, H=H, Hk=Hk, D=D, dtype=dtype)


def reference(c, var):
    to64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
    return reference_attention(to64(c.q), to64(c.k), to64(c.v), c.qo, c.kv_indptr, c.idx, c.last, c.ps, var)


def gpu_wrapper(c, levels=2, variant="plain", **kw):
    """prefill=True unless told: every group the prefill kernel can take runs there (these small
    cases would stay on decode under the "auto" cost rule, which tests/test_cascade_plan.py checks);
    flat=False and join_levels=False (the fold) unless told; the prefill kernel the default's
    (prefill_mma="auto": wgmma on the H200)."""
    from rtattn import cascade as C
    kw.setdefault("prefill", True)
    kw.setdefault("flat", False)   # (the levels unless told: flat=True needs max_pages for every request's pages)
    kw.setdefault("join_levels", False)
    pages = max(c.pool, int(c.kv_indptr[-1])) if kw["flat"] else c.pool
    return C.CascadeWrapper(levels, c.H, c.Hk, c.D, c.ps, max_batch=c.B + 2, max_pages=pages + 2,
                            max_qo_tokens=int(c.qo[-1]) + 2, variant=variant, dtype=c.dtype, **kw)


def gpu_run(c, w, variant="plain", stream=None):
    import torch
    w.plan(c.qo, c.kv_indptr, c.idx, c.last, share_prefixes=True, stream=stream)
    out = torch.full_like(c.q, float("nan"))                       # poisoned
    lse = torch.full(tuple(c.q.shape[:2]), float("nan"), device="cuda")
    w.run(c.q, c.k, c.v, out=out, lse=lse, params=variant_params(variant, c.H), stream=stream)
    torch.cuda.synchronize()
    return out, lse


def gpu_errors(c, out, lse, var) -> tuple[float, float]:
    """(relative error of O, largest LSE error) against the float64 reference."""
    from decode_cases import lse_error, rel_error
    want_o, want_lse = reference(c, var)
    return rel_error(out.float().cpu().numpy(), want_o), lse_error(lse.cpu().numpy(), want_lse)


def check_gpu(c, out, lse, var):
    err, lerr = gpu_errors(c, out, lse, var)
    assert err < TOL[c.dtype] and lerr < 2e-2, f"O relative error {err:.2e}, LSE error {lerr:.2e}"
