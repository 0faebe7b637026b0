"""Queue order "request" (rtattn.plan.order, Planner(queue_order="request")): valid, deterministic,
executes as attention, within its slack of LPT's balance, declined by the fast paths; the default
stays LPT."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtattn.plan import order, small, tile_table
from rtattn.plan.costs import COST_ALPHA, COST_GAMMA, QUEUE_ORDER_SLACK
from rtattn.plan.executor import execute_plan
from rtattn.plan.inspector import Planner
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.plan.reference import Variant, reference_attention
from rtattn.plan.verify import verify_plan

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _queues(info):
    v, n, C = info.views, info.num_items, info.num_ctas
    wi = v["work_indptr"][:C + 1]
    req = v["item_request"][:n]
    return [req[wi[c]:wi[c + 1]].tolist() for c in range(C)]


def _planner(qo, kv, hkv=32, group=1, ps=16, **kw):
    return Planner(len(qo), int(np.sum(qo)), int(sum(-(-k // ps) for k in kv)), hkv * group, hkv, 128, ps,
                   kernel="prefill", causal=True, max_qo_len=int(max(qo)), **kw)


def test_request_rounds_deals_every_request_across_the_queues_together():
    # 16 causal requests of 8 tiles on 8 queues (16x1024 at g = 1): queue c's k-th item is request k's,
    # but for the last round (>= 16 items: requests 14 and 15 together)
    cost = np.tile(np.arange(1, 9) * 128 + 576, 16).astype(np.int64)
    req = np.repeat(np.arange(16), 8)
    ar = np.arange(200, dtype=np.int64)
    o, cta, loads = order.request_rounds(req, cost, 8, ar)
    assert sorted(o.tolist()) == list(range(128))
    assert (loads == loads[0]).all() and loads.sum() == cost.sum()
    for c in range(8):
        q = req[o[cta == c]].tolist()
        assert q[:14] == list(range(14)) and len(q) == 16 and set(q[14:]) <= {14, 15}


def test_rounds_hold_num_ctas_items_and_the_last_two_rounds_worth():
    # 12 requests of 3 items, 4 CTAs: rounds of 2 requests (6 items), the last >= 8 items (3 requests)
    cost = np.tile([300, 200, 100], 12).astype(np.int64)
    req = np.repeat(np.arange(12), 3)
    o, _, _ = order.request_rounds(req, cost, 4, np.arange(64, dtype=np.int64))
    dealt = req[o].tolist()
    assert sorted(dealt[:6]) == [0, 0, 0, 1, 1, 1] and dealt[:2] == [0, 1]   # a round longest first
    assert sorted(set(dealt[-12:])) == [8, 9, 10, 11]   # the trailing 2 rounds merged


def test_planner_queue_order_defaults_and_checks():
    qo = kv = [1024] * 16
    assert _planner(qo, kv).queue_order == "lpt"
    with pytest.raises(ValueError, match="queue_order"):
        _planner(qo, kv, queue_order="fifo")


def test_request_order_on_16x1024_g1_runs_a_request_on_every_queue():
    qo = kv = [1024] * 16
    p = _planner(qo, kv, num_ctas=8, queue_order="request")
    info = p.plan_lengths(qo, kv)
    assert info.queue_order == "request" and info.mode == "balanced" and info.num_items == 128
    for q in _queues(info):
        assert q[:14] == list(range(14)) and len(q) == 16 and set(q[14:]) <= {14, 15}
    lpt = _planner(qo, kv, num_ctas=8).plan_lengths(qo, kv)
    assert lpt.queue_order == "lpt" and info.max_load == lpt.max_load
    assert [set(q) for q in _queues(lpt)] == [{c, c + 8} for c in range(8)]   # LPT: a request on one queue


@st.composite
def batches(draw):
    B = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    qo = np.maximum(1, np.rint(np.exp(rng.normal(np.log(draw(st.sampled_from([16, 256, 1024]))), 1.0, B))))
    qo = np.minimum(qo, 4096).astype(np.int64)
    kv = qo + (rng.integers(0, 3000, B) if draw(st.booleans()) else 0)
    return dict(qo=qo, kv=kv, group=draw(st.sampled_from([1, 4, 8, 32])), ps=draw(st.sampled_from([1, 16])),
                mode=draw(st.sampled_from(["auto", "balanced"])), window=draw(st.sampled_from([None, 300])),
                ctas=draw(st.sampled_from([None, 5, 8])))


@SETTINGS
@given(batches())
def test_request_order_plans_are_valid_deterministic_and_within_slack(b):
    qo, kv = b["qo"], b["kv"]
    hkv = max(1, 32 // b["group"])
    kw = dict(hkv=hkv, group=b["group"], ps=b["ps"], mode=b["mode"], num_ctas=b["ctas"])
    p, ref = _planner(qo, kv, queue_order="request", **kw), _planner(qo, kv, **kw)
    args = (indptr_from_lengths(qo), *paged_kv(kv, b["ps"]))
    info, lpt = p.plan(*args, window_left=b["window"]), ref.plan(*args, window_left=b["window"])
    verify_plan(info.views, qo, kv, tile_q=p.tile_q, page_size=b["ps"], causal=True, window_left=b["window"])
    again = p.plan(*args, window_left=b["window"])
    assert bytes(again.buffer) == bytes(info.buffer)
    # the same items (the partition is LPT's plan's), maybe in other queues
    n, v, w = info.num_items, info.views, lpt.views
    assert n == lpt.num_items and info.mode == lpt.mode
    cols = ("item_request", "item_qo_start", "item_kv_start", "item_kv_end", "item_partial", "item_merge")
    key = lambda views: sorted(zip(*(views[c][:n].tolist() for c in cols)))   # noqa: E731
    assert key(v) == key(w)
    cost = COST_ALPHA * v["item_qo_len"][:n].astype(np.int64) + (v["item_kv_end"][:n] - v["item_kv_start"][:n]) \
        + COST_GAMMA
    assert info.cta_loads.sum() == cost.sum()
    assert info.max_load <= QUEUE_ORDER_SLACK * lpt.max_load
    if info.queue_order == "lpt":
        assert bytes(info.buffer) == bytes(lpt.buffer)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 16]), st.sampled_from([1, 4]))
def test_request_order_plan_executes_as_attention(seed, ps, group):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 6))
    qo = rng.integers(1, 40, B)
    kv = qo + rng.integers(0, 300, B)
    Hk, D = 2, 8
    H = Hk * group
    kvp, idx, last = paged_kv(kv, ps, shuffle_seed=seed % 5)
    qi = indptr_from_lengths(qo)
    npg = max(1, int(kvp[-1]))
    kc, vc = rng.standard_normal((npg, ps, Hk, D)), rng.standard_normal((npg, ps, Hk, D))
    q = rng.standard_normal((int(qi[-1]), H, D))
    p = Planner(8, 256, npg, H, Hk, 64, ps, causal=True, num_ctas=5, min_chunk_tokens=16, kernel="prefill",
                max_qo_len=64, queue_order="request")
    info = p.plan(qi, kvp, idx, last)
    verify_plan(info.views, qo, kv, tile_q=p.tile_q, page_size=ps, causal=True)
    var = Variant(causal=True)
    O1, L1 = execute_plan(info.views, q, kc, vc, var)
    O0, L0 = reference_attention(q, kc, vc, qi, kvp, idx, last, ps, var)
    np.testing.assert_allclose(O1, O0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L1, L0, rtol=1e-12, atol=1e-12)


def test_fast_paths_decline_a_request_order_planner(monkeypatch):
    taken = []
    for mod in (tile_table, small):
        def declined(*a, _plan=mod.plan, **k):
            info = _plan(*a, **k)
            taken.append(info is not None)
            return info
        monkeypatch.setattr(mod, "plan", declined)
    for qo, kv in (([16] * 8, [500] * 8), ([300] * 8, [800] * 8), ([3, 20], [3, 900])):   # the tile table: one tile
        # each, several tiles each; the small path
        for q_order in ("lpt", "request"):
            taken.clear()
            p = _planner(qo, kv, hkv=8, group=4, queue_order=q_order)
            verify_plan(p.plan_lengths(qo, kv).views, qo, kv, tile_q=p.tile_q, page_size=16, causal=True)
            assert any(taken) == (q_order == "lpt")   # (the default path does take them)
