"""Batches with shared prefixes for the cascade tests: page tables whose requests share
leading pages in a tree (a system prompt, per-prompt groups of samples, loners)."""
from __future__ import annotations

import numpy as np


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
