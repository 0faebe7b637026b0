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
the batch, and float64 gives the same bits too. Those states are the kernel's unnormalized
(m, l, o) (cuda_src/state_fold.cuh: fold_weights, fold_acc, finish_state, with the sink joined
at the finish); the other plans fold normalized states with ⊕ (merge_states).
"""
from __future__ import annotations

import math

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


def unnormalized(o, lse, sigmoid: bool = False):
    """A state (O, natural-log LSE) as a batch-invariant (m, l, o): log2 reference max, weight
    sum, value sums against 2^m. One of its representations: m = the LSE in log2, l = 1 (an
    empty state: m = -inf, l = 0); sigmoid: m = 0, l = the total weight, o = O (a plain sum)."""
    lse = np.asarray(lse, np.float64)
    o = np.asarray(o, np.float64)
    if sigmoid:
        return np.zeros_like(lse), np.exp(lse), o
    m = lse / math.log(2.0)
    l = np.where(np.isfinite(lse), 1.0, 0.0)
    return m, l, o * l[..., None]


def fold_unnormalized(a, b):
    """fold_weights + fold_acc: the max, two exp2, a weighted sum (sigmoid: m = 0, a plain sum)."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = np.maximum(ma, mb)
    base = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp2(ma - base), np.exp2(mb - base)
    return m, la * wa + lb * wb, oa * wa[..., None] + ob * wb[..., None]


def finish_unnormalized(state, sinks=None, sigmoid: bool = False):
    """finish_state: a row's final (m, l, o) -> (O, LSE), each head's sink (natural-log weight,
    no value) joined once (softmax O = o / l; sigmoid O = o)."""
    m, l, o = state
    with np.errstate(divide="ignore", invalid="ignore"):
        if sigmoid:
            return o, np.where(l > 0, np.log(np.where(l > 0, l, 1.0)), -np.inf)
        sink2 = np.full_like(m, -np.inf) if sinks is None else \
            np.broadcast_to(np.asarray(sinks, np.float64) / math.log(2.0), m.shape)
        top = np.maximum(np.where(l > 0, m, -np.inf), sink2)
        top = np.where(np.isfinite(top), top, 0.0)
        s = np.where(l > 0, np.exp2(m - top), 0.0)
        total = l * s + np.exp2(sink2 - top)
        scale = np.where(total > 0, s / np.where(total > 0, total, 1.0), 0.0)
        lse = np.where(total > 0, (top + np.log2(np.where(total > 0, total, 1.0))) * math.log(2.0), -np.inf)
    return o * scale[..., None], lse


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
    runs = h["chunk_tokens"] > 0   # chunk runs: the kernel's unnormalized states
    merge = merge_sigmoid if var.sigmoid else merge_states
    sig = var.sigmoid
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
                elif runs:    # writethrough chunk run: the kernel's fold, the finish at the end
                    st = unnormalized(oc, lc, sig) if j == 0 else fold_unnormalized(st, unnormalized(oc, lc, sig))
                elif j == 0:
                    o, lse = oc, lc
                else:         # writethrough: fold the chunks in order
                    o, lse = merge(o, lse, oc, lc)
            if p < 0:
                if runs:
                    o, lse = finish_unnormalized(st, var.sinks, sig)
                elif var.sinks is not None:
                    o, lse = fold_sinks(o, lse, var.sinks)
                O[qs:qs + ql], LSE[qs:qs + ql] = o, lse
    if partials is not None:
        partials.update(o=PO, lse=PL)
    mi, mrow = views["merge_indptr"], views["merge_qo_row"]
    mpart = F.merge_partials(views, h["num_merge_rows"])
    for r in range(h["num_merge_rows"]):
        ids = mpart[int(mi[r]):int(mi[r + 1])]
        if runs:      # the kernel's merge: the same fold and finish as a writethrough run
            st = unnormalized(PO[ids[0]], PL[ids[0]], sig)
            for p in ids[1:]:
                st = fold_unnormalized(st, unnormalized(PO[p], PL[p], sig))
            O[int(mrow[r])], LSE[int(mrow[r])] = finish_unnormalized(st, var.sinks, sig)
            continue
        o, lse = PO[ids[0]], PL[ids[0]]
        for p in ids[1:]:
            o, lse = merge(o, lse, PO[p], PL[p])
        if var.sinks is not None:
            o, lse = fold_sinks(o[None], lse[None], var.sinks)
            o, lse = o[0], lse[0]
        O[int(mrow[r])], LSE[int(mrow[r])] = o, lse
    return O, LSE
