"""GPU test workloads for the decode path: random paged caches in torch, the float64 reference
on the same data, and an error measure. Imported by the GPU-tier tests and tools/ scripts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from rtattn.plan import reference as ref
from rtattn.plan.layout import indptr_from_lengths, paged_kv

TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


def kv_lengths(kind: str, batch: int, rng) -> np.ndarray:
    """Named length distributions users hit: const:N, uniform:A:B, heavy (lognormal, mean ~1024,
    clipped to [1, 32768]), long_short (one 32K request, the rest short), ones."""
    name, *args = kind.split(":")
    if name == "const":
        return np.full(batch, int(args[0]))
    if name == "uniform":
        return rng.integers(int(args[0]), int(args[1]) + 1, batch)
    if name == "heavy":
        return np.clip(rng.lognormal(np.log(1024) - 0.5, 1.0, batch), 1, 32768).astype(np.int64)
    if name == "long_short":
        return np.concatenate([[32768], rng.integers(1, 600, batch - 1)])
    raise ValueError(kind)


@dataclass
class DecodeCase:
    q: object
    k_cache: object
    v_cache: object
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    qo_indptr: np.ndarray
    page_size: int
    kv_layout: str
    kv_lens: np.ndarray = field(repr=False)
    k_ref: np.ndarray | None = field(default=None, repr=False)  # float64 K/V the reference uses
    v_ref: np.ndarray | None = field(default=None, repr=False)  # (fp8: codes x scales), else the caches

    def reference(self, var=ref.Variant()):
        to64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
        k = self.k_ref if self.k_ref is not None else to64(self.k_cache)
        v = self.v_ref if self.v_ref is not None else to64(self.v_cache)
        return ref.reference_attention(to64(self.q), k, v, self.qo_indptr, self.kv_indptr, self.kv_indices,
                                       self.kv_last_page_len, self.page_size, var, self.kv_layout)


def make_case(kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, *, dtype="bfloat16",
              kv_layout="NHD", qo_lens=None, seed=0, spare_pages=3) -> DecodeCase:
    import torch
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    qo_lens = np.ones_like(kv_lens) if qo_lens is None else np.asarray(qo_lens)
    kv_indptr, _, last = paged_kv(kv_lens, page_size)
    n_pages = int(kv_indptr[-1]) + spare_pages
    indices = rng.permutation(n_pages)[: int(kv_indptr[-1])].astype(np.int32)  # scattered pages
    tdt = getattr(torch, TORCH_DTYPES[dtype])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (n_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else \
        (n_pages, num_kv_heads, page_size, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(tdt)
    v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(tdt)
    q = torch.randn((int(qo_lens.sum()), num_qo_heads, head_dim), generator=gen, device="cuda",
                    dtype=torch.float32).to(tdt)
    return DecodeCase(q, k, v, kv_indptr, indices, last, indptr_from_lengths(qo_lens), page_size,
                      kv_layout, kv_lens)


def finite_fp8_codes(kv_dtype: str) -> np.ndarray:
    """Every fp8 bit pattern that is a finite number (e4m3fn: 254, e5m2: 248)."""
    c = np.arange(256, dtype=np.uint8)
    special = (c & 0x7f) == 0x7f if kv_dtype == "float8_e4m3fn" else (c & 0x7c) == 0x7c
    return c[~special]


def fp8_case(case: DecodeCase, kv_dtype: str, scales: str, seed: int = 0):
    """`case` with K and V replaced by fp8 codes drawn uniformly from every finite code
    (subnormals included) and dequantization scales: `scales` = "head" (a float32 tensor [H_kv]),
    "tensor" (a float32 tensor [1]) or "float" (a Python float). The reference runs in float64 over
    codes x scales, the values the kernel must attend over. Returns (case, k_scale, v_scale)."""
    import torch
    rng = np.random.default_rng(seed)
    shape = tuple(case.k_cache.shape)
    head_axis = 2 if case.kv_layout == "NHD" else 1
    bcast = [1] * len(shape)
    bcast[head_axis] = shape[head_axis]
    # dequantized values of O(1): e4m3 codes reach 448, e5m2 codes 57344
    base = 2.0 ** -6 if kv_dtype == "float8_e4m3fn" else 2.0 ** -13
    codes, made = finite_fp8_codes(kv_dtype), []
    for _ in ("k", "v"):
        bits = rng.choice(codes, size=shape)
        t = torch.from_numpy(bits).cuda().view(getattr(torch, kv_dtype))
        scale = (base * (0.5 + rng.random(shape[head_axis] if scales == "head" else 1))).astype(np.float32)
        deq = t.float().cpu().numpy().astype(np.float64) * scale.astype(np.float64).reshape(
            bcast if scales == "head" else [1] * len(shape))
        arg = float(scale[0]) if scales == "float" else torch.from_numpy(scale).cuda()
        made.append((t, deq, arg))
    (k, k64, ks), (v, v64, vs) = made
    return replace(case, k_cache=k, v_cache=v, k_ref=k64, v_ref=v64), ks, vs


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| over finite reference entries; NaN anywhere fails."""
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def lse_error(got: np.ndarray, want: np.ndarray) -> float:
    both_inf = np.isneginf(got) & np.isneginf(want)
    if (np.isneginf(got) != np.isneginf(want)).any() or np.isnan(got).any():
        return float("inf")
    with np.errstate(invalid="ignore"):   # -inf - -inf where both rows see nothing (dropped below)
        d = np.abs(got - want)[~both_inf]
    return float(d.max()) if d.size else 0.0


def companion_runs(case, subsets, *, variant="plain", params=None, window_left=None, **wrapper_kw):
    """Request 0 of `case` planned and run among each subset of the case's requests (subset lists
    of request ids, each starting with 0), by one batch-invariant wrapper (poisoned outputs).
    Returns, per subset: (request 0's O as int16 bits, its LSE as int32 bits, its items'
    (kv_start, kv_end), the subset's O and LSE as float arrays)."""
    import torch
    from rtattn.wrapper import BatchDecodeWrapper
    T, H, D = case.q.shape
    Hk = case.k_cache.shape[2] if case.kv_layout == "NHD" else case.k_cache.shape[1]
    pages = [case.kv_indices[case.kv_indptr[b]:case.kv_indptr[b + 1]] for b in range(len(case.kv_lens))]
    w = BatchDecodeWrapper(H, Hk, D, case.page_size, max_batch=len(case.kv_lens),
                           max_pages=int(case.kv_indptr[-1]) + 1, variant=variant, kv_layout=case.kv_layout,
                           mode="batch-invariant", **wrapper_kw)
    out = []
    for subset in subsets:
        assert subset[0] == 0
        kv_indptr = np.concatenate([[0], np.cumsum([len(pages[b]) for b in subset])]).astype(np.int32)
        info = w.plan(kv_indptr, np.concatenate([pages[b] for b in subset]), case.kv_last_page_len[subset],
                      window_left=window_left)
        v, n = info.views, info.num_items
        mine = v["item_request"][:n] == 0
        items = tuple(sorted(zip(v["item_kv_start"][:n][mine].tolist(), v["item_kv_end"][:n][mine].tolist())))
        q = case.q[torch.tensor(subset, device="cuda")].contiguous()
        o = torch.full_like(q, float("nan"))
        lse = torch.full((len(subset), H), float("nan"), device="cuda")
        w.run(q, case.k_cache, case.v_cache, out=o, lse=lse, params=params)
        torch.cuda.synchronize()
        out.append((o[0].view(torch.int16).cpu().numpy(), lse[0].cpu().numpy().view(np.int32), items,
                    o.float().cpu().numpy(), lse.cpu().numpy()))
    return out, w


def variant_inputs(variant: str, num_qo_heads: int, window: int = -1):
    """(run() params, reference Variant) of a built-in variant with fixed test parameters."""
    import torch
    if variant == "soft_cap":
        return {"soft_cap": 30.0}, ref.Variant(logits_soft_cap=30.0)
    if variant == "sigmoid":
        return {"sigmoid_bias": -1.5}, ref.Variant(sigmoid=True, sigmoid_bias=-1.5)
    if "sinks" in variant:
        sinks = np.linspace(-2.0, 4.0, num_qo_heads)
        return ({"sinks": torch.tensor(sinks, dtype=torch.float32, device="cuda")},
                ref.Variant(window_left=window, sinks=sinks))
    return None, ref.Variant(window_left=window)


# Batch-invariant GPU cases (tests/test_decode.py, tools/smoke_decode.py --invariant): request 0
# is long enough to be split alone and (some of) its companions are long enough that it is not
# split among them; head groups 1-32, head dims 64-256, pages 1/16/64, the variants' final-state
# hooks (sinks, sigmoid sums, window, soft-cap), an empty request, the fused merge.
INVARIANT_CASES = {
    "plain 32/8 d128 p16": dict(kv=[3000, 17, 1024, 9000, 4096], heads=(32, 8), d=128, ps=16),
    "plain 32/32 d128 p1": dict(kv=[2000, 5, 300, 1500], heads=(32, 32), d=128, ps=1),
    "plain 32/4 d64 p16": dict(kv=[3000, 64, 65, 40000, 3000], heads=(32, 4), d=64, ps=16),
    "plain 16/1 d256 p16 (g=16)": dict(kv=[6000, 100, 80000], heads=(16, 1), d=256, ps=16),
    "plain 32/1 d128 p64 (g=32)": dict(kv=[8000, 100, 3000, 150000], heads=(32, 1), d=128, ps=64),
    "sinks 32/2 p64 (g=16, empty)": dict(kv=[9000, 30, 0, 80000], heads=(32, 2), d=128, ps=64, variant="sinks"),
    "sigmoid 32/8 p16": dict(kv=[3000, 40, 5000], heads=(32, 8), d=128, ps=16, variant="sigmoid"),
    "window 3000 + sinks 32/8 p16": dict(kv=[9000, 30, 8000], heads=(32, 8), d=128, ps=16,
                                         variant="sliding_window_sinks", window=3000),
    "soft_cap 32/8 d256 p16": dict(kv=[2500, 100, 3000], heads=(32, 8), d=256, ps=16, variant="soft_cap"),
    "plain 32/8 fused merge": dict(kv=[3000, 17, 1024, 9000], heads=(32, 8), d=128, ps=16, fused=True),
    # the neighbourhood (ids with "nbhd": gpu_all.sh's nbhd stage): groups 7 and 5, 4- and 128-token pages
    "plain 28/4 d128 p4 (g=7, nbhd)": dict(kv=[3000, 17, 1024, 9000, 4096], heads=(28, 4), d=128, ps=4),
    "soft_cap 40/8 d256 p128 (g=5, nbhd)": dict(kv=[2500, 100, 3000], heads=(40, 8), d=256, ps=128, variant="soft_cap"),
}


def check_invariant_case(c: dict, seed: int = 1) -> dict:
    """Run INVARIANT_CASES entry `c`: request 0 alone, with the short requests, with all. Returns
    the worst O / LSE error of the full batch against the float64 reference, whether request 0's
    bits agreed across the subsets, and how many different splits request 0 saw."""
    case = make_case(c["kv"], *c["heads"], c["d"], c["ps"], seed=seed)
    variant, window = c.get("variant", "plain"), c.get("window")
    params, var = variant_inputs(variant, case.q.shape[1], -1 if window is None else window)
    n = len(c["kv"])
    short = [b for b in range(1, n) if c["kv"][b] < 500]
    runs, w = companion_runs(case, [[0], [0] + short, list(range(n))], variant=variant, params=params,
                             window_left=window, fused_merge=c.get("fused", False))
    want_o, want_lse = case.reference(var)
    same = all(np.array_equal(r[0], runs[0][0]) and np.array_equal(r[1], runs[0][1]) for r in runs[1:])
    return dict(o_err=rel_error(runs[-1][3], want_o), lse_err=lse_error(runs[-1][4], want_lse), bitwise=same,
                splits=len({r[2] for r in runs}), chunk=w.planner.bounds.chunk_tokens,
                regs=w.kernels.decode.attributes()["num_regs"], ctas_per_sm=w.kernels.ctas_per_sm)
