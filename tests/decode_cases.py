"""GPU test workloads for the decode path: random paged caches in torch, the float64 reference
on the same data, and an error measure. Imported by the GPU-tier tests and tools/ scripts."""
from __future__ import annotations

from dataclasses import dataclass, field

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

    def reference(self, var=ref.Variant()):
        to64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
        return ref.reference_attention(to64(self.q), to64(self.k_cache), to64(self.v_cache),
                                       self.qo_indptr, self.kv_indptr, self.kv_indices,
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
