"""The plain-Python small-batch path of Planner.plan (rtattn.plan.small) against the numpy path
(small_tiles=0) on fuzzed batches: the same bytes in a buffer holding the same stale contents,
the same PlanInfo, the same error for batches either path refuses."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn.plan import small
from rtattn.plan.inspector import Planner
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from plan_fuzz import plan_outcome as _plan


def _lengths(rng, batch, page_size):
    kind = rng.integers(4)
    top = 4096 if page_size > 1 else 600
    if kind == 0:     # uniform
        kv = rng.integers(0, top, batch)
    elif kind == 1:   # heavy-tailed
        kv = np.minimum(8 * top, rng.pareto(1.2, batch) * top / 8 + 1).astype(np.int64)
    elif kind == 2:   # one long request among short ones
        kv = rng.integers(1, 64, batch)
        kv[rng.integers(batch)] = 8 * top
    else:             # all equal
        kv = np.full(batch, int(rng.integers(1, top)))
    if rng.random() < 0.2:   # some requests with no KV
        kv[rng.random(batch) < 0.3] = 0
    return kv


def _case(rng):
    """(planner kwargs, plan args, plan kwargs) of one random small batch, sometimes broken."""
    ps = int(rng.choice([1, 16, 64]))
    batch = int(rng.integers(1, 40))
    kv = _lengths(rng, batch, ps)
    decode = rng.random() < 0.5
    qo = np.ones(batch, np.int64) if decode else rng.integers(0 if rng.random() < 0.2 else 1, 9, batch)
    causal = bool(rng.random() < 0.5) and not decode
    if causal:
        kv = np.maximum(kv, qo)
    kvp, idx, last = paged_kv(kv, ps, shuffle_seed=int(rng.integers(1 << 30)))
    nnz = int(kvp[-1])
    group = int(rng.choice([1, 4, 8, 16, 32]))
    pk = dict(max_batch=batch + int(rng.integers(0, 3)), max_qo_tokens=max(1, int(qo.sum())) + int(rng.integers(0, 4)),
              max_pages=max(1, nnz + int(rng.integers(0, 3))), num_qo_heads=group * (32 // group if group < 32 else 1),
              num_kv_heads=32 // group if group < 32 else 1, head_dim=int(rng.choice([64, 128, 256])), page_size=ps,
              mode=str(rng.choice(small.MODES)), causal=causal, num_ctas=int(rng.choice([3, 16, 33, 66, 132])),
              max_qo_len=max(1, int(qo.max())), num_pages_pool=max(1, nnz) + int(rng.integers(0, 5)))
    args = [None if decode and rng.random() < 0.3 else indptr_from_lengths(qo), kvp, idx, last]
    kw = {}
    if rng.random() < 0.25:
        kw["window_left"] = int(rng.integers(0, 3 * ps + 300))
    if rng.random() < 0.15:   # break one thing the quick checks must leave to validate_batch
        i = int(rng.integers(4))
        bad = rng.integers(4)
        if args[i] is not None and args[i].shape[0]:
            a = args[i].copy()
            j = int(rng.integers(a.shape[0]))
            a[j] = (-1, a[j] + 10**6, 2**31 - 1, a[j] - 1)[bad]
            args[i] = a
        elif i == 0:
            args[0] = indptr_from_lengths(qo).astype((np.int64, np.float32, str)[bad % 3])   # another dtype
    elif rng.random() < 0.05:   # other forms of an array: a list, 0-d or 2-D
        i = int(rng.integers(1, 4))
        args[i] = (args[i].tolist(), np.asarray(7, np.int32), args[i].reshape(1, -1))[int(rng.integers(3))]
    return pk, args, kw


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_path_plans_byte_identical_to_numpy_path(seed):
    rng = np.random.default_rng(seed)
    taken = 0
    for case in range(700):
        pk, args, kw = _case(rng)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles, fast.small_tokens, ref.small_tiles = 64, 10**6, 0   # every case it can take; none
        fast.tile_table_path = ref.tile_table_path = False   # (one-tile prefill batches: tests/test_tile_table_plan.py)
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for _ in range(2):   # twice: the second plan lands on the first one's bytes
            got, want = _plan(fast, args, kw, stale), _plan(ref, args, kw, stale)
            assert got[1] == want[1], (case, pk, kw)
            assert np.array_equal(got[0], want[0]), (case, pk, kw)
            stale = got[0]
        taken += small.plan(fast, *args, kw.get("window_left"), stale) is not None
    assert taken > 300   # the small path really planned most cases


def test_large_batches_and_other_modes_go_the_numpy_way(monkeypatch):
    calls = []
    monkeypatch.setattr(Planner, "_schedule", lambda self, *a, **k: calls.append(1) or _schedule(self, *a, **k))
    kvp, idx, last = paged_kv([1000] * 64, 16)
    p = Planner(64, 64, int(kvp[-1]), 32, 8, 128, 16, num_ctas=33)
    p.tile_table_path = False   # (decode batches of 4+ requests take it first: tests/test_tile_table_plan.py)
    p.small_tiles = 63
    p.plan(None, kvp, idx, last)
    assert calls == [1]
    p.small_tiles = 64
    p.plan(None, kvp, idx, last)
    assert calls == [1]
    q = Planner(64, 64, int(kvp[-1]), 32, 8, 128, 16, num_ctas=33, mode="naive")
    q.plan(None, kvp, idx, last)
    assert calls == [1, 1]


_schedule = Planner._schedule


@pytest.mark.parametrize("seed", range(2))
def test_contiguous_partition_matches_the_list_version_on_many_tiles(seed):
    """Planner._contiguous (numpy: each tile starts at its first non-empty piece's CTA) against
    small._contiguous (lists: every piece cut, empty ones dropped) on tile sets past the small
    path's size: short, empty and sub-page tiles, decode and multi-token tiles, pages 1-64."""
    rng = np.random.default_rng(seed)
    for case in range(150):
        ps, C = int(rng.choice([1, 2, 16, 64])), int(rng.choice([1, 5, 33, 66, 132]))
        T = int(rng.integers(1, 120))
        t_kv = rng.integers(0, int(rng.choice([3, 40, 500, 5000])), T).astype(np.int64)
        t_kv[rng.random(T) < 0.15] = 0
        decode = case % 2 == 0
        p = Planner(T, 16 * T, int((-(-t_kv // ps)).sum()) + 1, 32, 8, 128, ps, mode="contiguous",
                    num_ctas=C, max_qo_len=16)
        t_qlen = np.ones(T, np.int64) if decode else rng.integers(1, p.tile_q + 1, T).astype(np.int64)
        t_qs = np.concatenate([[0], np.cumsum(t_qlen)[:-1]]).astype(np.int32)
        t_req = np.arange(T, dtype=np.int64)
        got = p._contiguous(decode, t_req, t_qs, t_qlen, t_kv)
        lists = [x.tolist() for x in (t_req, t_qs, t_qlen, t_kv)]
        axis = small._cost_axis(p, small._fixed(decode, lists[2]), lists[3])
        want = small._contiguous(p, decode, axis, *lists)
        n = want["n"]
        assert got["n"] == n and got["L"] == want["L"], case
        assert got["items"][:len(want["items"])].tolist() == [list(r) for r in want["items"]], case
        assert got["counts"].tolist() == want["counts"] and got["loads"].tolist() == want["loads"], case
        for key in ("merge_rows", "partial_rows", "split_tiles"):
            assert got[key] == want[key], (case, key)
        if want["merge_rows"]:
            for key in ("m_indptr", "m_row", "m_start"):
                assert np.asarray(got[key]).tolist() == list(want[key]), (case, key)
            stride = got["m_stride"]
            assert (np.broadcast_to(stride, (want["merge_rows"],)).tolist() == list(want["m_stride"])), case


def test_layouts_reused_over_a_serving_loop_plan_the_numpy_paths_bytes(monkeypatch):
    """A batch replanned every step with KV a few tokens longer (decode steps, accepted drafts)
    reuses small.Layout while the key holds: every step the numpy path's bytes and PlanInfo, over
    the same stale buffer; layouts both reused and made anew as chunk counts and orders move."""
    rng = np.random.default_rng(7)
    used = []
    write = small.Layout.write
    monkeypatch.setattr(small.Layout, "write", lambda self, *a: used.append(1) or write(self, *a))
    made = 0
    for case in range(60):
        ps = int(rng.choice([1, 16, 64]))
        batch = int(rng.integers(1, 9))
        decode = rng.random() < 0.5
        qo = np.ones(batch, np.int64) if decode else rng.integers(1, 5, batch)
        kv = np.maximum(rng.integers(1, int(rng.choice([200, 3000])), batch), qo)
        pk = dict(max_batch=batch, max_qo_tokens=int(qo.sum()), max_pages=int((kv.max() + 400) // ps + 2) * batch,
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, mode=str(rng.choice(small.MODES)),
                  causal=not decode, num_ctas=int(rng.choice([16, 33, 66])), max_qo_len=int(qo.max()))
        fast, ref = Planner(**pk), Planner(**pk)
        fast.tile_table_path = ref.tile_table_path = False
        ref.small_tiles = 0
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for step in range(25):
            args = [None if decode else indptr_from_lengths(qo), *paged_kv(kv, ps, shuffle_seed=step)]
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, step, pk)
            assert np.array_equal(got[0], want[0]), (case, step, pk)
            stale = got[0]
            kv = kv + rng.integers(0, 6, batch) * (rng.random() < 0.9)
        made += sum(lay is not None for lay in fast._small_layouts.values())
    assert len(used) > 400 and made > 60, (len(used), made)
