"""Float64 numpy reference attention over the paged layout, for every variant.

Conventions (the kernels must match them):
* scores s = sm_scale * <q, k>  (sm_scale defaults to 1/sqrt(D)); then
  ALiBi adds slope_h * (kv_pos - q_pos); then soft-cap s = cap * tanh(s / cap).
* positions: query token i of a request with lengths (l_q, l_kv) sits at
  q_pos = l_kv - l_q + i; KV token j at kv_pos = j.
* masks: causal keeps j <= q_pos; sliding window (window_left = w >= 0) keeps
  j >= q_pos - w; a custom mask keeps bit (i, j) of the request's row-major
  [l_q, l_kv] matrix, packed like numpy.packbits(bitorder="little"), request b's
  bits starting at byte mask_offsets[b].
* softmax: LSE = log(sum_j exp(s_j)) in NATURAL log (base e), O = sum softmax * v.
  A row with no visible KV has O = 0 and LSE = -inf.
* attention sinks (gpt-oss): a per-query-head logit sinks[h] (natural-log units, compared
  with the scaled scores) joins each row's softmax denominator once, with no value:
  O = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])), LSE = log(sum_j exp(s_j) +
  exp(sinks[h])) -- the state of the row's KV plus the sink. `attend` leaves it out (partial
  states must not carry it); `fold_sinks` adds it to a row's final state.
* sigmoid (FlashSigmoid): w_j = sigmoid(s_j + sigmoid_bias) (masked: 0),
  O = sum w_j v_j, no normalization.  Its "LSE" is log(sum_j w_j) (natural;
  -inf if nothing visible): partials then merge as plain sums of O, and the
  LSE by logaddexp.  It carries no softmax meaning.
* RoPE (llama, non-interleaved): pairs (d, d + D/2) rotated by
  pos * rope_theta^(-2d/D) with pos = q_pos + rope_offset for queries and
  kv_pos + rope_offset for keys, applied before the dot product.
* ALiBi slopes: for H heads (power of two), slope_h = 2^(-8(h+1)/H); otherwise
  the usual extension (closest power of two n, then odd steps of 2^(-4/n)).
KV caches: layout "NHD" = [pages, page_size, H_kv, D], "HND" =
[pages, H_kv, page_size, D].  q: [tokens, H_qo, D].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Variant:
    causal: bool = False
    window_left: int = -1            # -1: no sliding window
    logits_soft_cap: float = 0.0     # 0: off
    alibi: bool = False
    sigmoid: bool = False
    sigmoid_bias: float = 0.0
    rope: bool = False
    rope_theta: float = 1e4
    rope_offset: int = 0
    sm_scale: float | None = None    # None: 1/sqrt(head_dim)
    custom_mask: np.ndarray | None = None    # uint8 packed bits (little bit order)
    mask_offsets: np.ndarray | None = None   # byte offset of each request's bits
    sinks: np.ndarray | None = None          # [H_qo] sink logits (natural log), None: no sinks


def alibi_slopes(num_heads: int) -> np.ndarray:
    n = 2 ** int(math.floor(math.log2(num_heads)))
    base = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    if n < num_heads:
        extra = [2.0 ** (-4.0 * (2 * h + 1) / n) for h in range(num_heads - n)]
        base += extra
    return np.array(base, dtype=np.float64)


def pack_custom_mask(masks) -> tuple[np.ndarray, np.ndarray]:
    """Pack per-request boolean [l_q, l_kv] masks; returns (bits, byte offsets)."""
    chunks, offs, pos = [], [], 0
    for m in masks:
        packed = np.packbits(np.asarray(m, dtype=bool).reshape(-1), bitorder="little")
        offs.append(pos)
        chunks.append(packed)
        pos += packed.shape[0]
    bits = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return bits, np.array(offs, dtype=np.int64)


def _mask_bits(v: Variant, b: int, l_q: int, l_kv: int, rows, cols) -> np.ndarray:
    flat = rows[:, None] * l_kv + cols[None, :]
    off = int(v.mask_offsets[b]) * 8
    idx = flat + off
    return ((v.custom_mask[idx >> 3] >> (idx & 7)) & 1).astype(bool)


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x: [n, H, D] float64, pos: [n] -> rotated copy (non-interleaved halves)."""
    D = x.shape[-1]
    half = D // 2
    inv = theta ** (-2.0 * np.arange(half, dtype=np.float64) / D)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def gather_kv(cache: np.ndarray, page_ids: np.ndarray, page_size: int, start: int, end: int,
              kv_layout: str = "NHD") -> np.ndarray:
    """Tokens [start, end) of a request whose pages are page_ids -> [n, H_kv, D]
    float64.  Token t is at page page_ids[t // page_size], slot t % page_size."""
    t = np.arange(start, end)
    pg = page_ids[t // page_size]
    slot = t % page_size
    if kv_layout == "NHD":
        out = cache[pg, slot]
    elif kv_layout == "HND":
        out = cache[pg, :, slot]
    else:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return out.astype(np.float64)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, b: int, q_rows: np.ndarray,
           l_q: int, l_kv: int, kv_start: int, var: Variant):
    """Attention state of query rows q_rows (indices within request b, q: [n, H_qo, D])
    over KV tokens kv_start .. kv_start + len(k) of that request.
    Returns (O [n, H_qo, D], LSE [n, H_qo]) float64; see module doc."""
    n, H, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    scale = var.sm_scale if var.sm_scale is not None else 1.0 / math.sqrt(D)
    q = q.astype(np.float64)
    cols = np.arange(kv_start, kv_start + k.shape[0])
    q_pos = l_kv - l_q + q_rows
    if var.rope:
        q = rope(q, q_pos + var.rope_offset, var.rope_theta)
        k = rope(k, cols + var.rope_offset, var.rope_theta)
    # [H, m, D]: query head h reads kv head h // g; batched matmuls run on BLAS
    kh = np.repeat(k.transpose(1, 0, 2), g, axis=0)
    vh = np.repeat(v.transpose(1, 0, 2), g, axis=0)
    s = (q.transpose(1, 0, 2) @ kh.transpose(0, 2, 1)) * scale   # [H, n, m]
    if var.alibi:
        s = s + alibi_slopes(H)[:, None, None] * (cols[None, :] - q_pos[:, None])[None]
    if var.logits_soft_cap > 0:
        s = var.logits_soft_cap * np.tanh(s / var.logits_soft_cap)
    keep = np.ones((n, cols.shape[0]), dtype=bool)
    if var.causal:
        keep &= cols[None, :] <= q_pos[:, None]
    if var.window_left >= 0:
        keep &= cols[None, :] >= q_pos[:, None] - var.window_left
    if var.custom_mask is not None:
        keep &= _mask_bits(var, b, l_q, l_kv, q_rows, cols)
    keep = np.broadcast_to(keep[None], s.shape)
    if var.sigmoid:
        w = np.where(keep, 1.0 / (1.0 + np.exp(-(s + var.sigmoid_bias))), 0.0)
        o = (w @ vh).transpose(1, 0, 2)
        tot = w.sum(-1).T
        with np.errstate(divide="ignore"):
            lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1.0)), -np.inf)
        return o, lse
    s = np.where(keep, s, -np.inf)
    mx = s.max(-1, initial=-np.inf)   # [H, n]
    safe = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - safe[..., None])
    z = p.sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(z > 0, safe + np.log(np.where(z > 0, z, 1.0)), -np.inf)
        o = ((p / np.where(z > 0, z, 1.0)[..., None]) @ vh).transpose(1, 0, 2)
    return o, lse.T


def fold_sinks(o: np.ndarray, lse: np.ndarray, sinks) -> tuple[np.ndarray, np.ndarray]:
    """Final states (O [n, H, D], LSE [n, H]) with each head's sink joined: the sink is a state
    of LSE sinks[h] and value 0, merged once."""
    s = np.broadcast_to(np.asarray(sinks, np.float64)[None, :], lse.shape)
    new = np.logaddexp(lse, s)
    with np.errstate(invalid="ignore"):
        keep = np.where(np.isfinite(new), np.exp(lse - new), 0.0)
    return o * keep[..., None], new


def reference_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                        kv_last_page_len, page_size: int, var: Variant = Variant(),
                        kv_layout: str = "NHD"):
    """O [tokens, H_qo, D] and LSE [tokens, H_qo] (natural log), float64."""
    from .layout import validate_batch
    bt = validate_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
    T, H, D = q.shape
    O = np.zeros((T, H, D), dtype=np.float64)
    LSE = np.full((T, H), -np.inf, dtype=np.float64)
    for b in range(bt.batch):
        qs, l_q, l_kv = int(bt.qo_indptr[b]), int(bt.qo_len[b]), int(bt.kv_len[b])
        if l_q == 0:
            continue
        pages = bt.kv_indices[bt.kv_indptr[b]:bt.kv_indptr[b + 1]]
        k = gather_kv(k_cache, pages, page_size, 0, l_kv, kv_layout)
        v = gather_kv(v_cache, pages, page_size, 0, l_kv, kv_layout)
        o, lse = attend(q[qs:qs + l_q], k, v, b=b, q_rows=np.arange(l_q), l_q=l_q, l_kv=l_kv,
                        kv_start=0, var=var)
        if var.sinks is not None:
            o, lse = fold_sinks(o, lse, var.sinks)
        O[qs:qs + l_q], LSE[qs:qs + l_q] = o, lse
    return O, LSE
