"""The cascade planner on the CPU: the float64 executor runs the plan set the way the kernels
do (levels' items with level positions, then the fold) and must equal plain attention over
each request's whole page table."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rtattn.plan.cascade import CascadePlanner, execute_cascade
from rtattn.plan.layout import indptr_from_lengths
from rtattn.plan.prefix_tree import share_prefixes
from rtattn.plan.reference import Variant, reference_attention

from cascade_cases import one_prefix_batch, shared_batch

VARIANTS = [Variant(), Variant(causal=True), Variant(window_left=9), Variant(alibi=True, logits_soft_cap=5.0),
            Variant(sigmoid=True, sigmoid_bias=0.3), Variant(causal=True, window_left=5, alibi=True)]


def _check(kv_indptr, idx, last, pool, ps, H, Hk, D, *, qo=None, levels=2, var=Variant(), mode="auto",
           num_ctas=5, seed=0):
    rng = np.random.default_rng(seed)
    B = len(kv_indptr) - 1
    qo = np.arange(B + 1, dtype=np.int32) if qo is None else qo
    N = int(qo[-1])
    lv = share_prefixes(kv_indptr, idx, last, ps, qo, max_levels=levels)
    cp = CascadePlanner.create(B + 2, N + 3, max(pool, int(kv_indptr[-1])), H, Hk, D, ps, num_levels=levels, num_ctas=num_ctas, mode=mode)
    info = cp.plan(lv, causal=var.causal)
    q = rng.standard_normal((N, H, D))
    k, v = rng.standard_normal((2, pool, ps, Hk, D))
    O, S = execute_cascade(info, q, k, v, var)
    Or, Sr = reference_attention(q, k, v, qo, kv_indptr, idx, last, ps, var)
    np.testing.assert_allclose(O, Or, atol=1e-12)
    np.testing.assert_allclose(S, Sr, atol=1e-12)
    return info, lv


@pytest.mark.parametrize("var", VARIANTS, ids=lambda v: f"c{v.causal:d}w{v.window_left}a{v.alibi:d}s{v.sigmoid:d}")
@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("qo_len", [1, 3])
def test_cascade_plan_equals_attention_over_whole_requests(var, levels, qo_len):
    rng = np.random.default_rng(levels * 10 + qo_len)
    kv_indptr, idx, last, pool = shared_batch(rng, 4, suffix_pages=(1, 3))
    qo = indptr_from_lengths([qo_len] * (len(kv_indptr) - 1))
    if var.causal:   # queries in the last level: suffixes of at least qo_len tokens
        last[:] = 4
    info, lv = _check(kv_indptr, idx, last, pool, 4, 8, 2, 64, qo=qo, levels=levels, var=var)
    assert info.num_levels == len(lv) == min(levels, 3)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 2), (32, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["balanced", "contiguous", "naive", "batch-invariant"])
def test_shapes_and_modes(heads, page_size, mode):
    kv_indptr, idx, last, pool = one_prefix_batch(9, 70 * page_size // 4, 3 * page_size, page_size, seed=2)
    info, _ = _check(kv_indptr, idx, last, pool, page_size, *heads, 64, mode=mode, num_ctas=6, var=Variant(alibi=True))
    assert info.level_items[0] >= 1 and info.num_state_rows == sum(info.plan.views["item_qo_len"][:info.plan.num_items])


def test_a_shared_prefix_is_read_once_per_query_tile():
    kv_indptr, idx, last, pool = one_prefix_batch(64, 8192, 128, 16)
    lv = share_prefixes(kv_indptr, idx, last, 16)
    cp = CascadePlanner.create(64, 64, pool, 32, 8, 128, 16, num_levels=2, max_rows=32)
    info = cp.plan(lv)
    assert cp.planner.tile_q == 8
    assert info.level_kv_tokens.tolist() == [8 * 8192, 64 * 128]   # 8 tiles of 8 queries; one suffix each
    assert info.plan.num_qo_tokens == 64 and info.plan.views["plan_info"][1] == 0   # no merge rows: the fold
    # each query row folds the prefix's chunks and its suffix, in level order
    fi, rows = info.views["fold_indptr"], info.views["fold_rows"]
    assert fi[64] == info.num_state_rows and (np.diff(fi[:65]) >= 2).all()


def test_plans_are_deterministic_and_fit_the_plan_set():
    rng = np.random.default_rng(5)
    kv_indptr, idx, last, pool = shared_batch(rng, 16, groups=((4, 3), (3, 5)), loners=2)
    lv = share_prefixes(kv_indptr, idx, last, 16, max_levels=3)
    cp = CascadePlanner.create(12, 12, pool, 32, 8, 128, 16, num_levels=3)
    a, b = cp.planset.allocate(), cp.planset.allocate()
    cp.plan(lv, out=a)
    cp.plan(lv, out=b)
    assert a.tobytes() == b.tobytes() and a.nbytes == cp.planset.plan_bytes


def test_bounds_are_enforced():
    kv_indptr, idx, last, pool = one_prefix_batch(5, 64, 16, 16)
    lv = share_prefixes(kv_indptr, idx, last, 16)
    with pytest.raises(ValueError, match="batch 5 exceeds max_batch=4"):
        CascadePlanner.create(4, 8, pool, 8, 8, 64, 16).plan(lv)
    with pytest.raises(ValueError, match="5 query tokens exceed max_qo_tokens=4"):
        CascadePlanner.create(8, 4, pool, 8, 8, 64, 16).plan(lv)
    with pytest.raises(ValueError, match=r"the levels hold 25 pages, exceeding max_pages=24"):
        CascadePlanner.create(8, 8, 24, 8, 8, 64, 16, num_levels=1).plan(share_prefixes(kv_indptr, idx, last, 16,
                                                                                      max_levels=1))
    with pytest.raises(ValueError, match="num_levels must be"):
        CascadePlanner.create(8, 8, pool, 8, 8, 64, 16, num_levels=0)


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_random_prefix_trees_equal_plain_attention(data):
    """Random batches of nested shared prefixes (requests in prefix order), random levels,
    modes and variants: the executed cascade plan equals attention over each request."""
    ps = data.draw(st.sampled_from([1, 4, 16]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    groups = tuple((data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))) for _ in range(data.draw(st.integers(1, 3))))
    batch = shared_batch(rng, ps, groups=groups, system_pages=data.draw(st.integers(0, 4)),
                         loners=data.draw(st.integers(0, 2)), suffix_pages=(1, 3))
    var = data.draw(st.sampled_from(VARIANTS))
    qo_len = data.draw(st.integers(1, 3))
    B = len(batch[0]) - 1
    if var.causal:
        batch[2][:] = ps   # full last pages: suffixes hold >= ps >= 1 tokens
        qo_len = min(qo_len, ps)
    _check(*batch, ps, 8, data.draw(st.sampled_from([1, 2, 8])), 64, qo=indptr_from_lengths([qo_len] * B),
           levels=data.draw(st.integers(1, 4)), var=var, mode=data.draw(st.sampled_from(["auto", "balanced", "naive"])),
           num_ctas=data.draw(st.integers(1, 7)))


@pytest.mark.parametrize("mode", ["auto", "balanced", "contiguous", "naive", "batch-invariant"])
@pytest.mark.parametrize("shape", [(64, 8192 // 16, 128 // 16, 16), (16, 600, 3, 1), (9, 40, 2, 64), (33, 7, 5, 4)])
def test_planning_without_partial_rows_leaves_the_plan_unchanged(mode, shape):
    """The cascade schedules without the planner's partial rows and merge map (every item
    writes its own state rows, the fold combines them): the plan set is byte for byte the
    one planned with them."""
    B, prefix_pages, suffix_pages, ps = shape
    kv_indptr, idx, last, pool = one_prefix_batch(B, prefix_pages * ps, suffix_pages * ps, ps, seed=B)
    cp = CascadePlanner.create(B, B, pool, 32, 8, 128, ps, num_levels=3, mode=mode, num_ctas=33)
    fast, full = cp.planset.allocate(), cp.planset.allocate()
    fast[:], full[:] = 0, 0
    info = cp.plan_shared(None, kv_indptr, idx, last, out=fast)
    schedule = cp.planner._schedule
    cp.planner._schedule = lambda bt, window_left=None, partials=True: schedule(bt, window_left, True)
    ref = cp.plan_shared(None, kv_indptr, idx, last, out=full)
    assert bytes(fast) == bytes(full)
    assert info.plan.num_items == ref.plan.num_items and info.plan.num_split_tiles == ref.plan.num_split_tiles
