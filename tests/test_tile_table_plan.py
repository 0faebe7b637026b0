"""The tile-table path of Planner.plan (rtattn.plan.tile_table: prefill tiles as table columns) against
the numpy path (Planner.tile_table_path = False) on fuzzed batches of the modes it takes: the same
bytes in a buffer holding the same stale contents, the same PlanInfo, the same error for batches
either path refuses."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn.plan import tile_table, uniform, uniform_chunks
from rtattn.plan.costs import AUTO_IMBALANCE
from rtattn.plan.inspector import Planner
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.plan.tiles import TileConfig
from plan_fuzz import plan_outcome as _plan


def _kv(rng, batch, ps, qo):
    kind = rng.integers(5)
    top = int(rng.choice([300, 1024, 4096]))
    if kind == 0:     # uniform around a mean (bench_overhead's: U(0.75, 1.25) x 1024)
        kv = rng.integers(top * 3 // 4, top * 5 // 4 + 1, batch)
    elif kind == 1:   # heavy-tailed
        kv = np.minimum(32 * top, rng.pareto(1.2, batch) * top / 4 + 1).astype(np.int64)
    elif kind == 2:   # one long request among short ones
        kv = rng.integers(1, 64, batch)
        kv[rng.integers(batch)] = 16 * top
    elif kind == 3:   # all equal
        kv = np.full(batch, int(rng.integers(1, top)))
    else:             # shorter than a page or two
        kv = rng.integers(1, 2 * ps + 2, batch)
    kv = np.maximum(kv, qo)   # (causal needs kv >= qo)
    if rng.random() < 0.05:   # a request with no pages: the numpy path's
        kv[rng.integers(batch)] = 0
    return kv


def _case(rng):
    """(planner kwargs, plan args) of one random batch of one-tile or several-tile requests,
    sometimes broken."""
    ps = int(rng.choice([1, 16, 64]))
    batch = int(rng.choice([1, 2, 7, 16, 33, 64, 65, 140, 256, 300]))
    tq = int(rng.choice([1, 2, 4, 8, 16]))
    qo = rng.integers(1, tq + 1, batch) if rng.random() < 0.7 else np.full(batch, tq)
    if rng.random() < 0.4:   # requests of several tiles (prefill, chunked prefill)
        qo = rng.integers(1, int(rng.choice([2, 3, 8])) * tq + 1, batch)
        if rng.random() < 0.3:
            qo[rng.integers(batch)] = 40 * tq   # one long prompt
    kv = _kv(rng, batch, ps, qo)
    kvp, idx, last = paged_kv(kv, ps, shuffle_seed=int(rng.integers(1 << 30)))
    nnz = int(kvp[-1])
    group = int(rng.choice([1, 4, 8]))
    tile = TileConfig(tile_q=tq, tile_kv=64, max_rows=tq * group, stages=2, threads=128, smem_bytes=0,
                      kernel="prefill")
    tokens = int(qo.sum()) + int(rng.integers(0, 4))
    pk = dict(max_batch=batch + int(rng.integers(0, 3)), max_qo_tokens=tokens,
              max_pages=max(1, nnz + int(rng.integers(0, 3))), num_qo_heads=8 * group, num_kv_heads=8,
              head_dim=128, page_size=ps, mode=str(rng.choice(tile_table.MODES)), causal=bool(rng.random() < 0.6),
              num_ctas=int(rng.choice([1, 3, 16, 33, 66, 132])), max_qo_len=min(max(tq, int(qo.max()) + int(rng.integers(0, 3))), tokens), tile=tile,
              num_pages_pool=None if rng.random() < 0.2 else max(1, nnz) + int(rng.integers(0, 5)))
    args = [indptr_from_lengths(qo), kvp, idx, last]
    if rng.random() < 0.15:   # break one thing the quick checks must leave to validate_batch
        i = int(rng.integers(4))
        a = args[i].copy()
        if a.shape[0]:
            j = int(rng.integers(a.shape[0]))
            a[j] = (-1, a[j] + 10**6, 2**31 - 1, a[j] - 1, 0)[int(rng.integers(5))]
        args[i] = a
    elif rng.random() < 0.05:   # another form of an array: a list, int64
        i = int(rng.integers(4))
        args[i] = args[i].tolist() if rng.random() < 0.5 else args[i].astype(np.int64)
    return pk, args


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tile_table_path_plans_byte_identical_to_numpy_path(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    taken = []
    orig = tile_table._write
    monkeypatch.setattr(tile_table, "_write", lambda p, v, res, *a: taken.append(res["mode"]) or orig(p, v, res, *a))
    for case in range(500):
        pk, args = _case(rng)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0   # (the small path takes the smallest batches first)
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for _ in range(2):   # twice: the second plan lands on the first one's bytes
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, pk)
            assert np.array_equal(got[0], want[0]), (case, pk)
            stale = got[0]
    # the path really planned most cases, in both of its layouts
    assert len(taken) > 400 and taken.count("contiguous") > 100 and taken.count("balanced") > 100


def test_window_batches_go_the_numpy_way_and_decode_batches_the_uniform_one(monkeypatch):
    calls = []
    monkeypatch.setattr(tile_table, "_write", lambda *a: calls.append("table"))
    monkeypatch.setattr(uniform, "write_requests", lambda *a: calls.append("uniform"))   # (its two layouts)
    kvp, idx, last = paged_kv([1000] * 64, 16)
    tile = TileConfig(tile_q=4, tile_kv=64, max_rows=16, stages=2, threads=128, smem_bytes=0, kernel="prefill")
    p = Planner(64, 512, int(kvp[-1]), 32, 8, 128, 16, num_ctas=66, tile=tile, max_qo_len=8, causal=True)
    p.plan(indptr_from_lengths([4] * 64), kvp, idx, last, window_left=100)
    assert calls == []
    p.plan(None, kvp, idx, last)                             # decode: one query token per request
    p.plan(indptr_from_lengths([4] * 64), kvp, idx, last)
    p.plan(indptr_from_lengths([8] * 64), kvp, idx, last)   # two tiles per request
    assert calls == ["uniform", "uniform", "table"]


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_batches_plan_the_numpy_paths_bytes(seed, monkeypatch):
    """Decode batches (qo_indptr None) are one-tile batches of one query token per request: the
    tile-table and uniform paths give the numpy path's bytes, PlanInfo and errors on the decode
    kernel's planner (its tile, CTAs), malformed inputs included; most are planned there."""
    rng = np.random.default_rng(300 + seed)
    taken = []
    write = tile_table.plan
    monkeypatch.setattr(tile_table, "plan", lambda *a: (lambda r: taken.append(r is not None) or r)(write(*a)))
    for case in range(400):
        pk, args = _case(rng)
        B = len(args[1]) - 1
        args[0] = None
        pk = {k: v for k, v in pk.items() if k not in ("tile", "max_qo_len", "causal")}
        pk.update(max_qo_tokens=max(pk["max_batch"], 1), num_ctas=int(rng.choice([16, 33, 66, 132])))
        if rng.random() < 0.5:
            pk["mode"] = "auto"
        if B >= 4 and rng.random() < 0.4:   # serving-like: KV around 1K, every request with pages
            args[1:] = paged_kv(rng.integers(768, 1281, B), pk["page_size"], shuffle_seed=case)
            pk["max_pages"] = max(pk["max_pages"], int(args[1][-1]))
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for _ in range(2):
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, pk)
            assert np.array_equal(got[0], want[0]), (case, pk)
            stale = got[0]
    assert taken.count(True) > 200, taken.count(True)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_length_batches_plan_byte_identical_to_numpy_path(seed, monkeypatch):
    """Batches whose requests all have the same query length (1..tile_q: multi-token verification)
    take rtattn.plan.uniform: the numpy path's bytes, PlanInfo and errors, in each of its layouts."""
    rng = np.random.default_rng(100 + seed)
    taken = []
    write, unsplit = uniform._write, uniform._unsplit
    monkeypatch.setattr(uniform, "_write", lambda p, v, sc, con, *a: taken.append(
        "all split" if con[3].S == a[5] else "some split" if con[3].S else "none split") or write(p, v, sc, con, *a))
    monkeypatch.setattr(uniform, "_unsplit", lambda *a: (lambda r: taken.append("unsplit" if r else "back") or r)(
        unsplit(*a)))
    split = uniform_chunks.plan   # (tiles split into chunks: balanced, or auto's contiguous choice)
    monkeypatch.setattr(uniform_chunks, "plan", lambda *a: (lambda r: taken.append(
        f"split {r.mode}" if r else "split back") or r)(split(*a)))
    for case in range(400):
        pk, args = _case(rng)
        B = len(args[1]) - 1
        if B < 1:
            continue
        qu = int(rng.integers(1, pk["tile"].tile_q + 1))
        args[0] = indptr_from_lengths(np.full(B, qu))
        if rng.random() < 0.1:   # one request a token longer: not one length
            args[0] = args[0].copy()
            args[0][-1] += 1
        tokens = max(pk["max_qo_tokens"], int(args[0][-1]), qu + 1)
        pk.update(max_qo_tokens=tokens, max_qo_len=max(pk["max_qo_len"], qu + 1))
        if rng.random() < 0.5:
            pk["mode"] = "auto"
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for _ in range(2):
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, pk)
            assert np.array_equal(got[0], want[0]), (case, pk)
            stale = got[0]
    assert all(taken.count(k) > 10 for k in ("all split", "some split", "none split", "unsplit")), taken
    # (auto's contiguous choice on split chunks, mostly made before their plan: the next tests)
    assert taken.count("split balanced") > 3 and taken.count("split contiguous") > 0, taken


def test_contiguous_layouts_reused_over_a_serving_loop_plan_the_numpy_paths_bytes(monkeypatch):
    """One-length batches replanned every step with KV a few tokens longer reuse uniform.Layout
    while each tile's first CTA and piece count hold: every step the numpy path's bytes and
    PlanInfo over the same stale buffer; layouts both reused and made anew."""
    rng = np.random.default_rng(11)
    made = []
    init = uniform.Layout.__init__
    monkeypatch.setattr(uniform.Layout, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    plans = 0
    for case in range(40):
        ps = int(rng.choice([1, 16, 64]))
        batch = int(rng.choice([4, 8, 16, 33, 64]))
        tq = int(rng.choice([4, 8]))
        qu = int(rng.integers(1, tq + 1))
        kv = rng.integers(int(rng.choice([100, 768])), 1281, batch)
        tile = TileConfig(tile_q=tq, tile_kv=64, max_rows=4 * tq, stages=2, threads=128, smem_bytes=0, kernel="prefill")
        pk = dict(max_batch=batch, max_qo_tokens=qu * batch, max_pages=int((kv.max() + 200) // ps + 2) * batch,
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, tile=tile,
                  mode=str(rng.choice(["auto", "contiguous"])), causal=True, num_ctas=int(rng.choice([33, 66, 132])),
                  max_qo_len=tq)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for step in range(20):
            args = [indptr_from_lengths(np.full(batch, qu)), *paged_kv(kv, ps, shuffle_seed=step)]
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, step, pk)
            assert np.array_equal(got[0], want[0]), (case, step, pk)
            stale = got[0]
            plans += got[1][10] == "contiguous"
            kv = kv + rng.integers(0, 6, batch) * (rng.random() < 0.9)
    assert plans > 300 and 20 < len(made) < plans // 2, (plans, len(made))


def test_auto_weighs_contiguous_before_its_early_bound_on_short_kv():
    """Auto on short KV (the chunk bound L at min_chunk, above the mean load): uniform.plan makes
    the contiguous plan before the early bound b0 needs the largest last chunk, which it then
    takes modulo L -- not modulo the contiguous slice w (they once shared a constant)."""
    rng = np.random.default_rng(21)
    tile = TileConfig(tile_q=4, tile_kv=64, max_rows=16, stages=2, threads=128, smem_bytes=0, kernel="prefill")
    modes = []
    for case in range(500):
        ps, batch, C = int(rng.choice([1, 16])), int(rng.choice([16, 33, 64])), int(rng.choice([33, 66]))
        qu = int(rng.integers(1, 5))
        lo, hi = sorted(rng.integers(qu, int(rng.choice([200, 400])), 2))
        kv = rng.integers(lo, hi + 2, batch)
        pk = dict(max_batch=batch, max_qo_tokens=qu * batch, max_pages=int(kv.max() // ps + 2) * batch,
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, tile=tile, mode="auto",
                  causal=True, num_ctas=C, max_qo_len=4)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        args = [indptr_from_lengths(np.full(batch, qu)), *paged_kv(kv, ps, shuffle_seed=case)]
        got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
        assert got[1] == want[1], (case, pk)
        assert np.array_equal(got[0], want[0]), (case, pk)
        modes.append(got[1][10])
    assert modes.count("contiguous") > 30 and modes.count("balanced") > 30, modes


def test_few_long_requests_split_into_chunks_plan_the_numpy_paths_bytes(monkeypatch):
    """A few requests of one query length with KV long enough to split into C..2C chunks (batch 3-12,
    bench_overhead's U(0.75, 1.25) x 1024 lengths): auto's choice between the split balanced plan
    and the contiguous one is uniform's where contiguous wins (not the table path's, ~3x dearer),
    the chunk layouts are kept over a serving loop's steps, with the numpy path's bytes and PlanInfo
    every step."""
    rng = np.random.default_rng(31)
    tile = TileConfig(tile_q=4, tile_kv=64, max_rows=16, stages=2, threads=128, smem_bytes=0, kernel="prefill")
    outcomes, events = [], []
    split, pair, keep = uniform_chunks.plan, uniform._pair, uniform._keep
    monkeypatch.setattr(uniform_chunks, "plan", lambda *a: events.append("chunks' plan") or (
        lambda r: outcomes.append(r and r.mode) or r)(split(*a)))
    monkeypatch.setattr(uniform, "_pair", lambda *a: events.append("pair") or pair(*a))
    monkeypatch.setattr(uniform, "_keep", lambda *a: events.append("contiguous") or keep(*a))
    kept, queues = [], tile_table.Tiles.queues_past_round   # (LPT's queues past one round: kept, or made)
    monkeypatch.setattr(tile_table.Tiles, "queues_past_round", lambda self, extra, *a: kept.append(
        extra in self.past_round) or queues(self, extra, *a))
    balanced, bounded = tile_table._balanced, []

    def checked(p, cost, total, L, contiguous, con, span=None, bounded_=False):
        if bounded_:   # (uniform's b0 stood for _balanced's first bound: that bound is under AUTO_IMBALANCE)
            cs, C = np.sort(cost)[::-1], p.num_ctas
            assert max(cs[0], cs[C - 1] + cs[C], -(-total // C)) * C <= AUTO_IMBALANCE * total
            bounded.append(True)
        return balanced(p, cost, total, L, contiguous, con, span, bounded_)
    monkeypatch.setattr(tile_table, "_balanced", checked)
    for case in range(300):
        ps, batch, C = int(rng.choice([1, 16, 64])), int(rng.integers(3, 13)), int(rng.choice([16, 33, 66]))
        qu, top = int(rng.integers(1, 5)), int(rng.choice([512, 1024, 2048]))
        kv = rng.integers(top * 3 // 4, top * 5 // 4 + 1, batch)
        pk = dict(max_batch=batch, max_qo_tokens=qu * batch, max_pages=int(kv.max() // ps + 4) * batch,
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, tile=tile, mode="auto",
                  causal=True, num_ctas=C, max_qo_len=qu)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        for step in range(3):   # a serving loop: each step qu tokens longer, pages moved (kept chunk layouts)
            args = [indptr_from_lengths(np.full(batch, qu)), *paged_kv(kv + step * qu, ps, shuffle_seed=case + step)]
            got, want = _plan(fast, args, {}, stale), _plan(ref, args, {}, stale)
            assert got[1] == want[1], (case, step, pk)
            assert np.array_equal(got[0], want[0]), (case, step, pk)
    counts = {m: outcomes.count(m) for m in ("contiguous", "balanced")}
    assert counts["contiguous"] > 30 and counts["balanced"] > 100, counts
    # auto's early bound on the pair of chunks (uniform._pair) both taking the contiguous plan and not
    after = [b for a, b in zip(events, events[1:]) if a == "pair"]
    assert after.count("contiguous") > 30 and after.count("chunks' plan") > 30, after
    assert kept.count(True) > 30 and kept.count(False) > 30, kept
    assert len(bounded) > 30, bounded   # (tile_table._balanced's bounded=True, checked above)


def test_pair_is_the_chunks_lpt_pair():
    """uniform._pair, from a split batch's chunk counts and remainders alone, is the sum tile_table._balanced's
    first bound takes of the chunks' C-th and (C+1)-th largest costs (less 2 (L + f - k)), exactly:
    with those among the lighter last chunks, the full ones and the heavier last chunks (B >= C)."""
    rng = np.random.default_rng(41)
    where = set()
    for case in range(4000):
        C = int(rng.choice([3, 16, 33, 66]))
        B, L, f = int(rng.integers(1, 2 * C)), int(rng.choice([16, 128, 192, 1024])), int(rng.choice([68, 80, 128]))
        k = L - 1 - L // 8
        kv = rng.integers(L // 8 + 1, int(rng.choice([2, 3, 8])) * L, B)
        if rng.random() < 0.3:   # mostly one chunk each, about L long (heavier or lighter than a full one)
            kv = rng.integers(L - L // 4, L + L // 8 + 1, B)
            kv[0] = 2 * L
        nch, x = np.divmod(kv + k, L)
        n = int(nch.sum())
        if not C < n <= 2 * C or nch.max() < 2:
            continue
        cost = np.full(n, L + f)
        cost[np.cumsum(nch) - 1] = kv + f - (nch - 1) * L   # (tile_table._schedule's chunk costs)
        cs = np.sort(cost)[::-1]
        assert 2 * (L + f - k) + uniform._pair(x, k, n, B, C) == cs[C - 1] + cs[C], case
        where.add(int(np.sign(cs[C - 1] - L - f)))
    assert where == {-1, 0, 1}, where


def test_serving_loop_into_two_kept_buffers_plans_the_numpy_paths_bytes(monkeypatch):
    """A wrapper's serving loop: plans alternate between two kept buffers (the views uniform keeps
    per buffer and batch size, a layout's per buffer, LPT's rounds per item count are reused),
    the batch size and query length change now and then, KV grows every step; every plan's
    buffer the numpy path's (planning into its own two buffers of the same stale bytes)."""
    from rtattn.plan import inspector
    rng = np.random.default_rng(12)
    paths, rounds = [], []
    assign = inspector._Rounds.assign
    monkeypatch.setattr(inspector._Rounds, "assign", lambda self, *a: rounds.append(1) or assign(self, *a))
    for case in range(12):
        ps = int(rng.choice([1, 16]))
        tq, top = 4, 64
        C = int(rng.choice([33, 66]))
        tile = TileConfig(tile_q=tq, tile_kv=64, max_rows=16, stages=2, threads=128, smem_bytes=0, kernel="prefill")
        kv = rng.integers(768, 1281, top)
        pk = dict(max_batch=top, max_qo_tokens=tq * top, max_pages=int((kv.max() + 400) // ps + 2) * top,
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, tile=tile,
                  mode=str(rng.choice(["auto", "auto", "balanced", "contiguous"])), causal=True, num_ctas=C,
                  max_qo_len=tq)
        fast, ref = Planner(**pk), Planner(**pk)
        fast.small_tiles = ref.small_tiles = 0
        ref.tile_table_path = False
        stale = rng.integers(0, 256, fast.layout.plan_bytes, dtype=np.uint8)
        bufs = {p: [stale.copy(), stale.copy()] for p in (fast, ref)}
        B, qu = int(rng.choice([16, 40, 64])), int(rng.integers(1, tq + 1))
        for step in range(30):
            if rng.random() < 0.15:   # requests join or leave; another draft length
                B, qu = int(rng.choice([8, 16, 40, 64])), int(rng.integers(1, tq + 1))
            args = [indptr_from_lengths(np.full(B, qu)), *paged_kv(kv[:B], ps, shuffle_seed=step)]
            got, want = (p.plan(*args, out=bufs[p][step & 1]) for p in (fast, ref))
            assert np.array_equal(bufs[fast][step & 1], bufs[ref][step & 1]), (case, step, pk)
            assert (got.num_items, got.mode, got.chunk_tokens, got.cta_loads.tolist()) == \
                (want.num_items, want.mode, want.chunk_tokens, want.cta_loads.tolist()), (case, step)
            paths.append(got.mode)
            kv = kv + rng.integers(1, 6, top)
    assert paths.count("contiguous") > 40 and paths.count("balanced") > 40 and len(rounds) > 40, (paths, len(rounds))
