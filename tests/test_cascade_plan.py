"""The cascade planner on the CPU: the float64 executor runs the plan set the way the kernels
do (levels' items with level positions, then the fold) and must equal plain attention over
each request's whole page table."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rtattn.plan.cascade import CascadePlanner, execute_cascade, prefill_group, prefill_groups
from rtattn.plan.layout import indptr_from_lengths, validate_batch
from rtattn.plan.prefix_tree import prefix_union, share_prefixes
from rtattn.plan.reference import Variant, reference_attention
from rtattn.plan.tiles import select_tile

from cascade_cases import one_prefix_batch, shared_batch

VARIANTS = [Variant(), Variant(causal=True), Variant(window_left=9), Variant(alibi=True, logits_soft_cap=5.0),
            Variant(sigmoid=True, sigmoid_bias=0.3), Variant(causal=True, window_left=5, alibi=True)]


def prefill_kw(H, Hk, D, rows=32, num_ctas=3):
    """A small prefill tile (rows fused rows; the decode tile is 16 rows), so that small
    batches put their shared groups on prefill tiles, several tiles per group."""
    return dict(prefill_tile=select_tile("h200", H, Hk, D, 1024, kernel="prefill", max_rows=rows),
                prefill_ctas=num_ctas)


def h200_shared_kw(ps, batch):
    """CascadeWrapper's default shared-level arguments on the H200 at 32/8 heads, D = 128, for
    `batch` decode queries (CascadePlanner.create's prefill keywords)."""
    from rtattn.cascade import shared_level_kw
    from rtattn.plan.devices import get_device
    return shared_level_kw(get_device("h200"), 32, 8, 128, ps, batch)


def _check(kv_indptr, idx, last, pool, ps, H, Hk, D, *, qo=None, levels=2, var=Variant(), mode="auto",
           num_ctas=5, seed=0, prefill=None):
    rng = np.random.default_rng(seed)
    B = len(kv_indptr) - 1
    qo = np.arange(B + 1, dtype=np.int32) if qo is None else qo
    N = int(qo[-1])
    lv = share_prefixes(kv_indptr, idx, last, ps, qo, max_levels=levels)
    cp = CascadePlanner.create(B + 2, N + 3, max(pool, int(kv_indptr[-1])), H, Hk, D, ps, num_levels=levels,
                               num_ctas=num_ctas, mode=mode, max_rows=16 if H <= 16 * Hk else 32, **(prefill or {}))
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
@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_cascade_plan_equals_attention_over_whole_requests(var, levels, qo_len, family):
    rng = np.random.default_rng(levels * 10 + qo_len)
    kv_indptr, idx, last, pool = shared_batch(rng, 4, suffix_pages=(1, 3))
    qo = indptr_from_lengths([qo_len] * (len(kv_indptr) - 1))
    if var.causal:   # queries in the last level: suffixes of at least qo_len tokens
        last[:] = 4
    info, lv = _check(kv_indptr, idx, last, pool, 4, 8, 2, 64, qo=qo, levels=levels, var=var,
                      prefill=prefill_kw(8, 2, 64) if family == "prefill" else None)
    assert info.num_levels == len(lv) == min(levels, 3)
    if family == "prefill" and levels > 1:   # level 0: 5 requests x qo_len queries > decode's 4 (16 rows, g 4)
        assert info.level_prefill_items[0] >= 1 and info.level_prefill_items[-1] == (qo_len == 3) * 0
    else:
        assert not info.level_prefill_items.any()


def test_the_family_rule():
    """A group runs on prefill tiles when more queries share it than one decode item holds, and
    it has KV to read."""
    qo, kv = np.array([1, 8, 9, 64, 64, 3]), np.array([100, 8192, 8192, 8192, 0, 40])
    assert prefill_groups(qo, kv, 8).tolist() == [False, False, True, True, False, False]
    assert [prefill_group(int(a), int(b), 8) for a, b in zip(qo, kv)] == prefill_groups(qo, kv, 8).tolist()


def test_the_cost_rule_sends_only_long_shared_prefixes_to_prefill():
    """With the family cost rule (CascadeWrapper prefill="auto"): the 8 shapes measured on the
    H200 (docs/perf-log.md v9 F2, 32/8 heads, d128) each land on the family that measured faster:
    prefill for 64 x 32K, 16 x 32K and 64 x 8K shared tokens; decode for 64 x 4K (the tree row's
    level 0), 16 x 8K and the 1K prefixes."""
    from functools import partial
    from rtattn.families.choice import shared_group_saving_us
    saving = partial(shared_group_saving_us, 32, 8, 128)
    qo = np.array([64, 16, 64, 64, 16, 64, 16, 1])
    kv = np.array([32768, 32768, 8192, 4096, 8192, 1024, 1024, 32768])
    want = [True, True, True, False, False, False, False, False]
    assert prefill_groups(qo, kv, 8, saving).tolist() == want
    assert [prefill_group(int(a), int(b), 8, saving) for a, b in zip(qo, kv)] == want
    assert prefill_groups(qo, kv, 8).tolist() == [True] * 7 + [False]   # no rule: every eligible group


@pytest.mark.parametrize("batch,prefix,groups,want", [
    (16, 1024, (), [False]), (64, 1024, (), [True]), (16, 8192, (), [True]), (64, 8192, (), [True]),
    (16, 32768, (), [True]), (64, 32768, (), [True]),
    (64, 1024, ((8, 8192),) * 8, [False, False]), (64, 4096, ((4, 1024),) * 16, [True, False])])
def test_the_wgmma_rule_puts_the_measured_rows_on_the_faster_family(batch, prefix, groups, want):
    """CascadeWrapper's defaults on the H200 (the wgmma kernel's tile, its PREFILL_MIN_SAVING_US,
    join_levels): bench_cascade's rows -- one prefix of 1K/8K/32K x 16/64 decode requests, the
    two trees -- land each shared level on the family that measured faster in session 5's call 2
    (docs/perf-log.md "Cascade v6"): decode for p1024x16 and tree-1Kx8x8K's 1K x 64 level,
    prefill (joined where one prefix) for the rest."""
    ps, own = 16, 128
    if groups:   # a system prompt, groups with their own prompt, each request its suffix
        kv_indptr, idx, last, pool = shared_batch(np.random.default_rng(0), ps, groups=tuple(
            (n, g // ps) for n, g in groups), system_pages=prefix // ps, loners=0, suffix_pages=(own // ps,) * 2)
    else:
        kv_indptr, idx, last, pool = one_prefix_batch(batch, prefix, own, ps)
    B = len(kv_indptr) - 1
    kw = h200_shared_kw(ps, B)
    assert kw["prefill_tile"].max_rows == (64 if B <= 16 else 128)
    cp = CascadePlanner.create(B, B, pool, 32, 8, 128, ps, num_levels=3, max_rows=32, **kw)
    info = cp.plan_shared(None, kv_indptr, idx, last)
    assert (info.level_prefill_items[:-1] > 0).tolist() == want
    assert info.joined == (not groups and want[0])


def test_short_one_prefix_plans_take_the_narrow_grid():
    """The defaults on the H200 for 16 decode queries (the 64-row wgmma tile, two CTAs per SM): a
    one-prefix plan of at most NARROW_MAX_PREFIX_TOKENS runs its shared level on the narrow grid
    (one CTA per SM: CascadePlanner.prefill_narrow), a longer one on the full grid; either way
    its items and maps are those a planner with only that grid writes, over stale bytes and
    after the other grid's remembered schedules (the memo is per grid), and it computes
    attention over the whole requests."""
    from rtattn.plan.cascade import NARROW_MAX_PREFIX_TOKENS
    kw = h200_shared_kw(16, 16)
    prefixes = (8192, NARROW_MAX_PREFIX_TOKENS + 16, 8192, 4096, NARROW_MAX_PREFIX_TOKENS)
    steps = [one_prefix_batch(16, p, 128, 16, seed=p) for p in prefixes]
    pool = max(s[3] for s in steps)
    cp = CascadePlanner.create(16, 16, pool, 32, 8, 128, 16, num_levels=2, max_rows=32, **kw)
    assert (cp.prefill.num_ctas, cp.prefill_narrow.num_ctas) == (33, 16)
    buf = cp.planset.allocate()
    for prefix, (kv_indptr, idx, last, _) in zip(prefixes, steps):
        info = cp.plan_shared(None, kv_indptr, idx, last, out=buf)
        C = info.prefill.num_ctas
        assert info.joined and C == (16 if prefix <= NARROW_MAX_PREFIX_TOKENS else 33)
        one = CascadePlanner.create(16, 16, pool, 32, 8, 128, 16, num_levels=2, max_rows=32,
                                    **dict(kw, narrow_prefill=False, prefill_ctas=C))
        want = one.plan_shared(None, kv_indptr, idx, last)
        for part in ("plan", "prefill"):
            got, ref = info.views[part], want.views[part]
            n = (info.plan if part == "plan" else info.prefill).num_items
            assert np.array_equal(got["_items"][:, :n], ref["_items"][:, :n]), part
            assert np.array_equal(got["work_indptr"][:C + 1], ref["work_indptr"][:C + 1]), part
        for f in ("merge_indptr", "merge_partial_start", "merge_partial_stride", "merge_qo_row"):
            assert np.array_equal(info.views["plan"][f][:17], want.views["plan"][f][:17]), f
    small = one_prefix_batch(16, 256, 16, 16, seed=3)   # (on prefill without the cost test)
    every = CascadePlanner.create(16, 16, small[3], 32, 8, 128, 16, num_levels=2, max_rows=32,
                                  **{k: x for k, x in kw.items() if k != "prefill_saving_us"})
    info = every.plan_shared(None, *small[:3])
    assert info.prefill.num_ctas == 16 and info.joined
    _executes_as_attention(info, small, 16, 32, 8, 128, Variant(), atol=1e-9)


@pytest.mark.parametrize("batch", [12, 64])
def test_joined_plans_on_the_wgmma_tiles_run_right_in_float64(batch):
    """The default shared tile on the H200 (wgmma: 64 rows for 12 queries at 32/8, 128 past 16)
    with every shared group on it, joined: the float64 executor equals plain attention."""
    shared = one_prefix_batch(batch, 256, 16, 16, seed=batch)
    kw = h200_shared_kw(16, batch)
    kw.pop("prefill_saving_us")
    cp = CascadePlanner.create(batch, batch, shared[3], 32, 8, 128, 16, num_levels=2, max_rows=32, **kw)
    info = cp.plan_shared(None, *shared[:3])
    assert info.joined and info.prefill.tile_q == (16 if batch <= 16 else 32) and info.level_prefill_items[0] > 1
    assert info.prefill.num_ctas == 132 // 8   # (12 queries: the narrow grid of the 64-row tile; 64: its one CTA per SM)
    _executes_as_attention(info, shared, 16, 32, 8, 128, Variant(), atol=1e-9)


def test_a_shared_prefix_is_read_once_per_prefill_tile():
    """64 requests over one 8K prefix at 32/8 heads: level 0 on 128-row prefill tiles (32
    queries each: the prefix is read twice, split over the prefill grid), the suffixes on
    decode; every state row is written once and folded once."""
    kv_indptr, idx, last, pool = one_prefix_batch(64, 8192, 128, 16)
    tile = select_tile("h200", 32, 8, 128, 64, kernel="prefill")
    assert tile.tile_q == 32
    cp = CascadePlanner.create(64, 64, pool, 32, 8, 128, 16, num_levels=2, prefill_tile=tile, prefill_ctas=33)
    info = cp.plan(share_prefixes(kv_indptr, idx, last, 16))
    assert info.level_kv_tokens.tolist() == [2 * 8192, 64 * 128]
    assert info.level_prefill_items.tolist() == [info.level_items[0], 0] and info.level_items[0] > 2   # split KV
    assert info.prefill.num_items == info.level_items[0] and info.plan.num_items == info.level_items[1]
    rows = np.concatenate([np.arange(p.views["item_partial"][i], p.views["item_partial"][i] + p.views["item_qo_len"][i])
                           for p in (info.plan, info.prefill) for i in range(p.num_items)])
    assert sorted(rows.tolist()) == list(range(info.num_state_rows))            # each state row written once
    assert sorted(info.views["fold_rows"][:info.num_state_rows].tolist()) == list(range(info.num_state_rows))
    # the same shape of plan, small enough for the float64 executor: 8/2 heads, a 1K prefix
    kv_indptr, idx, last, pool = one_prefix_batch(64, 1024, 40, 16, seed=4)
    info, _ = _check(kv_indptr, idx, last, pool, 16, 8, 2, 64,
                     prefill=dict(prefill_tile=select_tile("h200", 8, 2, 64, 64, kernel="prefill"), prefill_ctas=7))
    assert info.prefill.tile_q == 32 and info.level_prefill_items[0] > 2


def _same_info(a, b):
    """Every CascadeInfo field but the views, the buffer and the union equal."""
    assert (a.num_levels, a.num_qo_tokens, a.num_state_rows, a.num_pages) == \
        (b.num_levels, b.num_qo_tokens, b.num_state_rows, b.num_pages)
    assert a.level_of.tolist() == b.level_of.tolist() and (a.prefill is None) == (b.prefill is None)
    for x, y in zip(a._parts(), b._parts()):
        keys = ("num_items", "num_merge_rows", "num_partial_rows", "batch", "num_qo_tokens", "num_ctas", "tile_q",
                "page_size", "chunk_tokens", "num_split_tiles", "mode")
        assert [getattr(x, k) for k in keys] == [getattr(y, k) for k in keys]
        assert x.cta_loads.tolist() == y.cta_loads.tolist()
    for k in ("level_items", "level_kv_tokens", "level_prefill_items"):
        assert getattr(a, k).tolist() == getattr(b, k).tolist()


@pytest.mark.parametrize("mode", ["auto", "balanced", "contiguous", "naive", "batch-invariant"])
@pytest.mark.parametrize("shape", [(64, 512, 8, 16), (9, 600, 3, 1), (40, 9, 2, 64), (33, 7, 5, 4), (100, 3, 1, 16),
                                   (3, 20, 2, 16)])
@pytest.mark.parametrize("family", ["prefill", "decode", "no-prefill"])
def test_the_one_prefix_path_writes_the_general_plan(mode, shape, family):
    """plan_shared's path for one prefix under decode requests (no union arrays, the fold map in
    closed form) writes byte for byte the plan set of the general path, over suffixes of equal
    and unequal lengths (split or not), and the float64 executor runs it to plain attention --
    with the prefix on prefill tiles, on decode where the family rule keeps it there (a rule
    predicting no saving; fewer requests than a decode tile holds) and with no prefill family."""
    B, prefix_pages, suffix_pages, ps = shape
    kv_indptr, idx, last, pool = one_prefix_batch(B, prefix_pages * ps, suffix_pages * ps, ps, seed=B)
    last = np.random.default_rng(B).integers(1, ps + 1, B).astype(np.int32)   # unequal suffixes
    prefill = {} if family == "no-prefill" else prefill_kw(8, 2, 64, rows=64, num_ctas=4)
    if family == "decode":
        prefill["prefill_saving_us"] = lambda qo, kv: 0.0
    cp = CascadePlanner.create(B, B, pool, 8, 2, 64, ps, num_levels=3, mode=mode, num_ctas=5, max_rows=16, **prefill)
    on_prefill = family == "prefill" and B > cp.planner.tile_q
    for lp in (last, np.full(B, ps, np.int32)):
        fast, full = cp.planset.allocate(), cp.planset.allocate()
        fast[:] = full[:] = 0xAB   # the same stale bytes under both
        info = cp.plan_shared(None, kv_indptr, idx, lp, out=fast)
        assert info.union is None and (info.prefill is None) == (family == "no-prefill")   # the one-prefix path
        assert (info.level_prefill_items[0] > 0) == on_prefill and info.level_prefill_items[1] == 0
        ref = cp.plan_union(prefix_union(validate_batch(None, kv_indptr, idx, lp, ps), 3), full)
        assert bytes(fast) == bytes(full)
        _same_info(info, ref)
    if B * prefix_pages * ps <= 64 * 600:
        q = np.random.default_rng(1).standard_normal((B, 8, 64))
        k, v = np.random.default_rng(2).standard_normal((2, pool, ps, 2, 64))
        O, S = execute_cascade(info, q, k, v)
        Or, Sr = reference_attention(q, k, v, np.arange(B + 1), kv_indptr, idx, lp, ps)
        np.testing.assert_allclose(O, Or, atol=1e-12)
        np.testing.assert_allclose(S, Sr, atol=1e-12)


@pytest.mark.parametrize("qo_len", [6, 40])
def test_every_group_on_prefill_and_groups_without_kv(qo_len):
    """One level (the requests themselves) of long query runs: no decode items at all; and a
    level-0 group that holds no KV (requests without a shared prefix) stays on decode."""
    rng = np.random.default_rng(qo_len)
    kv_indptr, idx, last, pool = shared_batch(rng, 4, groups=((3, 2),), system_pages=0, loners=3, suffix_pages=(4, 6))
    B = len(kv_indptr) - 1
    qo = indptr_from_lengths([qo_len] * B)
    info, _ = _check(kv_indptr, idx, last, pool, 4, 8, 2, 64, qo=qo, levels=1, prefill=prefill_kw(8, 2, 64))
    assert info.plan.num_items == 0 and info.prefill.num_items >= B
    info, lv = _check(kv_indptr, idx, last, pool, 4, 8, 2, 64, qo=qo, levels=2, prefill=prefill_kw(8, 2, 64))
    assert lv[0].kv_indptr.tolist() == [0, 2, 2]          # the shared group, then the loners' empty one
    assert info.level_prefill_items[0] >= 1 and info.plan.num_items >= 1


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 2), (32, 1)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["balanced", "contiguous", "naive", "batch-invariant"])
@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_shapes_and_modes(heads, page_size, mode, family):
    kv_indptr, idx, last, pool = one_prefix_batch(9, 70 * page_size // 4, 3 * page_size, page_size, seed=2)
    pk = prefill_kw(*heads, 64, rows=128) if family == "prefill" else None
    info, _ = _check(kv_indptr, idx, last, pool, page_size, *heads, 64, mode=mode, num_ctas=6, var=Variant(alibi=True),
                     prefill=pk)
    parts = [p for p in (info.plan, info.prefill) if p is not None]
    assert info.level_items[0] >= 1
    assert info.num_state_rows == sum(int(p.views["item_qo_len"][:p.num_items].sum()) for p in parts)
    assert bool(info.level_prefill_items[0]) == (family == "prefill" and 9 > info.plan.tile_q)


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
    Hk = data.draw(st.sampled_from([1, 2, 8]))
    prefill = prefill_kw(8, Hk, 64, rows=data.draw(st.sampled_from([32, 64])), num_ctas=data.draw(st.integers(1, 5)))
    _check(*batch, ps, 8, Hk, 64, qo=indptr_from_lengths([qo_len] * B),
           levels=data.draw(st.integers(1, 4)), var=var, mode=data.draw(st.sampled_from(["auto", "balanced", "naive"])),
           num_ctas=data.draw(st.integers(1, 7)), prefill=prefill if data.draw(st.booleans()) else None)


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


# ------------------------------------------------------------------ the flat plan
def _executes_as_attention(info, batch, ps, H, Hk, D, var, atol=1e-12):
    """The float64 executor runs `info` (decode queries of `batch`) on fresh random data as the
    kernels would: plain attention over each request's whole page table."""
    kv_indptr, idx, last, pool = batch
    B = len(kv_indptr) - 1
    rng = np.random.default_rng(ps + B)
    q = rng.standard_normal((B, H, D))
    k, v = rng.standard_normal((2, pool, ps, Hk, D))
    O, S = execute_cascade(info, q, k, v, var)
    Or, Sr = reference_attention(q, k, v, np.arange(B + 1), kv_indptr, idx, last, ps, var)
    np.testing.assert_allclose(O, Or, atol=atol)
    np.testing.assert_allclose(S, Sr, atol=atol)


def always_flat(batch, prefix_tokens, tile_q):   # (a flat_saving_us: flat wherever it fits)
    return 1.0


@pytest.mark.parametrize("var", VARIANTS, ids=lambda v: f"c{v.causal:d}w{v.window_left}a{v.alibi:d}s{v.sigmoid:d}")
@pytest.mark.parametrize("heads, D, ps", [((8, 2), 64, 4), ((32, 8), 128, 16), ((16, 1), 64, 1), ((8, 8), 256, 64)])
def test_the_flat_plan_equals_attention_over_whole_requests(var, heads, D, ps):
    """Decode requests over one shared prefix, planned flat (each request's whole page list,
    one level, the decode family's own plan with its merges): the float64 executor gives plain
    attention, with absolute positions for causal, window and ALiBi."""
    B, H, Hk = 5, *heads   # (5 requests on 3 CTAs: balanced splits some)
    kv_indptr, idx, last, pool = one_prefix_batch(B, min(12 * ps, 200) + 3 if ps > 1 else 40, 2 * ps + 1, ps, seed=D)
    merges = []
    for mode in ("auto", "balanced", "contiguous"):
        cp = CascadePlanner.create(B, B, int(kv_indptr[-1]), H, Hk, D, ps, num_ctas=3, mode=mode,
                                   max_rows=16 if H <= 16 * Hk else 32, flat_saving_us=always_flat)
        info = cp.plan_shared(None, kv_indptr, idx, last, causal=var.causal)
        assert info.flat and info.num_levels == 1 and info.level_items.sum() == info.plan.num_items
        merges.append(info.plan.num_merge_rows)
        _executes_as_attention(info, (kv_indptr, idx, last, pool), ps, H, Hk, D, var)
    assert max(merges) > 0   # split rows (merged by the merge kernel) and written-through ones


def test_the_flat_rule_picks_flat_only_for_short_prefixes_that_fit():
    """CascadeWrapper flat="auto": flat where choice.flat_saving_us predicts a saving (p1024 x 16
    and x 64 at 32/8 heads: measured 15.4 / 38.6 us flat against 17.3 / 40.6 on the levels,
    docs/perf-log.md "Cascade v4"), levels for 8K prefixes (61.0 vs 35.0 us); never where the
    requests' pages exceed max_pages, nor where the prefix goes to prefill tiles."""
    from functools import partial
    from rtattn.families.choice import flat_saving_us
    rule = partial(flat_saving_us, 32, 8, 128)
    picks = {}
    for P, B in ((1024, 16), (1024, 64), (8192, 16), (4096, 64)):
        kv_indptr, idx, last, pool = one_prefix_batch(B, P, 128, 16)
        for max_pages in (int(kv_indptr[-1]), pool):
            cp = CascadePlanner.create(B, B, max_pages, 32, 8, 128, 16, max_rows=32, flat_saving_us=rule)
            picks[P, B, max_pages == pool] = cp.plan_shared(None, kv_indptr, idx, last).flat
    assert picks == {(1024, 16, False): True, (1024, 64, False): True, (8192, 16, False): False,
                     (4096, 64, False): False, (1024, 16, True): False, (1024, 64, True): False,
                     (8192, 16, True): False, (4096, 64, True): False}
    assert rule(16, 1024, 8) > 0 > rule(16, 8192, 8) and rule(64, 512, 8) > rule(64, 1024, 8) > 0
    # a prefix the family rule sends to prefill tiles stays on the levels, whatever the flat rule
    kv_indptr, idx, last, pool = one_prefix_batch(20, 256, 40, 16)
    cp = CascadePlanner.create(20, 20, int(kv_indptr[-1]), 32, 8, 128, 16, max_rows=32, flat_saving_us=always_flat,
                               **prefill_kw(32, 8, 128, rows=64))
    info = cp.plan_shared(None, kv_indptr, idx, last)
    assert not info.flat and info.level_prefill_items[0] > 0


# ------------------------------------------------------------------ the suffix rows' join
@pytest.mark.parametrize("var", VARIANTS, ids=lambda v: f"c{v.causal:d}w{v.window_left}a{v.alibi:d}s{v.sigmoid:d}")
@pytest.mark.parametrize("heads, D, ps, B", [((8, 2), 64, 4, 11), ((32, 8), 128, 16, 20), ((16, 1), 64, 1, 9),
                                             ((8, 8), 256, 64, 21)])
def test_joined_plans_equal_attention_over_whole_requests(var, heads, D, ps, B):
    """join_levels (CascadeWrapper join_levels=True): decode requests over one prefix on prefill
    tiles (several tiles, KV split over the grid), each suffix one decode item that writes its
    row after joining the prefix's states (the decode part's merge map: rows start + k * tile_q);
    the float64 executor runs it as the kernels do and gives plain attention."""
    H, Hk = heads
    kv_indptr, idx, last, pool = one_prefix_batch(B, min(20 * ps, 320) + 3 if ps > 1 else 70, min(2 * ps + 1, 40), ps,
                                                  seed=D + B)
    cp = CascadePlanner.create(B, B, pool, H, Hk, D, ps, num_ctas=16, max_rows=16 if H <= 16 * Hk else 32,
                               join_levels=True, **prefill_kw(H, Hk, D, rows=64 if H // Hk >= 8 else 32))
    plain = CascadePlanner.create(B, B, pool, H, Hk, D, ps, num_ctas=16, max_rows=16 if H <= 16 * Hk else 32,
                                  **prefill_kw(H, Hk, D, rows=64 if H // Hk >= 8 else 32))
    info = cp.plan_shared(None, kv_indptr, idx, last, causal=var.causal)
    ref = plain.plan_shared(None, kv_indptr, idx, last, causal=var.causal)
    assert info.joined and not ref.joined and info.level_prefill_items[0] > 1 and not info.level_prefill_items[1]
    p, d = info.prefill.views, info.plan.views
    n = info.prefill.num_items
    assert (p["item_kv_start"][:n] == ref.prefill.views["item_kv_start"][:n]).all()   # the same schedule
    assert (d["item_partial"][:B] == -1).all() and sorted(d["item_merge"][:B]) == list(range(B))
    _executes_as_attention(info, (kv_indptr, idx, last, pool), ps, H, Hk, D, var)
    # every state row the join reads is one the prefill items write, each once
    mi, st, sp = d["merge_indptr"], d["merge_partial_start"], d["merge_partial_stride"]
    read = sorted(int(st[r]) + j * int(sp[r]) for r in range(B) for j in range(int(mi[r + 1] - mi[r])))
    items = p["item_partial"][:n]
    written = sorted(int(items[i]) + j for i in range(n) for j in range(int(p["item_qo_len"][i])))
    assert read == written and len(set(read)) == len(read) and max(read) < info.num_state_rows


def test_plans_the_join_cannot_serve_keep_the_fold():
    """A prefix on decode tiles (its states are other decode CTAs'), and trees (a row's states
    from two prefill levels): the fold, as without join_levels."""
    H, Hk, D, ps = 32, 8, 128, 16
    kv_indptr, idx, last, pool = one_prefix_batch(6, 400, 40, ps)
    cp = CascadePlanner.create(40, 40, 4000, H, Hk, D, ps, num_levels=3, max_rows=32, join_levels=True,
                               **prefill_kw(H, Hk, D, rows=64))
    info = cp.plan_shared(None, kv_indptr, idx, last)
    assert not info.joined and not info.level_prefill_items.any()   # 6 queries: one decode tile
    rng = np.random.default_rng(3)
    tree = shared_batch(rng, ps, groups=((12, 3), (10, 2)), system_pages=6, loners=1)
    info = cp.plan_shared(None, *tree[:3])
    assert not info.joined and info.level_prefill_items[:2].all()


@pytest.mark.parametrize("shape, expect_join", [((9, 600, 3, 1), True), ((16, 256, 1, 16), True),
                                                ((12, 40, 3, 16), True), ((64, 512, 8, 16), False)])
def test_join_uneven_writes_the_one_prefix_paths_joined_plan(shape, expect_join):
    """join_uneven: plan_union's join of one prefix under single-query suffixes writes byte for byte
    the plan set of the one-prefix path's join over suffixes of equal page counts (which that path
    takes), and the float64 executor runs both to plain attention; without join_uneven plan_union folds."""
    B, prefix_pages, suffix_pages, ps = shape
    kv_indptr, idx, last, pool = one_prefix_batch(B, prefix_pages * ps, suffix_pages * ps, ps, seed=B)
    last = np.random.default_rng(B).integers(1, ps + 1, B).astype(np.int32)
    joins = []
    for uneven in (True, False):
        cp = CascadePlanner.create(B, B, pool, 8, 2, 64, ps, num_levels=3, num_ctas=5, max_rows=16, join_levels=True,
                                   join_uneven=uneven, **prefill_kw(8, 2, 64, rows=64, num_ctas=4))
        fast, full = cp.planset.allocate(), cp.planset.allocate()
        fast[:] = full[:] = 0xAB
        info = cp.plan_shared(None, kv_indptr, idx, last, out=fast)
        ref = cp.plan_union(prefix_union(validate_batch(None, kv_indptr, idx, last, ps), 3), full)
        assert info.union is None and ref.union is not None and ref.joined == (info.joined and uneven)
        joins.append(info.joined)
        if uneven:
            assert bytes(fast) == bytes(full)
            _same_info(info, ref)
    assert joins[0] == expect_join
    if B * prefix_pages * ps <= 64 * 600:
        q = np.random.default_rng(1).standard_normal((B, 8, 64))
        k, v = np.random.default_rng(2).standard_normal((2, pool, ps, 2, 64))
        for i in (info, ref):
            O, S = execute_cascade(i, q, k, v)
            Or, Sr = reference_attention(q, k, v, np.arange(B + 1), kv_indptr, idx, last, ps)
            np.testing.assert_allclose(O, Or, atol=1e-12)
            np.testing.assert_allclose(S, Sr, atol=1e-12)
