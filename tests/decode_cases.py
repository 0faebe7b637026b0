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
