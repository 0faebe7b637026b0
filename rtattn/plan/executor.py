"""A float64 executor that runs exactly what the plan says.

It reads only the plan arrays (CTA queues, item ranges, the page table copy,
the merge map) -- not the original batch -- so it checks the plan the way the
kernels will consume it: CTA c, item i: compute (O, LSE) of the item's rows over
its KV range for every query head; writethrough items write the output, split
items write partial rows; then every merge entry folds its partial rows left to
right (ascending KV = the fixed order) with ⊕ and writes the query row. Attention sinks join
a row once, where its state is final: in a writethrough item or after its merge.

Chunk runs (plan_info chunk_tokens C > 0, batch-invariant on the decode kernel): an item's KV
is a run of C-token chunks (from its tile's first visible token: 0, or the window's page);
each chunk's state starts fresh. A writethrough item folds
them left to right; a split item writes one partial row per chunk (item_partial + j * qo_len),
which the merge folds in the same order -- so a row's fold sequence is its chunks', whatever
the batch, and float64 gives the same bits too.
"""
from __future__ import annotations

import numpy as np

from . import fields as F
from .reference import Variant, attend, fold_sinks, gather_kv


def merge_states(o_a, lse_a, o_b, lse_b):
    """Stable ⊕ of two attention states.  o: [..., D], lse: [...] (natural log).
    Both -inf (nothing visible) gives O = 0, LSE = -inf."""
    o_a, o_b = np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(lse_a, lse_b)
    safe = np.where(np.isfinite(m), m, 0.0)
    wa = np.where(np.isfinite(lse_a), np.exp(lse_a - safe), 0.0)
    wb = np.where(np.isfinite(lse_b), np.exp(lse_b - safe), 0.0)
    tot = wa + wb
    den = np.where(tot > 0, tot, 1.0)
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / den[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(tot > 0, safe + np.log(den), -np.inf)
    return o, lse


def merge_sigmoid(o_a, lse_a, o_b, lse_b):
    """FlashSigmoid partials are plain sums (LSE = log of total weight)."""
    return np.asarray(o_a) + np.asarray(o_b), np.logaddexp(lse_a, lse_b)


def plan_header(views: dict) -> dict:
    info = views["plan_info"]
    return {name: int(info[i]) for i, name in enumerate(F.PLAN_INFO_NAMES)}


def item_chunks(ks: int, ke: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """The KV ranges whose states an item computes: its chunks (chunk runs), else itself."""
    if chunk_tokens <= 0 or ke - ks <= chunk_tokens:
        return [(ks, ke)]
    return [(a, min(a + chunk_tokens, ke)) for a in range(ks, ke, chunk_tokens)]


def execute_plan(views: dict, q, k_cache, v_cache, var: Variant = Variant(),
                 kv_layout: str = "NHD", *, trace: list | None = None, q_index=None,
                 partials: dict | None = None):
    """Run the plan.  Returns (O [tokens, H_qo, D], LSE [tokens, H_qo]) float64.
    `trace`, if given, receives (cta, item) in execution order. `q_index(b, rows)` maps the
    query indices of request b to those whose standard position is the real one (cascade
    levels, cuda_src/level_positions.cuh); `partials`, if given, receives the partial rows
    as "o" and "lse"."""
    h = plan_header(views)
    T, H, D = q.shape
    ps = h["page_size"]
    O = np.full((T, H, D), np.nan)      # NaN: a row nobody writes shows up in tests
    LSE = np.full((T, H), np.nan)
    P = h["num_partial_rows"]
    PO = np.full((P, H, D), np.nan)
    PL = np.full((P, H), np.nan)
    wi = views["work_indptr"]
    rq_start, rq_len = views["req_qo_start"], views["req_qo_len"]
    rk_page, rk_len = views["req_kv_page_start"], views["req_kv_len"]
    merge = merge_sigmoid if var.sigmoid else merge_states
    for c in range(h["num_ctas"]):
        for i in range(int(wi[c]), int(wi[c + 1])):
            if trace is not None:
                trace.append((c, i))
            b = int(views["item_request"][i])
            qs, ql = int(views["item_qo_start"][i]), int(views["item_qo_len"][i])
            ks, ke = int(views["item_kv_start"][i]), int(views["item_kv_end"][i])
            l_q, l_kv = int(rq_len[b]), int(rk_len[b])
            npages = -(-l_kv // ps)
            pages = views["kv_indices"][int(rk_page[b]):int(rk_page[b]) + npages]
            k = gather_kv(k_cache, pages, ps, ks, ke, kv_layout)
            v = gather_kv(v_cache, pages, ps, ks, ke, kv_layout)
            rows = np.arange(qs, qs + ql) - int(rq_start[b])
            if q_index is not None:
                rows = q_index(b, rows)
            p = int(views["item_partial"][i])
            for j, (a, e) in enumerate(item_chunks(ks, ke, h["chunk_tokens"])):
                oc, lc = attend(q[qs:qs + ql], k[a - ks:e - ks], v[a - ks:e - ks], b=b, q_rows=rows,
                                l_q=l_q, l_kv=l_kv, kv_start=a, var=var)
                if p >= 0:    # split: one partial row per state
                    r = p + j * ql
                    PO[r:r + ql], PL[r:r + ql] = oc, lc
                elif j == 0:
                    o, lse = oc, lc
                else:         # writethrough: fold the chunks in order
                    o, lse = merge(o, lse, oc, lc)
            if p < 0:
                if var.sinks is not None:
                    o, lse = fold_sinks(o, lse, var.sinks)
                O[qs:qs + ql], LSE[qs:qs + ql] = o, lse
    if partials is not None:
        partials.update(o=PO, lse=PL)
    mi, mrow = views["merge_indptr"], views["merge_qo_row"]
    mpart = F.merge_partials(views, h["num_merge_rows"])
    for r in range(h["num_merge_rows"]):
        ids = mpart[int(mi[r]):int(mi[r + 1])]
        o, lse = PO[ids[0]], PL[ids[0]]
        for p in ids[1:]:
            o, lse = merge(o, lse, PO[p], PL[p])
        if var.sinks is not None:
            o, lse = fold_sinks(o[None], lse[None], var.sinks)
            o, lse = o[0], lse[0]
        O[int(mrow[r])], LSE[int(mrow[r])] = o, lse
    return O, LSE
