"""Planner properties over random workloads (host only)."""
import json
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtattn.plan import fields as F
from rtattn.plan.inspector import AUTO_IMBALANCE, COST_ALPHA, COST_BETA, COST_GAMMA, Planner, invariant_chunk
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.plan.verify import verify_plan

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def workloads(draw):
    batch = draw(st.integers(1, 512))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["uniform", "heavy", "one-long", "const"]))
    if kind == "uniform":
        kv = rng.integers(1, 32768, batch)
    elif kind == "heavy":
        kv = np.minimum(32768, (rng.pareto(1.2, batch) * 300 + 1)).astype(np.int64)
    elif kind == "one-long":
        kv = rng.integers(1, 600, batch)
        kv[rng.integers(batch)] = 32768
    else:
        kv = np.full(batch, draw(st.integers(1, 32768)))
    qmode = draw(st.sampled_from(["decode", "mixed", "prefill"]))
    if qmode == "decode":
        qo = np.ones(batch, np.int64)
    elif qmode == "mixed":
        qo = np.where(rng.random(batch) < 0.2, rng.integers(1, 513, batch), 1)
    else:
        qo = rng.integers(1, 513, batch)
    page_size = draw(st.sampled_from([1, 16]))
    if page_size == 1:   # keep page tables modest for token-level pages
        kv = np.maximum(1, (kv * min(1.0, 2e6 / kv.sum())).astype(np.int64))
    group = draw(st.sampled_from([1, 4, 8]))
    mode = draw(st.sampled_from(list(F.MODES)))
    causal = draw(st.booleans())
    if causal:
        kv = np.maximum(kv, qo)
    return dict(qo=qo, kv=kv, page_size=page_size, group=group, mode=mode, causal=causal,
                seed=seed)


def make(w, **kw):
    ps = w["page_size"]
    kvp, idx, last = paged_kv(w["kv"], ps, shuffle_seed=w["seed"] % 7)
    qo_indptr = indptr_from_lengths(w["qo"])
    hkv = 8 // w["group"] if w["group"] < 8 else 1
    p = Planner(max_batch=len(w["qo"]), max_qo_tokens=int(w["qo"].sum()),
                max_pages=max(1, int(kvp[-1])), num_qo_heads=hkv * w["group"],
                num_kv_heads=hkv, head_dim=128, page_size=ps, mode=w["mode"],
                causal=w["causal"], max_qo_len=int(w["qo"].max()), **kw)
    return p, (qo_indptr, kvp, idx, last)


@SETTINGS
@given(workloads())
def test_plan_covers_everything_once_and_respects_bounds(w):
    p, args = make(w)
    info = p.plan(*args)
    b = p.bounds
    assert info.num_items <= b.max_items
    assert info.num_partial_rows <= b.max_partial_rows
    assert info.num_merge_rows <= b.max_merge_rows
    verify_plan(info.views, w["qo"], w["kv"], tile_q=p.tile_q, page_size=w["page_size"],
                causal=w["causal"])
    if w["mode"] != "naive":
        v = info.views
        n = info.num_items
        cost = (COST_ALPHA * v["item_qo_len"][:n].astype(np.int64)
                + COST_BETA * (v["item_kv_end"][:n] - v["item_kv_start"][:n]) + COST_GAMMA)
        assert info.cta_loads.sum() == cost.sum()
        if w["mode"] == "contiguous":   # within a page (+ one item's fixed cost) of the slice w
            slice_w = info.chunk_tokens
            assert info.max_load <= slice_w + COST_BETA * w["page_size"] + COST_ALPHA * p.tile_q + COST_GAMMA
        else:                           # LPT: makespan <= mean load + largest item
            assert info.max_load <= cost.sum() / p.num_ctas + cost.max()


@SETTINGS
@given(workloads())
def test_deterministic_byte_identical(w):
    p, args = make(w)
    a, b = p.layout.allocate(), p.layout.allocate()
    p.plan(*args, out=a)
    p.plan(*args, out=b)
    assert a.tobytes() == b.tobytes()
    p2, _ = make(w)
    c = p2.layout.allocate()
    p2.plan(*args, out=c)
    assert a.tobytes() == c.tobytes()


def _items_of(info, r):
    v = info.views
    n = info.num_items
    sel = v["item_request"][:n] == r
    rows = v["item_qo_start"][:n][sel] - v["req_qo_start"][r]
    key = sorted(zip(rows.tolist(), v["item_qo_len"][:n][sel].tolist(),
                     v["item_kv_start"][:n][sel].tolist(), v["item_kv_end"][:n][sel].tolist()))
    return key


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 64), st.sampled_from([1, 16]))
def test_batch_invariant_request_items_independent_of_batch(seed, batch, ps):
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 20000, batch)
    qo = np.where(rng.random(batch) < 0.3, rng.integers(1, 40, batch), 1)
    p = Planner(128, 4096, 64 * 20000 // ps, 32, 8, 128, ps, mode="batch-invariant", chunk_tokens=1024,
                max_qo_len=64, chunk_runs=False)   # fixed chunks: one item each (cascade levels)
    info1 = p.plan_lengths(qo, kv)
    # Change every other request, keep request 0.
    kv2, qo2 = kv.copy(), qo.copy()
    kv2[1:] = rng.integers(1, 20000, batch - 1)
    qo2[1:] = 1
    info2 = p.plan_lengths(qo2, kv2)
    assert _items_of(info1, 0) == _items_of(info2, 0)
    # Merge order of request 0's rows: the KV starts of the partial rows in order.
    def merge_kv(info):
        v = info.views
        n = info.num_items
        kvs = {}
        for i in range(n):
            pr = int(v["item_partial"][i])
            if pr >= 0:
                for t in range(int(v["item_qo_len"][i])):
                    kvs[pr + t] = int(v["item_kv_start"][i])
        out = []
        flat = F.merge_partials(v, info.num_merge_rows)
        for r in range(info.num_merge_rows):
            row = int(v["merge_qo_row"][r])
            if row < qo[0]:
                ids = flat[v["merge_indptr"][r]:v["merge_indptr"][r + 1]]
                out.append((row, [kvs[int(x)] for x in ids]))
        return out
    assert merge_kv(info1) == merge_kv(info2)


@pytest.mark.parametrize("hkv, chunk", [(32, 2048), (8, 512), (4, 256), (2, 128), (1, 128)])
def test_batch_invariant_chunk_comes_from_the_grid_not_the_batch(hkv, chunk):
    """Fixed chunks (no chunk runs), H200, 32 query heads, d128: 264 resident CTAs over the KV
    heads; the chunk is the balanced chunk of 16 x 1024 tokens on that grid (a power of two, at
    least 128), whatever the batch."""
    p = Planner(256, 256, 65536, 32, hkv, 128, 16, mode="batch-invariant", max_qo_len=1, chunk_runs=False)
    assert p.num_ctas == 264 // hkv and p.bounds.chunk_tokens == chunk == invariant_chunk(p.num_ctas, 16)
    for kv in ([5], [1024] * 16, [40000] + [7] * 200):
        info = p.plan_lengths(np.ones(len(kv), int), kv)
        assert info.chunk_tokens == chunk
        n = info.num_items
        starts = info.views["item_kv_start"][:n]
        assert (starts % chunk == 0).all() and (info.views["item_kv_end"][:n] - starts <= chunk).all()
    assert invariant_chunk(5, 16) == 4096 and invariant_chunk(264, 48) == 144   # page multiple


def _heavy16(seed):
    """16 heavy-tailed lengths with mean 1024 (lognormal, as the decode benchmark's rows)."""
    x = np.random.default_rng(seed).lognormal(0.0, 1.2, 16)
    return np.maximum(1, np.rint(x * (16 * 1024 / x.sum()))).astype(np.int64)


@pytest.mark.parametrize("hkv", [8, 4])
@pytest.mark.parametrize("seed", range(6))
def test_batch_invariant_costs_small_skewed_batches_no_tail(hkv, seed):
    """On 16-request batches (uniform, heavy-tailed) the invariant plan's slowest CTA is within
    one chunk's fixed cost of balanced mode's: invariance costs them no tail."""
    for kv in (np.full(16, 1024), _heavy16(seed)):
        loads = {}
        for mode in ("balanced", "batch-invariant"):
            p = Planner(16, 16, 4096, 32, hkv, 128, 16, mode=mode, max_qo_len=1)
            loads[mode] = p.plan_lengths(np.ones(16, int), kv).max_load
        assert loads["batch-invariant"] <= loads["balanced"] + COST_ALPHA + COST_GAMMA, (kv, loads)


def fold_sequence(info, row: int) -> list[tuple[int, int]]:
    """The KV ranges whose states query row `row` folds, in fold order: a writethrough item's
    chunks, or its merge entry's partial rows (one per chunk of its split items)."""
    from rtattn.plan.executor import item_chunks
    v, n = info.views, info.num_items
    ct = int(v["plan_info"][F.INFO_CHUNK_TOKENS])
    of_row, state_kv = [], {}
    for i in range(n):
        qs, ql = int(v["item_qo_start"][i]), int(v["item_qo_len"][i])
        if not qs <= row < qs + ql:
            continue
        chunks = item_chunks(int(v["item_kv_start"][i]), int(v["item_kv_end"][i]), ct)
        p = int(v["item_partial"][i])
        if p < 0:
            of_row.append(chunks)
        for j, c in enumerate(chunks):
            state_kv[p + j * ql + row - qs] = c
    if of_row:
        assert len(of_row) == 1
        return of_row[0]
    flat = F.merge_partials(v, info.num_merge_rows)
    r = int(np.nonzero(v["merge_qo_row"][:info.num_merge_rows] == row)[0][0])
    return [state_kv[int(x)] for x in flat[v["merge_indptr"][r]:v["merge_indptr"][r + 1]]]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 48), st.sampled_from([8, 4]), st.sampled_from([1, 16, 64]))
def test_batch_invariant_folds_a_request_the_same_chunks_with_any_companions(seed, batch, hkv, ps):
    """Chunk runs: a request's items depend on its companions (split alone, whole among long
    requests), but the sequence of chunk states its row folds -- the C-token chunks from 0, in KV
    order -- does not (the plan half of bitwise invariance; tests/test_executor.py runs it)."""
    rng = np.random.default_rng(seed)
    mine = int(rng.integers(1, 30000))
    p = Planner(64, 64, 64 * 40000 // ps, 32, hkv, 128, ps, mode="batch-invariant", max_qo_len=1)
    C = p.bounds.chunk_tokens
    want = [(a, min(a + C, mine)) for a in range(0, mine, C)]
    items = set()
    for others in ([], rng.integers(1, 300, batch), rng.integers(5000, 40000, batch)):
        kv = np.concatenate([[mine], others]).astype(np.int64)
        info = p.plan_lengths(np.ones(len(kv), int), kv)
        verify_plan(info.views, np.ones(len(kv), int), kv, tile_q=p.tile_q, page_size=ps)
        assert info.mode == "batch-invariant" and fold_sequence(info, 0) == want
        v, n = info.views, info.num_items
        sel = v["item_request"][:n] == 0
        items.add(tuple(sorted(v["item_kv_start"][:n][sel].tolist())))
    if mine > 4 * C and batch >= 16:   # alone it is split as auto splits it; among 16+ long requests not
        assert len(items) > 1


@pytest.mark.parametrize("ps, chunk", [(1, 128), (16, 128), (64, 128), (256, 256)])
def test_run_chunk_is_autos_smallest_split_on_blocks_and_pages(ps, chunk):
    """The default chunk of chunk runs: MIN_CHUNK_TOKENS (auto never splits finer) or 32 g tokens
    up to 512, a multiple of the page and of the decode kernel's 64-token KV block; the grid and
    the batch do not enter."""
    from rtattn.plan.inspector import run_chunk
    assert run_chunk(ps, 64) == chunk
    for hkv in (8, 32):   # g = 4, 1: 32 g tokens are below the 128 floor
        p = Planner(64, 64, 4096, 32, hkv, 128, ps, mode="batch-invariant", max_qo_len=1)
        assert p.chunk_runs and p.bounds.chunk_tokens == chunk
    for hkv, c in ((4, 256), (2, 512), (1, 512)):   # g = 8, 16, 32: 32 g tokens, at most 512
        p = Planner(64, 64, 4096, 32, hkv, 128, ps, mode="batch-invariant", max_qo_len=1)
        assert p.bounds.chunk_tokens == max(c, chunk)
    p = Planner(64, 64, 4096, 32, 8, 128, ps, mode="batch-invariant", max_qo_len=1, chunk_tokens=100)
    assert p.bounds.chunk_tokens == -(-100 // max(ps, 64)) * max(ps, 64)   # a given chunk: rounded up


@pytest.mark.parametrize("hkv", [8, 4, 1])
@pytest.mark.parametrize("kv", [[4096] * 256, [4096] * 64, [1000], [32768] + [512] * 63, [1024] * 16])
def test_batch_invariant_plans_like_auto(hkv, kv):
    """Chunk runs cost no extra split: batches auto does not split (64 and 256 x 4096) have no
    partial rows either, and a single ~1000-token request is split as finely as auto splits it,
    or (wide head groups, C = 32 g > 128) into chunks; every plan's slowest CTA is within one
    chunk of auto's."""
    kv = np.array(kv)
    plans = {}
    for mode in ("auto", "batch-invariant"):
        p = Planner(256, 256, 256 * 4096 // 16, 32, hkv, 128, 16, mode=mode, max_qo_len=1, num_ctas=264 // hkv)
        plans[mode] = p.plan_lengths(np.ones(len(kv), int), kv)
        verify_plan(plans[mode].views, np.ones(len(kv), int), kv, tile_q=1, page_size=16)
    a, b = plans["auto"], plans["batch-invariant"]
    if a.num_merge_rows == 0:
        assert b.num_merge_rows == 0 and b.num_items == a.num_items
    assert b.max_load <= a.max_load + b.views["plan_info"][F.INFO_CHUNK_TOKENS]
    if len(kv) == 1:
        C = int(b.views["plan_info"][F.INFO_CHUNK_TOKENS])
        assert b.num_items == min(a.num_items, -(-1000 // C)) and (b.num_items > 1) == (C < 1000)


def _textbook_lpt(cs, num_ctas):
    import heapq
    heap, want = [(0, c) for c in range(num_ctas)], []
    for x in cs.tolist():
        load, c = heapq.heappop(heap)
        want.append(c)
        heapq.heappush(heap, (load + x, c))
    return want


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.lists(st.integers(1, 60), min_size=1, max_size=400), st.integers(0, 400))
def test_lpt_deals_like_the_textbook_heap(num_ctas, costs, equal_run):
    """lpt_assign (leading equal costs dealt round robin, then the heap) == one heap over all items."""
    from rtattn.plan.inspector import lpt_assign
    cs = np.sort(np.array([60] * equal_run + costs, dtype=np.int64))[::-1].copy()
    assert lpt_assign(cs, num_ctas, np.arange(len(cs) + num_ctas, dtype=np.int64)).tolist() == _textbook_lpt(cs, num_ctas)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 80), st.integers(1, 4), st.integers(1, 6), st.data())
def test_lpt_deals_a_few_items_past_the_first_round_like_the_textbook_heap(num_ctas, extra, spread, data):
    """One to four items past the first round (a few long requests' chunks at C < n <= C + 4),
    costs in a narrow range so that loads tie: dealt one by one in numpy, as the heap deals them."""
    from rtattn.plan.inspector import lpt_assign
    costs = data.draw(st.lists(st.integers(1, spread), min_size=num_ctas + extra, max_size=num_ctas + extra))
    cs = np.sort(np.array(costs, dtype=np.int64))[::-1].copy()
    got = lpt_assign(cs, num_ctas, np.arange(len(cs) + num_ctas, dtype=np.int64)).tolist()
    assert got == _textbook_lpt(cs, num_ctas)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 80), st.integers(1, 2000), st.lists(st.integers(0, 2000), min_size=1, max_size=700),
       st.integers(0, 300))
def test_lpt_rounds_deal_like_the_textbook_heap(num_ctas, base, offsets, equal_run):
    """Costs in a band [base, 2 base] (unsplit decode items: the KV lengths of a batch), where
    lpt_assign deals whole rounds by one sort each, or the heap where the band is wider."""
    from rtattn.plan.inspector import lpt_assign
    costs = [base + o % (base + 1) for o in offsets]
    cs = np.sort(np.array([max(costs)] * equal_run + costs, dtype=np.int64))[::-1].copy()
    got = lpt_assign(cs, num_ctas, np.arange(len(cs) + num_ctas, dtype=np.int64)).tolist()
    assert got == _textbook_lpt(cs, num_ctas)


def test_balanced_beats_naive_on_skew():
    kv = np.array([32768] + [512] * 63)
    qo = np.ones(64, int)
    loads = {}
    for mode in ("balanced", "naive"):
        p = Planner(64, 64, 4096, 32, 8, 128, 16, mode=mode, max_qo_len=1)
        loads[mode] = p.plan_lengths(qo, kv).max_load
    assert loads["balanced"] * 4 < loads["naive"]


@pytest.mark.parametrize("kv, picks", [
    ([1024] * 16, "balanced"),                        # equal chunks: LPT is exact
    (list(np.linspace(512, 1024, 16).astype(int)), "contiguous"),   # 72 uneven chunks on 66 CTAs
])
def test_auto_takes_contiguous_only_past_the_imbalance_threshold(kv, picks):
    qo = np.ones(len(kv), int)
    plans = {m: Planner(16, 16, 4096, 32, 4, 128, 16, mode=m, max_qo_len=1, num_ctas=66).plan_lengths(qo, kv)
             for m in ("auto", "balanced", "contiguous")}
    bal = plans["balanced"].cta_loads
    assert (bal.max() > AUTO_IMBALANCE * bal.mean()) == (picks == "contiguous")
    assert np.array_equal(plans["auto"].cta_loads, plans[picks].cta_loads)
    assert plans["auto"].max_load <= plans["balanced"].max_load


@SETTINGS
@given(workloads())
def test_balanced_far_below_naive_on_skewed(w):
    if w["mode"] != "balanced" or w["causal"]:
        return
    kv, qo = w["kv"], w["qo"]
    p, args = make(w)
    tq = p.tile_q
    tiles = -(-qo // tq)
    work = tiles * kv
    slack = p.min_chunk + 2 * COST_GAMMA + COST_ALPHA * tq
    if kv.max() < 6 * (work.sum() / p.num_ctas + slack):
        return   # not skewed (or too small to split below the chunk floor)
    w2 = dict(w, mode="naive")
    pn, _ = make(w2)
    bal = p.plan(*args).max_load
    nai = pn.plan(*args).max_load
    assert bal * 3 < nai


def test_empty_kv_request_gets_a_writethrough_item():
    p = Planner(4, 8, 16, 8, 8, 64, 16)
    info = p.plan_lengths([1, 2, 1], [0, 40, 0])
    v = info.views
    n = info.num_items
    for r in (0, 2):
        sel = v["item_request"][:n] == r
        assert sel.sum() == 1
        assert v["item_kv_start"][:n][sel][0] == v["item_kv_end"][:n][sel][0] == 0
        assert v["item_partial"][:n][sel][0] == -1
    verify_plan(v, [1, 2, 1], [0, 40, 0], tile_q=p.tile_q, page_size=16)


def test_bound_exceeded_raises_and_writes_nothing():
    p = Planner(2, 4, 8, 8, 8, 64, 16)
    buf = p.layout.allocate()
    with pytest.raises(ValueError, match="max_batch=2"):
        p.plan_lengths([1, 1, 1], [5, 5, 5], out=buf)
    with pytest.raises(ValueError, match="max_pages=8"):
        p.plan_lengths([1, 1], [100, 100], out=buf)
    assert not buf.any()


def test_chunks_page_aligned_and_floor():
    p = Planner(16, 16, 4096, 32, 8, 128, 16, max_qo_len=1, min_chunk_tokens=100)
    assert p.min_chunk == 112
    info = p.plan_lengths([1] * 4, [5000, 10, 10, 10])
    assert info.chunk_tokens % 16 == 0 and info.chunk_tokens >= 112


def test_num_ctas_and_tile_from_device():
    p = Planner(64, 64, 4096, 32, 8, 128, 16, device="h200", max_qo_len=1)
    assert p.tile_q == 1 and p.tile.max_rows == 16
    assert p.num_ctas == 132 * p.tile.ctas_per_sm // 8
    pa = Planner(64, 64, 4096, 32, 8, 128, 16, device="a100", max_qo_len=1)
    assert pa.num_ctas == 108 * pa.tile.ctas_per_sm // 8
    assert Planner(4, 4, 4, 32, 1, 128, 16, max_qo_len=1).num_ctas >= 1


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=100), "head_dim=100 is not supported"), (dict(head_dim=0), "head_dim"),
    (dict(page_size=3), "power of two"), (dict(kernel="bogus"), "kernel must be one of"),
    (dict(num_ctas=0), "num_ctas must be >= 1"), (dict(max_batch=0), "max_batch"),
    (dict(mode="fastest"), "mode must be one of"), (dict(max_pages=1.5), "max_pages must be an int"),
])
def test_planner_refuses_bad_configuration(kw, match):
    args = dict(max_batch=8, max_qo_tokens=64, max_pages=4096, num_qo_heads=32, num_kv_heads=8,
                head_dim=128, page_size=16)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        Planner(**args)


def test_plan_info_header():
    p = Planner(8, 64, 4096, 32, 8, 128, 16)
    info = p.plan_lengths([3, 1, 7], [900, 20, 3000])
    h = info.views["plan_info"]
    assert h[F.INFO_NUM_ITEMS] == info.num_items
    assert h[F.INFO_BATCH] == 3 and h[F.INFO_TILE_Q] == p.tile_q
    assert h[F.INFO_PAGE_SIZE] == 16 and h[F.INFO_NUM_CTAS] == p.num_ctas
    assert h[F.INFO_NUM_QO_TOKENS] == 11
    assert h[F.INFO_NUM_PARTIAL_ROWS] == info.num_partial_rows
    assert h[F.INFO_NUM_MERGE_ROWS] == info.num_merge_rows


# -- rtattn-inspect ---------------------------------------------------------------

def test_cli_json_no_arguments(capsys):
    import json

    from rtattn.cli.inspect import main
    assert main(["--json", "--reps", "5"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("num_ctas", "cta_loads", "naive_max_load", "partial_slots", "workspace_bytes",
                "plan_bytes", "tile", "plan_us"):
        assert key in d
    assert len(d["cta_loads"]) == d["num_ctas"] and set(d["tile"]) >= {"q", "kv"}
    assert d["batch"] == 64 and max(d["cta_loads"]) < d["naive_max_load"]
    assert [f["name"] for f in d["fields"]] == list(F.FIELD_NAMES)


@pytest.mark.parametrize("argv", [
    [],
    ["--batch", "8", "--kv-dist", "const:1024", "--mode", "naive"],
    ["--batch", "16", "--kv-dist", "uniform:512:1024", "--heads", "32/4", "--qo-len", "64",
     "--causal", "--device", "a100", "--page-size", "1"],
    ["--batch", "4", "--kv-dist", "zipf:4096", "--mode", "batch-invariant", "--head-dim", "256"],
])
def test_cli_rich_output(argv, capsys):
    from rtattn.cli.inspect import main
    assert main(argv + ["--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "plan fields" in out and "item_partial" in out and "per-CTA load" in out


def test_cli_lengths_files(tmp_path, capsys):
    import json

    from rtattn.cli.inspect import main
    p = tmp_path / "l.json"
    p.write_text(json.dumps({"kv_lens": [100, 5000, 7], "qo_lens": [1, 2, 1]}))
    assert main(["--lengths", str(p), "--json", "--reps", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["qo_total"] == 4
    p2 = tmp_path / "l.npz"
    np.savez(p2, kv_lens=np.array([10, 20000]))
    assert main(["--lengths", str(p2), "--json", "--reps", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_total"] == 20010


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(0, 2**31 - 1))
def test_reused_dirty_buffer_gives_the_same_plan_prefix(w, seed):
    """A pinned buffer is reused every step: stale bytes past the counts must not
    leak into anything the kernels read."""
    p, args = make(w)
    fresh = p.plan(*args)
    dirty = np.random.default_rng(seed).integers(0, 256, p.layout.plan_bytes, dtype=np.uint8)
    info = p.plan(*args, out=dirty)
    verify_plan(info.views, w["qo"], w["kv"], tile_q=p.tile_q, page_size=w["page_size"],
                causal=w["causal"])
    n, m, B = info.num_items, info.num_merge_rows, info.batch
    used = {"req_qo_start": B, "req_qo_len": B, "req_kv_page_start": B, "req_kv_len": B,
            "kv_indices": int(args[1][-1]), "work_indptr": p.num_ctas + 1,
            "item_request": n, "item_qo_start": n, "item_qo_len": n, "item_kv_start": n,
            "item_kv_end": n, "item_partial": n, "item_kv_page_start": n,
            "merge_indptr": m + 1, "merge_qo_row": m, "merge_partial_start": m,
            "merge_partial_stride": m, "plan_info": F.PLAN_INFO_LEN}
    for name, k in used.items():
        assert np.array_equal(info.views[name][:k], fresh.views[name][:k]), name


@pytest.mark.parametrize("mode", F.MODES)
def test_zero_query_requests_and_empty_batch(mode):
    p = Planner(8, 64, 4096, 32, 8, 128, 16, mode=mode)
    for qo, kv in [([0, 3, 0, 1], [100, 5000, 0, 70]), ([0], [10]), ([], [])]:
        info = p.plan_lengths(np.array(qo, int), np.array(kv, int))
        verify_plan(info.views, qo, kv, tile_q=p.tile_q, page_size=16)
        assert info.batch == len(qo)


def test_contiguous_partition_beats_lpt_on_small_skewed_decode():
    """16 decode requests, heavy-tailed KV, 66 CTAs: ~1 Algorithm-1 chunk per CTA, so LPT's
    slowest CTA carries two chunks; the contiguous slices stay within a page of the mean."""
    kv = np.array([59, 120, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1300, 1838, 2661, 5113])
    info = {}
    for mode in ("balanced", "contiguous"):
        p = Planner(16, 16, 4096, 32, 4, 128, 16, mode=mode, num_ctas=66)
        info[mode] = p.plan_lengths(np.ones(16, np.int64), kv)
    c = info["contiguous"]
    assert c.max_load < info["balanced"].max_load
    assert c.max_load <= 1.1 * c.cta_loads.mean()


@pytest.mark.parametrize("mode", ["auto", "balanced", "contiguous", "naive", "batch-invariant"])
@pytest.mark.parametrize("ps", [1, 16])
def test_window_plans_read_only_the_window(mode, ps):
    """Decode with a sliding window: every request's items cover [q_pos - w rounded down to a
    page, kv) and nothing else, so the plan reads about w + page tokens per request."""
    kv = np.array([1, 100, 4096, 30000, 2049, 0, 5000])
    w = 1000
    p = Planner(16, 16, 50000, 32, 8, 128, ps, mode=mode, num_ctas=20, chunk_tokens=512)
    info = p.plan(
        indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps), window_left=w)
    verify_plan(info.views, np.ones_like(kv), kv, tile_q=p.tile_q, page_size=ps, window_left=w)
    start = np.maximum(kv - 1 - w, 0) // ps * ps
    assert info.planned_kv_tokens == int((kv - np.minimum(start, kv)).sum())
    assert info.planned_kv_tokens <= int(np.minimum(kv, w + ps).sum())
    full = p.plan(indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps))
    assert full.planned_kv_tokens == kv.sum()
    with pytest.raises(ValueError, match="window_left=-1 is negative"):
        p.plan(indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps), window_left=-1)
    with pytest.raises(TypeError, match="window_left"):
        p.plan(indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps), window_left=2.5)
    with pytest.raises(ValueError, match="does not fit int32"):
        p.plan(indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps), window_left=2**31)
    big = p.plan(indptr_from_lengths(np.ones_like(kv)), *paged_kv(kv, ps), window_left=2**31 - 1)
    assert big.planned_kv_tokens == kv.sum()   # a window wider than any context reads it all


def test_causal_window_prefill_tiles_start_at_their_first_row():
    qo, kv, w = np.array([40, 7]), np.array([3000, 7]), 64
    p = Planner(4, 64, 512, 8, 8, 64, 16, mode="balanced", causal=True, num_ctas=6, max_rows=16)
    info = p.plan(indptr_from_lengths(qo), *paged_kv(kv, 16), window_left=w)
    verify_plan(info.views, qo, kv, tile_q=p.tile_q, page_size=16, causal=True, window_left=w)
    v, n = info.views, info.num_items
    # request 0's tiles of 16 rows: rows 0-15 see KV from 2960 - 64 = 2896 (a page boundary)
    first = v["item_kv_start"][:n][(v["item_request"][:n] == 0) & (v["item_qo_start"][:n] == 0)]
    assert first.min() == 2896
    assert info.planned_kv_tokens < 40 * (w + 16 + 16)


def test_cli_window_json(capsys):
    from rtattn.cli.inspect import main
    assert main(["--kv-dist", "const:32768", "--batch", "4", "--window", "4096", "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["window_left"] == 4096 and r["planned_kv_tokens"] == 4 * (32768 - (32767 - 4096) // 16 * 16)
    assert main(["--window", "-1", "--json"]) == 2
@pytest.mark.parametrize("seed", range(4))
def test_batch_invariant_rounds_stay_near_lpt_at_large_batches(seed):
    """Past ROUNDS_MIN_ITEMS_PER_CTA items per CTA, batch-invariant deals chunks in vectorized
    rounds: a valid plan whose slowest CTA is within 2% of LPT's (and of the mean + one chunk)."""
    from rtattn.plan import inspector as I
    rng = np.random.default_rng(seed)
    kv = rng.integers(700, 5000, 256)
    p = Planner(256, 256, 256 * 320, 32, 8, 128, 16, mode="batch-invariant", max_qo_len=1, chunk_runs=False)
    info = p.plan_lengths(np.ones(256, int), kv)
    assert info.num_items > I.ROUNDS_MIN_ITEMS_PER_CTA * p.num_ctas
    verify_plan(info.views, np.ones(256, int), kv, tile_q=p.tile_q, page_size=16)
    chunk_cost = info.chunk_tokens + COST_ALPHA + COST_GAMMA
    assert info.max_load <= info.cta_loads.mean() + chunk_cost
    cs = np.sort(np.concatenate([np.full(int(x // info.chunk_tokens), chunk_cost) for x in kv] +
                                [np.array([x % info.chunk_tokens + COST_ALPHA + COST_GAMMA for x in kv
                                           if x % info.chunk_tokens])]))[::-1].astype(np.int64).copy()
    ar = np.arange(len(cs) + 64, dtype=np.int64)
    lpt = np.bincount(I.lpt_assign(cs, p.num_ctas, ar), weights=cs, minlength=p.num_ctas).max()
    assert cs.sum() == info.cta_loads.sum() and info.max_load <= 1.02 * lpt


@pytest.mark.parametrize("seed", range(3))
def test_auto_early_contiguous_choice_changes_no_plan(monkeypatch, seed):
    """Auto may take the contiguous partition before laying out the balanced items (from the
    largest chunk and the mean, a part of its bound): the same plan bytes as deciding on the whole
    bound, over uniform, heavy-tailed and one-long batches (decode, and short causal queries)
    that land on both sides."""
    rng = np.random.default_rng(seed)
    chosen = []
    for case in range(60):
        batch = int(rng.integers(2, 300))
        kind = case % 3
        kv = (rng.integers(1, 4096, batch) if kind == 0 else
              np.minimum(32768, rng.pareto(1.2, batch) * 300 + 1).astype(np.int64) if kind == 1 else
              np.full(batch, int(rng.integers(1, 8192))))
        if kind == 2:
            kv[0] = 32768
        ps, C = int(rng.choice([1, 16])), int(rng.choice([16, 33, 66, 132]))
        kvp, idx, last = paged_kv(kv, ps, shuffle_seed=case)
        # decode, or short queries (multi-token verification, causal: each a tile of up to 8 tokens)
        qo = np.ones(batch, np.int64) if case % 2 else np.minimum(rng.integers(1, 9, batch), kv)
        bufs = []
        for early in (True, False):
            p = Planner(batch, int(qo.sum()), int(kvp[-1]), 32, 8, 128, ps, num_ctas=C, max_qo_len=int(qo.max()),
                        causal=not case % 2)
            p.small_tiles, p.tile_table_path = 0, False   # (the numpy path's early choice)
            if not early:
                monkeypatch.setattr(p, "_auto_contiguous_first", lambda *a: (None, False))
            else:
                first = p._auto_contiguous_first
                monkeypatch.setattr(p, "_auto_contiguous_first",
                                    lambda *a: chosen.append((a[0], first(*a)[1])) or first(*a))
            bufs.append(p.layout.allocate())
            p.plan(None if case % 2 else indptr_from_lengths(qo), kvp, idx, last, out=bufs[-1])
        assert np.array_equal(bufs[0], bufs[1]), case
    for decode in (True, False):   # both outcomes exercised, on both kinds of tiles
        assert {took for d, took in chosen if d == decode} == {True, False}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.integers(1, 2000), st.lists(st.lists(st.integers(0, 2000), min_size=1, max_size=300),
                                                        min_size=1, max_size=4))
def test_lpt_rounds_in_kept_scratch_deal_like_the_textbook_heap(num_ctas, base, batches):
    """lpt_assign with a scratch dict (the rounds' arrays kept per (items, CTAs), reused by the
    next calls: tile_table's unsplit plans) == the textbook heap, call after call."""
    from rtattn.plan.inspector import lpt_assign
    scratch, ar = {}, np.arange(2 * 300 + 2 * 80, dtype=np.int64)
    for offsets in batches + batches:   # (every shape twice: the second call reuses the arrays)
        costs = [base + o % (base + 1) for o in offsets]
        cs = np.sort(np.array(costs, dtype=np.int64))[::-1].copy()
        assert lpt_assign(cs, num_ctas, ar, scratch).tolist() == _textbook_lpt(cs, num_ctas)
