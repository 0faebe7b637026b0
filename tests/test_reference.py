"""The float64 reference against a direct per-(row, head) implementation."""
import math

import numpy as np
import pytest

from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.plan.reference import (Variant, alibi_slopes, pack_custom_mask,
                                   reference_attention, rope)


def _setup(qo, kv, ps=4, H=4, Hk=2, D=8, seed=0):
    rng = np.random.default_rng(seed)
    kvp, idx, last = paged_kv(kv, ps, shuffle_seed=seed)
    npg = max(1, int(kvp[-1]))
    kc = rng.standard_normal((npg, ps, Hk, D))
    vc = rng.standard_normal((npg, ps, Hk, D))
    qi = indptr_from_lengths(qo)
    q = rng.standard_normal((int(qi[-1]), H, D))
    return q, kc, vc, qi, kvp, idx, last


def _direct(q, kc, vc, qi, kvp, idx, last, ps, var, masks=None):
    """Loops over rows and heads; contiguous K/V rebuilt per request."""
    T, H, D = q.shape
    Hk = kc.shape[2]
    O = np.zeros((T, H, D))
    L = np.full((T, H), -np.inf)
    scale = 1 / math.sqrt(D) if var.sm_scale is None else var.sm_scale
    slopes = alibi_slopes(H)
    for b in range(len(qi) - 1):
        l_q = qi[b + 1] - qi[b]
        npg = kvp[b + 1] - kvp[b]
        l_kv = 0 if npg == 0 else (npg - 1) * ps + last[b]
        pages = idx[kvp[b]:kvp[b + 1]]
        K = np.concatenate([kc[p] for p in pages])[:l_kv] if npg else np.zeros((0, Hk, D))
        V = np.concatenate([vc[p] for p in pages])[:l_kv] if npg else np.zeros((0, Hk, D))
        for i in range(l_q):
            qp = l_kv - l_q + i
            for h in range(H):
                qv = q[qi[b] + i, h]
                ks = K[:, h // (H // Hk)]
                if var.rope:
                    qv = rope(qv[None, None], np.array([qp + var.rope_offset]), var.rope_theta)[0, 0]
                    ks = rope(ks[:, None], np.arange(l_kv) + var.rope_offset, var.rope_theta)[:, 0]
                s = ks @ qv * scale
                j = np.arange(l_kv)
                if var.alibi:
                    s = s + slopes[h] * (j - qp)
                if var.logits_soft_cap:
                    s = var.logits_soft_cap * np.tanh(s / var.logits_soft_cap)
                keep = np.ones(l_kv, bool)
                if var.causal:
                    keep &= j <= qp
                if var.window_left >= 0:
                    keep &= j >= qp - var.window_left
                if masks is not None:
                    keep &= masks[b][i]
                vs = V[:, h // (H // Hk)]
                if var.sigmoid:
                    w = np.where(keep, 1 / (1 + np.exp(-(s + var.sigmoid_bias))), 0)
                    O[qi[b] + i, h] = w @ vs
                    L[qi[b] + i, h] = np.log(w.sum()) if w.sum() > 0 else -np.inf
                elif keep.any():
                    m = s[keep].max()
                    e = np.where(keep, np.exp(s - m), 0)
                    O[qi[b] + i, h] = e @ vs / e.sum()
                    L[qi[b] + i, h] = m + np.log(e.sum())
    return O, L


VARIANTS = {
    "plain": Variant(),
    "causal": Variant(causal=True),
    "window": Variant(causal=True, window_left=5),
    "softcap": Variant(logits_soft_cap=2.0, sm_scale=0.9),
    "alibi": Variant(causal=True, alibi=True),
    "sigmoid": Variant(sigmoid=True, sigmoid_bias=-0.5),
    "rope": Variant(causal=True, rope=True, rope_theta=500.0, rope_offset=3),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_matches_direct(name, layout):
    qo, kv = [1, 3, 5, 2], [9, 3, 17, 4]
    q, kc, vc, qi, kvp, idx, last = _setup(qo, kv, seed=len(name))
    var = VARIANTS[name]
    O1, L1 = _direct(q, kc, vc, qi, kvp, idx, last, 4, var)
    if layout == "HND":
        kc2, vc2 = kc.transpose(0, 2, 1, 3).copy(), vc.transpose(0, 2, 1, 3).copy()
    else:
        kc2, vc2 = kc, vc
    O2, L2 = reference_attention(q, kc2, vc2, qi, kvp, idx, last, 4, var, kv_layout=layout)
    np.testing.assert_allclose(O2, O1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L2, L1, rtol=1e-12, atol=1e-12)


def test_custom_mask_matches_direct():
    qo, kv = [2, 3], [5, 7]
    q, kc, vc, qi, kvp, idx, last = _setup(qo, kv, seed=5)
    rng = np.random.default_rng(1)
    masks = [rng.random((a, b)) < 0.5 for a, b in zip(qo, kv)]
    bits, offs = pack_custom_mask(masks)
    var = Variant(custom_mask=bits, mask_offsets=offs)
    O1, L1 = _direct(q, kc, vc, qi, kvp, idx, last, 4, Variant(), masks=masks)
    O2, L2 = reference_attention(q, kc, vc, qi, kvp, idx, last, 4, var)
    np.testing.assert_allclose(O2, O1, atol=1e-12)
    np.testing.assert_allclose(L2, L1, atol=1e-12)


def test_pack_custom_mask_is_numpy_little_packbits():
    m = np.array([[1, 0, 1], [1, 1, 0], [0, 0, 1]], bool)
    bits, offs = pack_custom_mask([m, m[:1]])
    assert offs.tolist() == [0, 2]
    assert bits[:2].tolist() == np.packbits(m.ravel(), bitorder="little").tolist()


def test_empty_kv_gives_zero_and_minus_inf():
    q, kc, vc, qi, kvp, idx, last = _setup([2, 1], [0, 3])
    O, L = reference_attention(q, kc, vc, qi, kvp, idx, last, 4)
    assert (O[:2] == 0).all() and np.isneginf(L[:2]).all()
    assert np.isfinite(L[2]).all()


def test_lse_is_natural_log():
    # one key, one query: LSE = s exactly (natural log of exp(s))
    q = np.ones((1, 1, 4))
    kc = np.full((1, 1, 1, 4), 0.5)
    vc = np.ones((1, 1, 1, 4))
    O, L = reference_attention(q, kc, vc, [0, 1], [0, 1], [0], [1], 1, Variant(sm_scale=1.0))
    assert L[0, 0] == pytest.approx(2.0)
    kc2 = np.zeros((1, 2, 1, 4))
    O, L = reference_attention(q, kc2, np.ones((1, 2, 1, 4)), [0, 1], [0, 1], [0], [2], 2)
    assert L[0, 0] == pytest.approx(math.log(2))


def test_alibi_slopes():
    assert np.allclose(alibi_slopes(8), [2 ** (-(h + 1)) for h in range(8)])
    assert np.allclose(alibi_slopes(4), [2 ** (-2 * (h + 1)) for h in range(4)])
    s = alibi_slopes(12)
    assert s.shape == (12,) and np.allclose(s[:8], alibi_slopes(8))


def test_rope_relative_position_invariance():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 1, 1, 16))
    def score(pq, pk):
        return float((rope(a, np.array([pq]), 1e4) * rope(b, np.array([pk]), 1e4)).sum())
    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-10)
    r = rope(a, np.array([5]), 1e4)
    assert np.linalg.norm(r) == pytest.approx(np.linalg.norm(a))


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_are_one_more_key_with_zero_value(window):
    """A sink is a key whose logit is sinks[h] for every row and whose value is 0: appending such a
    token to every request (visible to every row) gives the same O and LSE."""
    qo, kv, H = [1, 3, 2], [9, 6, 0], 4
    q, kc, vc, qi, kvp, idx, last = _setup(qo, kv, ps=1, H=H, Hk=2, D=8, seed=3)
    sinks = np.array([0.5, -1.0, 3.0, -np.inf])
    var = Variant(window_left=-1 if window is None else window, causal=True, sinks=sinks)
    O, L = reference_attention(q, kc, vc, qi, kvp, idx, last, 1, var)
    scale = 1 / math.sqrt(8)
    for b in range(3):
        pages = idx[kvp[b]:kvp[b + 1]]
        for i in range(qo[b]):
            row, q_pos = qi[b] + i, kv[b] - qo[b] + i
            for h in range(H):
                k, v = kc[pages, 0, h // 2], vc[pages, 0, h // 2]
                s = k @ q[row, h] * scale
                j = np.arange(kv[b])
                s = np.where((j <= q_pos) & ((window is None) | (j >= q_pos - (window or 0))), s, -np.inf)
                s = np.append(s, sinks[h])                    # the sink key
                v = np.vstack([v, np.zeros(8)]) if kv[b] else np.zeros((1, 8))
                m = s.max()
                if m == -np.inf:
                    assert (O[row, h] == 0).all() and np.isneginf(L[row, h])
                    continue
                p = np.exp(s - m)
                np.testing.assert_allclose(O[row, h], p @ v / p.sum(), atol=1e-13)
                assert L[row, h] == pytest.approx(m + math.log(p.sum()), abs=1e-13)
