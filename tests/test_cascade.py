"""CascadeWrapper. CPU tier: the fake GPU (tests/fakes.py) checks planning into one plan set,
one copy per plan, the kernels' fixed arguments (graphs survive replans), the plan the kernels
would read (run by the float64 executor) and the refusals. GPU tier (marked gpu): the kernels
against float64 and against single-format rtattn on the same cache, bitwise determinism,
graph replay across replans."""
from __future__ import annotations

import itertools

from types import SimpleNamespace

import numpy as np
import pytest

from rtattn import cascade as C
from rtattn.codegen.spec import BUILTINS
from rtattn import wrapper as W
from rtattn.level_fold import THREADS, params_struct
from rtattn.plan.cascade import PREFILL_MIN_SAVING_US, execute_cascade
from rtattn.plan.reference import Variant, reference_attention
from rtattn.runtime import export

import fakes
from cascade_cases import (REF, check_gpu, gpu_case, gpu_run, gpu_wrapper, one_prefix_batch, shared_batch,
                           unequal_suffix_batch, variant_params)


def fake_function(name, handle):
    return SimpleNamespace(name=name, handle=handle, max_dynamic_smem=None)


class FakePrefill:
    """The prefill family's kernels of one (spec, tile), unloaded: what the cascade's launch reads."""

    def __init__(self, spec, tile):
        from rtattn.families.prefill import instance_name
        self.spec, self.tile = spec, tile
        self.kernel = fake_function(instance_name(spec, tile), 0xE000)
        self.rendered = SimpleNamespace(threads=tile.threads, smem_bytes=tile.smem_bytes(spec.head_dim))


@pytest.fixture
def fake_gpu(monkeypatch):
    made, copies = [], []

    def kernels(spec):
        made.append(fakes.FakeKernels(spec))
        return made[-1]

    fakes.install(monkeypatch, kernels, memcpy=lambda dst, src, n, stream=None, device=None: copies.append((dst, src, n)))
    monkeypatch.setattr(W, "as_stream", lambda s=None: SimpleNamespace(handle=0), raising=False)
    for name in ("DeviceBuffer", "PinnedBuffer"):
        monkeypatch.setattr(C, name, fakes.FakeBuffer)
    monkeypatch.setattr(C, "Event", lambda timing=False, device=None: SimpleNamespace(record=lambda s=None: None,
                                                                         synchronize=lambda: None))
    monkeypatch.setattr(C, "memcpy_htod_async", lambda dst, src, n, stream=None, device=None:
                        copies.append((dst, src, n)))
    prefill = []
    monkeypatch.setattr(C, "prefill_kernels", lambda spec, tile, ordinal: prefill.append(FakePrefill(spec, tile))
                        or prefill[-1])
    monkeypatch.setattr(C, "fold_function", lambda *a: fake_function("fold", 0xF000))
    return SimpleNamespace(kernels=made, copies=copies, prefill=prefill)


def enqueued(k, n=3):
    """The calls of the latest launch (decode, prefill, fold): (call, argument bytes)."""
    return k.enqueued[-n:]


def cuda(shape, dtype="bfloat16", ptr=1 << 30):
    return export(ptr, shape, dtype, 0)


def _pinned_bytes(w):
    return w._pinned[w._slot ^ 1].array


def test_plan_is_one_copy_of_one_plan_set_and_the_kernel_reads_it(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(6, 256, 40, 16, seed=1)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=pool + 4, prefill=True, join_levels=False, flat=False,
                         single_query_build=False)   # (the one-query build: test_single_query_plans_...)
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    n = w.planner.planset.plan_bytes
    assert fake_gpu.copies[-1] == (w.workspace_ptr, w._pinned[0].ptr, n) and info.num_levels == 2
    q, o, lse = cuda((6, 32, 128)), cuda((6, 32, 128), ptr=1 << 34), cuda((6, 32), "float32", ptr=1 << 35)
    kc, vc = cuda((pool, 16, 8, 128), ptr=1 << 32), cuda((pool, 16, 8, 128), ptr=1 << 33)
    w.run(q, kc, vc, out=o, lse=lse)
    # 6 queries on the prefix: nothing on prefill tiles, so no prefill kernel; the decode kernel
    # is the plain build (it waits for the step's inputs itself), not the concurrent one
    k, plain = fake_gpu.kernels
    assert plain.grids == [(w.kernel.num_ctas, 8)] and k.launches == [] and w.launch_list() == "levels"
    assert "RTATTN_INDEPENDENT" not in plain.rendered.source and "RTATTN_INDEPENDENT" in k.rendered.source
    (dec, dec_args), (fc, fold) = enqueued(plain, 2)
    assert len(plain.enqueued) == 2 and dec.function is plain.kernel
    # the same arguments on the prefill list, which a plan on prefill tiles launches
    pre, dec2, _ = w.prepare(q, kc, vc, out=o, lse=lse).lists["prefill"]
    assert dec2.function is k.kernel and bytes(dec2.params) == dec_args
    pre_args = bytes(pre.params)
    assert w.concurrent_levels and w.kernel.spec.independent and not fake_gpu.prefill[0].spec.independent
    assert [c.name for c in (dec, fc)] == ["decode", "fold"] and all(c.pdl for c in (dec, pre, fc))
    assert pre.name == fake_gpu.prefill[0].kernel.name and w.prefill_tile.rows == 64   # 16 queries x 4 heads
    ps = k.rendered.params.ctypes_type()
    st = ps.from_buffer_copy(dec_args)
    assert st.plan.work_indptr == w.workspace_ptr + w.kernel.layout.offsets["work_indptr"]
    assert st.partial_o == w.workspace_ptr + w.kernel.state_o_offset and st.fused_merge == 0
    # the prefill kernel: the same arguments but its own queues and items, the union's requests and pages
    sp = ps.from_buffer_copy(pre_args)
    ptrs = w.planner.planset.device_ptrs(w.workspace_ptr)
    assert pre.grid == (w.planner.prefill.num_ctas, 8, 1) and pre.smem == w.prefill_tile.smem_bytes(128)
    assert (sp.plan.work_indptr, sp.plan.item_request) == (ptrs["prefill"]["work_indptr"], ptrs["prefill"]["item_request"])
    assert (sp.plan.req_kv_len, sp.plan.kv_indices) == (st.plan.req_kv_len, st.plan.kv_indices)
    assert (sp.q, sp.k_cache, sp.o, sp.partial_o, sp.partial_lse) == (st.q, st.k_cache, st.o, st.partial_o, st.partial_lse)
    f = params_struct("bfloat16").ctypes_type().from_buffer_copy(fold)
    assert fc.grid == (132 * 2, 1, 1) and fc.block == (256, 1, 1)
    assert (f.o, f.lse, f.fold_rows, f.fold_info) == (o.ptr, lse.ptr, ptrs["fold_rows"], ptrs["fold_info"])
    assert f.state_lse == st.partial_lse and f.o_stride_tok == 32 * 128
    # what the kernels read: the pinned plan set, run in float64
    rng = np.random.default_rng(0)
    qh = rng.standard_normal((6, 32, 128))
    kh, vh = rng.standard_normal((2, pool, 16, 8, 128))
    O, S = execute_cascade(info, qh, kh, vh)
    Or, Sr = reference_attention(qh, kh, vh, np.arange(7), kv_indptr, idx, last, 16)
    np.testing.assert_allclose(O, Or, atol=1e-12)
    assert info.views["plan"]["plan_info"].base is not None and _pinned_bytes(w).nbytes >= n


def test_every_argument_is_fixed_across_replans(fake_gpu):
    """Requests joining and leaving the shared prefix change the plan, never a kernel argument:
    a captured graph replays every plan."""
    rng = np.random.default_rng(2)
    w = C.CascadeWrapper(3, 32, 8, 64, 16, max_batch=16, max_pages=200, variant="alibi", prefill=True,
                         join_levels=False, single_query_build=False)   # (the joined list: test_join_levels_...)
    q, o = cuda((16, 32, 64)), cuda((16, 32, 64), ptr=1 << 34)
    kc, vc = cuda((200, 16, 8, 64), ptr=1 << 32), cuda((200, 16, 8, 64), ptr=1 << 33)
    alibi = cuda((32,), "float32", ptr=1 << 36)
    seen, families = set(), []
    for step, groups in enumerate((((3, 2), (2, 1)), ((12, 2),), ((2, 3), (2, 2), (2, 1)), ((10, 1), (4, 2)))):
        kv_indptr, idx, last, _ = shared_batch(rng, 16, groups=groups, loners=1, pool=200)
        B = len(kv_indptr) - 1
        info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
        families.append(bool(info.level_prefill_items.any()))
        launch = w.prepare(export(q.ptr, (B, 32, 64), "bfloat16", 0), kc, vc,
                           out=export(o.ptr, (B, 32, 64), "bfloat16", 0), params={"alibi_slopes": alibi})
        assert w.launch_list() == ("prefill" if families[-1] else "levels") and launch.calls is \
            launch.lists[w.launch_list()] and launch.config_key == tuple(c.shape_key for c in launch.calls)
        seen.add(tuple((name, c.shape_key, bytes(c.params)) for name, calls in launch.lists.items() for c in calls))
    # (plain decode, fold), (it, merge), (prefill, decode, fold) on the prefill kernel's two grids
    assert len(seen) == 1 and len(next(iter(seen))) == 10
    assert families == [False, True, False, True]   # the shared prefix moves between the families
    st = fake_gpu.kernels[0].rendered.params.ctypes_type().from_buffer_copy(next(iter(seen))[0][2])
    ptrs = w.planner.planset.device_ptrs(w.workspace_ptr)
    assert (st.extra.cascade_q_pos, st.extra.cascade_kv_offset) == (ptrs["q_pos"], ptrs["kv_offset"])
    assert w.spec.variant_type.startswith("rtattn::LevelPositions<rtattn::StandardAttention<false, false, false, true")


def test_run_rewrites_one_launch_list_as_prepare_packs_it(fake_gpu):
    """run() binds one reusable launch list per wrapper (argument buffers rewritten in place);
    every call's arguments are those prepare() packs for the same tensors: the prefill kernel's
    are the decode kernel's with the prefill plan, the fold's carry that call's out and lse."""
    kv_indptr, idx, last, pool = one_prefix_batch(20, 256, 40, 16)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=20, max_pages=pool, prefill=True, join_levels=False, flat=False,
                         single_query_build=False)
    w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert w.info.level_prefill_items[0] > 0
    kc, vc = cuda((pool, 16, 8, 128), ptr=1 << 32), cuda((pool, 16, 8, 128), ptr=1 << 33)
    k, calls = fake_gpu.kernels[0], set()
    for o_ptr, lse_ptr in ((1 << 34, 1 << 35), (1 << 36, 0), (1 << 37, 1 << 38)):
        q, o = cuda((20, 32, 128), ptr=1 << 39), cuda((20, 32, 128), ptr=o_ptr)
        lse = cuda((20, 32), "float32", ptr=lse_ptr) if lse_ptr else None
        w.run(q, kc, vc, out=o, lse=lse)
        ran = enqueued(k)
        calls.add(tuple(id(c) for c, _ in ran))
        assert [a for _, a in ran] == [bytes(c.params) for c in w.prepare(q, kc, vc, out=o, lse=lse).calls]
        assert ran[0][0].name == fake_gpu.prefill[0].kernel.name and ran[1][0].name == "decode"
        f = params_struct("bfloat16").ctypes_type().from_buffer_copy(ran[2][1])
        assert (f.o, f.lse or 0, f.o_stride_tok, f.o_stride_head) == (o_ptr, lse_ptr, 32 * 128, 128)   # (null: None)
    assert len(calls) == 1   # the same three calls every time
    # a plan with nothing on prefill tiles launches no prefill kernel, and the decode kernel's
    # plain build (the concurrent one relies on the prefill kernel's wait for the inputs), eager
    # or prepared; the next plan on prefill tiles gets the three calls again
    small = one_prefix_batch(6, 256, 40, 16)[:3]
    big = (kv_indptr, idx, last)
    for concurrent in (True, False):
        first = len(fake_gpu.kernels)
        w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=20, max_pages=pool, prefill=True, flat=False,
                             concurrent_levels=concurrent, join_levels=False, single_query_build=False)
        levels_k, plain_k = fake_gpu.kernels[first], fake_gpu.kernels[-1]   # (the same when not concurrent)
        assert w.kernel.spec.independent == concurrent and w.concurrent_levels == concurrent
        assert (levels_k is plain_k) != concurrent and "RTATTN_INDEPENDENT" not in plain_k.rendered.source
        for batch, B in ((small, 6), (big, 20), (small, 6)):
            w.plan(None, *batch, share_prefixes=True)
            assert bool(w.info.level_prefill_items.any()) == (B == 20)
            before = len(levels_k.enqueued), len(plain_k.enqueued)
            q, o = cuda((B, 32, 128)), cuda((B, 32, 128), ptr=1 << 34)
            w.run(q, kc, vc, out=o)
            if B == 20:   # the prefill kernel, the levels' decode build, the fold
                ran = levels_k.enqueued[before[0]:]
                assert [c.function for c, _ in ran] == [fake_gpu.prefill[-1].kernel, levels_k.kernel, ran[2][0].function]
            else:         # the plain decode build, the fold
                ran = plain_k.enqueued[before[1]:]
                assert [c.function for c, _ in ran][:1] == [plain_k.kernel] and len(ran) == 2
            assert ran[-1][0].name == "fold"
            assert [bytes(c.params) for c in w.prepare(q, kc, vc, out=o).calls] == [a for _, a in ran]


def test_the_flat_plan_launches_the_decode_and_merge_kernels(fake_gpu):
    """flat="auto": 16 requests over a 1K prefix (32/8 heads) are planned flat where max_pages
    holds their page lists (the cost rule's pick; rtattn single format measured 15.4 us against
    17.3 on the levels, docs/perf-log.md "Cascade v4"): run() launches the plain decode build at
    one row tile (its items are single queries, ONE_QUERY_M_TILES: rtattn's single-format kernel)
    and its merge kernel on the decode arguments, no fold; a 4K prefix gets the levels again."""
    kc, vc = cuda((5000, 16, 8, 128), ptr=1 << 32), cuda((5000, 16, 8, 128), ptr=1 << 33)
    first = len(fake_gpu.kernels)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=16 * (256 + 8), num_pages_pool=5000,
                         flat="auto", prefill=False)   # off by default (measured slower on the H200)
    levels_k, flat_k = fake_gpu.kernels[first:]
    assert "_m2_" in levels_k.rendered.decode_name and f"_m{C.ONE_QUERY_M_TILES}_" in flat_k.rendered.decode_name
    short, long = one_prefix_batch(16, 1024, 128, 16)[:3], one_prefix_batch(16, 4096, 128, 16)[:3]
    for batch, flat in ((short, True), (long, False), (short, True)):
        info = w.plan(None, *batch, share_prefixes=True)
        assert info.flat == flat and w.launch_list() == ("flat" if flat else "levels")
        q, o = cuda((16, 32, 128)), cuda((16, 32, 128), ptr=1 << 34)
        k = flat_k if flat else levels_k
        n = len(k.enqueued)
        w.run(q, kc, vc, out=o)
        ran = k.enqueued[n:]
        assert [c.function for c, _ in ran][:1] == [k.kernel] and len(ran) == 2
        assert (ran[1][0].function is flat_k.merge) == flat and (ran[1][0].name == "fold") != flat
        if flat:
            assert ran[1][0].params is ran[0][0].params and info.num_levels == 1 and info.plan.batch == 16
            assert ran[0][1] == bytes(w.prepare(q, kc, vc, out=o).lists["levels"][0].params)   # the decode arguments
    # flat=False never; flat=True wherever the pages fit (here every step)
    for flat, picks in ((False, [False, False]), (True, [True, True])):
        w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=16 * (256 + 8), num_pages_pool=5000,
                             flat=flat, prefill=False)
        assert [w.plan(None, *b, share_prefixes=True).flat for b in (short, long)] == picks
    with pytest.raises(ValueError, match="flat must be"):
        C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=100, flat="yes")


def test_join_levels_launches_the_prefill_kernel_and_the_joining_decode_build(fake_gpu):
    """join_levels=True: a one-prefix plan on prefill tiles is two calls, the prefill kernel and
    the decode kernel's level_join build (on the same arguments), no fold; a plan the join cannot
    serve (a tree: a row's states from two prefill levels) keeps the fold list."""
    kv_indptr, idx, last, pool = one_prefix_batch(20, 256, 40, 16)
    first = len(fake_gpu.kernels)
    w = C.CascadeWrapper(3, 32, 8, 128, 16, max_batch=24, max_pages=pool + 40, prefill=True, join_levels=True, flat=False,
                         num_pages_pool=pool + 40, single_query_build=False)
    levels_k, plain_k, join_k = fake_gpu.kernels[first:]
    assert "#define RTATTN_LEVEL_JOIN 1" in join_k.rendered.source and "RTATTN_LEVEL_JOIN" not in levels_k.rendered.source
    assert "RTATTN_INDEPENDENT_LEVEL 1" in join_k.rendered.source and w.planner.join_levels
    assert "_m2_" in levels_k.rendered.decode_name and f"_m{C.ONE_QUERY_M_TILES}_" in join_k.rendered.decode_name   # (one query an item)
    kc, vc = cuda((pool + 40, 16, 8, 128), ptr=1 << 32), cuda((pool + 40, 16, 8, 128), ptr=1 << 33)
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert info.joined and w.launch_list() == "join"
    q, o = cuda((20, 32, 128)), cuda((20, 32, 128), ptr=1 << 34)
    n = len(join_k.enqueued)
    w.run(q, kc, vc, out=o)
    (pre, pre_args), (dec, dec_args) = join_k.enqueued[n:]
    assert pre.function is fake_gpu.prefill[-1].kernel and dec.function is join_k.kernel
    assert dec_args == bytes(w.prepare(q, kc, vc, out=o).lists["prefill"][1].params)   # the decode arguments
    tree = shared_batch(np.random.default_rng(1), 16, groups=((12, 3), (10, 2)), system_pages=6, loners=1,
                        pool=pool + 40)
    info = w.plan(None, *tree[:3], share_prefixes=True)
    assert not info.joined and w.launch_list() == "prefill" and info.level_prefill_items[:2].all()
    # without concurrent levels there is no joining build (its states are the previous grid's)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=24, max_pages=pool, prefill=True, join_levels=True,
                         concurrent_levels=False)
    assert w._join is None and not w.planner.join_levels
    with pytest.raises(TypeError, match="join_levels must be a bool"):
        C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=24, max_pages=pool, join_levels="yes")


def test_prefill_mma_picks_the_wgmma_kernel_for_the_shared_levels(fake_gpu):
    """prefill_mma="wgmma": the shared groups' kernel is the prefill family's wgmma build (its
    tile and grid planned), the decode levels unchanged; an unknown kernel is refused."""
    kv_indptr, idx, last, pool = one_prefix_batch(20, 256, 40, 16)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=24, max_pages=pool, prefill=True, prefill_mma="wgmma")
    assert w.prefill_tile.mma == "wgmma" and w.prefill_tile.rows == 128 and fake_gpu.prefill[-1].tile.mma == "wgmma"
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert info.level_prefill_items[0] > 0 and info.prefill.tile_q == 32
    for prefill in (True, False):   # (refused whether or not a prefill kernel is built)
        with pytest.raises(ValueError, match="prefill_mma must be 'auto' or one of"):
            C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=24, max_pages=pool, prefill=prefill, prefill_mma="mfma")


def test_the_defaults_are_the_sm90a_kernels_and_joined_levels_on_cc_9_0(fake_gpu):
    """By default (prefill_mma="auto", join_levels=True) a cc 9.0 device runs the shared levels on
    the prefill family's sm_90a kernels -- wgmma's 64-row tile for up to 16 queries at g = 4, the
    ws kernel's 128 rows past them (d128) -- and one-prefix plans on them join their levels
    (prefill kernel, joining decode build: no fold); other devices, and head groups past 64 rows,
    keep the mma.sync kernel."""
    from rtattn.cascade import shared_prefill_mma
    from rtattn.plan.devices import get_device
    kv_indptr, idx, last, pool = one_prefix_batch(20, 256, 40, 16)
    w16 = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=pool, prefill=True)
    assert (w16.prefill_tile.mma, w16.prefill_tile.rows) == ("wgmma", 64)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=24, max_pages=pool, prefill=True)
    assert (w.prefill_tile.mma, w.prefill_tile.rows) == ("ws", 128) and w._join is not None and w.planner.join_levels
    assert w.planner.prefill_min_saving_us == PREFILL_MIN_SAVING_US["ws"]
    w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert w.launch_list() == "join" and w.info.joined
    h200, a100 = get_device("h200"), get_device("a100")
    assert [shared_prefill_mma(h200, d, g) for d, g in ((128, 4), (64, 1), (256, 8), (128, 128))] == \
        ["wgmma", "wgmma", "wgmma", "sync"]
    assert shared_prefill_mma(a100, 128, 4) == "sync" and shared_prefill_mma(h200, 128, 4, "sync") == "sync"
    assert C.shared_prefill_tile(a100, 128, 4, 16, 16).mma == "sync"


def test_prefill_ctas_per_sm_sizes_the_shared_levels_grid(fake_gpu):
    """prefill_ctas_per_sm: the shared level's grid is that many prefill CTAs per SM (None: as many
    as its tile allows); the launch's prefill call has that grid, the plan that many queues;
    outside 1 to the tile's CTAs per SM it is refused before anything is built."""
    kv_indptr, idx, last, pool = one_prefix_batch(16, 4096, 40, 16)
    kw = dict(max_batch=16, max_pages=pool, prefill=True, join_levels=True)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, **kw)
    assert w.prefill_tile.rows == 64 and w.prefill_tile.min_blocks == 2 and w.planner.prefill.num_ctas == 132 * 2 // 8
    w1 = C.CascadeWrapper(2, 32, 8, 128, 16, prefill_ctas_per_sm=1, **kw)
    assert w1.prefill_tile == w.prefill_tile and w1.planner.prefill.num_ctas == 132 // 8
    info = w1.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert info.joined and info.prefill.num_ctas == 16 and info.level_prefill_items[0] == 16
    q, o = cuda((16, 32, 128)), cuda((16, 32, 128), ptr=1 << 34)
    kc, vc = cuda((pool, 16, 8, 128), ptr=1 << 32), cuda((pool, 16, 8, 128), ptr=1 << 33)
    assert w1.prepare(q, kc, vc, out=o).calls[0].grid == (16, 8, 1)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(ValueError, match="prefill_ctas_per_sm must be an int from 1 to"):
            C.CascadeWrapper(2, 32, 8, 128, 16, prefill_ctas_per_sm=bad, **kw)
    with pytest.raises(ValueError, match="prefill_ctas_per_sm must be"):
        C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=pool, prefill=False, prefill_ctas_per_sm=0)


def test_single_query_plans_run_the_one_row_tile_build(fake_gpu):
    """single_query_build (default): a plan with prefill tiles whose decode items are all single
    queries (the suffixes beside a shared prefix) launches "prefill-q1": the same prefill and fold
    calls and the decode call on the same arguments and grid, by the concurrent build at
    ONE_QUERY_M_TILES; a plan with multi-query decode items (a tree's narrower groups) keeps
    "prefill"; single_query_build=False never takes it. The plan is the same either way."""
    rng = np.random.default_rng(7)
    B, ps = 24, 16
    kv_indptr, idx, last, pool = unequal_suffix_batch(B, 1024, ps, rng)
    kw = dict(max_batch=B, max_pages=int(kv_indptr[-1]) + 64, prefill=True, num_pages_pool=pool + 64, flat=False)
    first = len(fake_gpu.kernels)
    w = C.CascadeWrapper(3, 32, 8, 128, ps, **kw)
    levels_k, one_k = fake_gpu.kernels[first], fake_gpu.kernels[-1]
    assert "_m2_" in levels_k.rendered.decode_name and f"_m{C.ONE_QUERY_M_TILES}_" in one_k.rendered.decode_name
    assert "RTATTN_INDEPENDENT_LEVEL 1" in one_k.rendered.source and "RTATTN_LEVEL_JOIN" not in one_k.rendered.source
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert info.one_query and not info.joined and w.launch_list() == "prefill-q1"
    q, o = cuda((B, 32, 128)), cuda((B, 32, 128), ptr=1 << 34)
    kc, vc = cuda((pool + 64, ps, 8, 128), ptr=1 << 32), cuda((pool + 64, ps, 8, 128), ptr=1 << 33)
    launch = w.prepare(q, kc, vc, out=o)
    (pre, dec, fold), (pre2, dec2, fold2) = launch.calls, launch.lists["prefill"]
    assert (pre, fold) == (pre2, fold2) and dec.function is one_k.kernel and dec2.function is levels_k.kernel
    assert bytes(dec.params) == bytes(dec2.params) and dec.grid == dec2.grid and dec.smem == one_k.rendered.smem_bytes
    n = len(one_k.enqueued)
    w.run(q, kc, vc, out=o)
    assert [c.function for c, _ in one_k.enqueued[n:]] == [pre.function, one_k.kernel, fold.function]
    qh = rng.standard_normal((B, 32, 128))
    kh, vh = rng.standard_normal((2, pool + 64, ps, 8, 128))
    O, _ = execute_cascade(info, qh, kh, vh)
    Or, _ = reference_attention(qh, kh, vh, np.arange(B + 1), kv_indptr, idx, last, ps)
    np.testing.assert_allclose(O, Or, atol=1e-12)
    tree = shared_batch(np.random.default_rng(1), 16, groups=((12, 3), (3, 2)), system_pages=6, loners=1,
                        pool=pool + 64)   # (the 3-request group on decode tiles: one item of 3 queries)
    info = w.plan(None, *tree[:3], share_prefixes=True)
    assert not info.one_query and w.launch_list() == "prefill" and info.level_prefill_items.any()
    w0 = C.CascadeWrapper(3, 32, 8, 128, ps, single_query_build=False, **kw)
    info0 = w0.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert info0.one_query and w0.launch_list() == "prefill" and w0._one is None
    assert bytes(w0._pinned[0].array[:w0.planner.planset.plan_bytes]) == \
        bytes(w._pinned[0].array[:w.planner.planset.plan_bytes])   # the same plan set
    with pytest.raises(TypeError, match="single_query_build must be a bool"):
        C.CascadeWrapper(3, 32, 8, 128, ps, single_query_build=None, **kw)


def test_flat_auto_serves_suffixes_of_unequal_lengths(fake_gpu):
    """flat="auto" on one prefix under suffixes of unequal page counts (plan_union's path): the same
    flat-or-levels rule as for equal ones where the prefix stays on decode tiles -- the flat plan
    (float64 exact), the levels where the rule or the pages say no, and the prefix on prefill tiles
    keeps its levels."""
    rng = np.random.default_rng(3)
    ps = 16
    kv_indptr, idx, last, pool = unequal_suffix_batch(16, 1024, ps, rng)
    kc, vc = cuda((pool, ps, 8, 128), ptr=1 << 32), cuda((pool, ps, 8, 128), ptr=1 << 33)
    for flat, max_pages, expect in (("auto", int(kv_indptr[-1]), True), ("auto", pool, False), (False, int(kv_indptr[-1]), False)):
        w = C.CascadeWrapper(2, 32, 8, 128, ps, max_batch=16, max_pages=max_pages, num_pages_pool=pool, flat=flat,
                             prefill=False)
        info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
        assert info.flat == expect and w.launch_list() == ("flat" if expect else "levels"), (flat, max_pages)
        if expect:
            qh = rng.standard_normal((16, 32, 128))
            kh, vh = rng.standard_normal((2, pool, ps, 8, 128))
            O, S = execute_cascade(info, qh, kh, vh)
            Or, Sr = reference_attention(qh, kh, vh, np.arange(17), kv_indptr, idx, last, ps)
            np.testing.assert_allclose(O, Or, atol=1e-12)
            np.testing.assert_allclose(S, Sr, atol=1e-12)
    w = C.CascadeWrapper(2, 32, 8, 128, ps, max_batch=16, max_pages=int(kv_indptr[-1]), num_pages_pool=pool,
                         flat="auto", prefill=True)   # (every group past a decode tile on prefill tiles)
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert not info.flat and info.level_prefill_items[0] > 0


def test_join_uneven_joins_plans_of_unequal_suffixes(fake_gpu):
    """join_uneven: a one-prefix plan on prefill tiles whose requests' suffixes differ (plan_union,
    not the one-prefix path) joins where each suffix is one decode item ("join": no fold), as exact
    as the fold (float64 executor against the reference); suffixes the schedule splits keep the
    fold unless join_unsplit schedules them whole; a tree keeps the fold either way."""
    rng = np.random.default_rng(9)
    ps = 16
    for B, unsplit, joined in ((24, False, True), (8, False, False), (8, True, True)):
        kv_indptr, idx, last, pool = unequal_suffix_batch(B, 2048, ps, rng, scale=4 if B > 8 else 48)
        kw = dict(max_batch=B, max_pages=int(kv_indptr[-1]) + 64, prefill=True, num_pages_pool=pool + 64, flat=False)
        w = C.CascadeWrapper(3, 32, 4, 128, ps, join_uneven=True, join_unsplit=unsplit, **kw)
        info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
        assert info.union is not None and info.joined == joined, (B, unsplit)
        assert w.launch_list() == ("join" if joined else "prefill-q1")
        items = info.plan.num_items
        assert (items == B) == joined or (unsplit and items == B)
        qh = rng.standard_normal((B, 32, 128))
        kh, vh = rng.standard_normal((2, pool + 64, ps, 4, 128))
        O, S = execute_cascade(info, qh, kh, vh)
        Or, Sr = reference_attention(qh, kh, vh, np.arange(B + 1), kv_indptr, idx, last, ps)
        np.testing.assert_allclose(O, Or, atol=1e-12)
        np.testing.assert_allclose(S, Sr, atol=1e-12)
        if joined:   # the joining decode build on the decode arguments, the prefill kernel first
            q, o = cuda((B, 32, 128)), cuda((B, 32, 128), ptr=1 << 34)
            kc, vc = cuda((pool + 64, ps, 4, 128), ptr=1 << 32), cuda((pool + 64, ps, 4, 128), ptr=1 << 33)
            pre, dec = w.prepare(q, kc, vc, out=o).calls
            assert dec.function is w._join.kernel and pre.grid == (w.planner.prefill.num_ctas, 4, 1)
        w0 = C.CascadeWrapper(3, 32, 4, 128, ps, **kw)   # the default: the fold
        assert not w0.plan(None, kv_indptr, idx, last, share_prefixes=True).joined
    tree = shared_batch(np.random.default_rng(1), 16, groups=((12, 3), (10, 2)), system_pages=6, loners=1, pool=400)
    w = C.CascadeWrapper(3, 32, 4, 128, ps, max_batch=32, max_pages=400, prefill=True, join_uneven=True,
                         join_unsplit=True, num_pages_pool=400)
    assert not w.plan(None, *tree[:3], share_prefixes=True).joined


def test_prefill_ctas_and_leave_early(fake_gpu):
    """prefill_ctas: the shared level's grid in CTAs per KV head (fewer than its resident wave leave
    whole SMs to the decode level; no narrow grid then), refused past the wave; leave_early: the
    concurrent decode build's CTAs leave without the exit wait (spec leave_early, RTATTN_LEAVE_EARLY),
    the plain, joining and flat builds and the prefill kernel without it. The plans stay exact
    (float64 executor against the reference) on requests of unequal suffixes (the general path)."""
    from rtattn.families import decode
    rng = np.random.default_rng(5)
    B, ps = 24, 16
    kv_indptr, idx, last, at = unequal_suffix_batch(B, 1024, ps, rng)
    kw = dict(max_batch=B, max_pages=int(kv_indptr[-1]), prefill=True, num_pages_pool=at, flat=False)
    w = C.CascadeWrapper(2, 32, 4, 128, ps, prefill_ctas=20, leave_early=True, **kw)
    assert w.prefill_tile.rows == 128 and w.planner.prefill.num_ctas == 20 and w.planner.prefill_narrow is None
    assert w.kernel.spec.leave_early and w.kernel.spec.independent and "_le" in w.kernel.spec.uri
    built = [k.rendered.source for k in fake_gpu.kernels[-4:]]   # the levels', plain, joining and one-query builds
    assert ["#define RTATTN_LEAVE_EARLY 1" in src for src in built] == [True, False, False, True]
    assert "#define RTATTN_LEAVE_EARLY 1" in decode.render(w.kernel.spec, "h200").source
    assert "RTATTN_LEAVE_EARLY" not in decode.render(w.kernel.spec.with_(leave_early=False), "h200").source
    assert not fake_gpu.prefill[-1].spec.leave_early
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    assert w.launch_list() == "prefill-q1" and info.prefill.num_ctas == 20 and info.level_prefill_items[0] > 0
    q, o = cuda((B, 32, 128)), cuda((B, 32, 128), ptr=1 << 34)
    kc, vc = cuda((at, ps, 4, 128), ptr=1 << 32), cuda((at, ps, 4, 128), ptr=1 << 33)
    assert w.prepare(q, kc, vc, out=o).calls[0].grid == (20, 4, 1)
    qh = rng.standard_normal((B, 32, 128))
    kh, vh = rng.standard_normal((2, at, ps, 4, 128))
    O, _ = execute_cascade(info, qh, kh, vh)
    Or, _ = reference_attention(qh, kh, vh, np.arange(B + 1), kv_indptr, idx, last, ps)
    np.testing.assert_allclose(O, Or, atol=1e-12)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="prefill_ctas must be a positive int"):
            C.CascadeWrapper(2, 32, 4, 128, ps, prefill_ctas=bad, **kw)
    with pytest.raises(ValueError, match="exceeds the shared tile's resident wave of 33"):
        C.CascadeWrapper(2, 32, 4, 128, ps, prefill_ctas=34, **kw)
    with pytest.raises(TypeError, match="leave_early must be a bool"):
        C.CascadeWrapper(2, 32, 4, 128, ps, leave_early=1, **kw)
    spec = decode.builtin(BUILTINS["plain"], "sm_90", head_dim=128, m_tiles=2)
    for bad in (dict(leave_early=True), dict(independent=True, level_join=True, leave_early=True)):
        with pytest.raises(ValueError, match="leave_early=True needs independent=True"):
            spec.with_(**bad)


def test_short_prefixes_launch_the_prefill_kernel_on_the_narrow_grid(fake_gpu):
    """By default a two-CTA shared tile also has the narrow grid (one CTA per SM): a one-prefix
    plan of at most NARROW_MAX_PREFIX_TOKENS launches the "join-narrow" list (the prefill call
    on that grid, the same arguments), a longer one "join"; a fixed prefill_ctas_per_sm or
    serialized levels build no narrow grid."""
    from rtattn.plan.cascade import NARROW_MAX_PREFIX_TOKENS
    short, long = (one_prefix_batch(16, p, 40, 16, seed=p) for p in (4096, NARROW_MAX_PREFIX_TOKENS + 16))
    pool = long[3]
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=pool, prefill=True, num_pages_pool=pool)
    assert (w.planner.prefill.num_ctas, w.planner.prefill_narrow.num_ctas) == (33, 16)
    q, o = cuda((16, 32, 128)), cuda((16, 32, 128), ptr=1 << 34)
    kc, vc = cuda((pool, 16, 8, 128), ptr=1 << 32), cuda((pool, 16, 8, 128), ptr=1 << 33)
    for batch, name, grid in ((short, "join-narrow", 16), (long, "join", 33), (short, "join-narrow", 16)):
        w.plan(None, *batch[:3], share_prefixes=True)
        launch = w.prepare(q, kc, vc, out=o)
        assert w.launch_list() == name and launch.calls[0].grid == (grid, 8, 1) and w.info.prefill.num_ctas == grid
        assert bytes(launch.calls[0].params) == bytes(launch.lists["join"][0].params)   # one argument buffer
        assert launch.calls[1] is launch.lists["join"][1]
    assert set(launch.lists) == {"levels", "flat", "prefill", "join", "prefill-narrow", "join-narrow", "prefill-q1",
                                 "prefill-q1-narrow"}
    assert all(len(calls) == len(C.LAUNCH_LISTS[name]) for name, calls in launch.lists.items())
    for kw in (dict(prefill_ctas_per_sm=2), dict(concurrent_levels=False), dict(pdl=False)):
        w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=16, max_pages=pool, prefill=True, **kw)
        assert w.planner.prefill_narrow is None
        w.plan(None, *short[:3], share_prefixes=True)
        assert not w.launch_list().endswith("-narrow") and w.info.prefill.num_ctas == 33
    # d256: the decode build's 206 KiB leave no room beside a prefill CTA; before cc 9.0 nothing overlaps
    assert C.CascadeWrapper(2, 32, 8, 256, 16, max_batch=16, max_pages=pool, prefill=True).planner.prefill_narrow is None
    from rtattn.plan.devices import get_device
    from rtattn.families import decode
    plain = decode.builtin(BUILTINS["plain"], "sm_90", head_dim=128, m_tiles=2)
    assert C.fits_beside(get_device("h200"), w.prefill_tile, 128, plain)
    assert not C.fits_beside(get_device("a100"), C.shared_prefill_tile(get_device("a100"), 128, 4, 16, 16), 128, plain)


def test_levels_in_flashinfer_convention(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(4, 64, 20, 16)
    w = C.CascadeWrapper(2, 8, 8, 64, 16, max_batch=4, max_pages=pool, prefill=True)
    lv = C.levels_from_page_tables(kv_indptr, idx, last, 16)
    info = w.plan(*(list(x) for x in zip(*lv)), requests=(kv_indptr, idx, last))
    assert info.num_levels == 2 and info.level_items.tolist() == [1, 4]


@pytest.mark.parametrize("args, match", [
    (dict(variant="rope"), "not supported across cascade levels"),
    (dict(variant="custom_mask"), "not supported across cascade levels"),
    (dict(m_tiles=3), "m_tiles=3"),
    (dict(num_levels=0), "num_levels"),
])
def test_bad_construction(fake_gpu, args, match):
    kw = dict(num_levels=2, max_batch=4, max_pages=64)
    kw.update(args)
    with pytest.raises(ValueError, match=match):
        C.CascadeWrapper(kw.pop("num_levels"), 8, 8, 64, 16, **kw)


def test_sinks_are_refused_across_levels(fake_gpu):
    from rtattn.codegen import spec as S
    if "sinks" not in S.BUILTINS:
        pytest.skip("no attention sinks in this build")
    with pytest.raises(ValueError, match="sinks are not supported across cascade levels"):
        C.CascadeWrapper(2, 8, 8, 64, 16, max_batch=4, max_pages=64, variant=S.BUILTINS["sinks"](head_dim=64))


def test_bad_input_is_refused_before_any_launch(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(4, 64, 20, 16)
    w = C.CascadeWrapper(2, 8, 8, 64, 16, max_batch=4, max_qo_tokens=40, max_pages=pool, variant="causal", prefill=True)
    lv = C.levels_from_page_tables(kv_indptr, idx, last, 16)
    arrs = [list(x) for x in zip(*lv)]
    with pytest.raises(TypeError, match="one array per level"):
        w.plan(lv[0].qo_indptr, *arrs[1:])
    with pytest.raises(ValueError, match="kv_indices_arr has 1 levels"):
        w.plan(arrs[0], arrs[1], arrs[2][:1], arrs[3])
    bad = list(arrs[0])
    bad[0] = np.array([0, 1, 4], np.int32)
    with pytest.raises(ValueError, match="level 0 covers|level 0:"):
        w.plan(bad, *arrs[1:])
    other = one_prefix_batch(4, 64, 20, 16, seed=9)
    with pytest.raises(ValueError, match="request 0: level 0 group 0 page 0"):
        w.plan(*arrs, requests=other[:3])
    with pytest.raises(ValueError, match="causal: request 0 has 21 queries but its last level holds 20"):
        w.plan(np.array([0, 21, 22, 23, 24], np.int32), kv_indptr, idx, last, share_prefixes=True)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(cuda((4, 8, 64)), cuda((pool, 16, 8, 64)), cuda((pool, 16, 8, 64)))
    w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    with pytest.raises(ValueError, match="holds 3 pages"):
        w.run(cuda((4, 8, 64)), cuda((3, 16, 8, 64)), cuda((3, 16, 8, 64)))
    with pytest.raises(ValueError, match="q has shape"):
        w.run(cuda((5, 8, 64)), cuda((pool, 16, 8, 64)), cuda((pool, 16, 8, 64)))
    assert fake_gpu.kernels[0].launches == [] and fake_gpu.kernels[0].enqueued == []
    assert w.prefill is not None   # the prefill kernel's loader bounds the caches' strides (2**32 bytes)
    huge = export(1 << 32, (pool, 16, 8, 64), "bfloat16", 0, (2**31, 8 * 64, 64, 1))
    with pytest.raises(ValueError, match="k_cache: page and token strides"):
        w.run(cuda((4, 8, 64)), huge, cuda((pool, 16, 8, 64)))
    w.run(cuda((4, 8, 64)), cuda((pool, 16, 8, 64)), cuda((pool, 16, 8, 64)))   # the pool is now `pool` pages
    outside = idx.copy()
    outside[-1] = pool
    with pytest.raises(ValueError, match=r"kv_indices\[\d+\] = \d+ is outside the page pool"):
        w.plan(None, kv_indptr, outside, last, share_prefixes=True)


def test_smoke_cases_plan_on_the_families_they_name(fake_gpu):
    """tools/smoke_cascade.py's cases, planned by the wrapper on the fake GPU: each uses the
    prefill family exactly when it says so (the GPU run checks the same)."""
    import tool_module
    smoke = tool_module.load("smoke_cascade")
    for (name, make, (H, Hk), D, ps, levels, variant, dtype, qo_len, plan), mma in itertools.product(
            smoke.CASES, ("auto", "sync")):
        kv_indptr, idx, last, pool = make(np.random.default_rng(len(name)), ps)
        B = len(kv_indptr) - 1
        qo = np.arange(B + 1, dtype=np.int32) * qo_len
        _, on_prefill, flat, joined = smoke.PLANS[plan]
        case = SimpleNamespace(kv_indptr=kv_indptr, qo=qo, ps=ps, pool=pool, B=B, H=H, Hk=Hk, D=D, dtype=dtype)
        w = gpu_wrapper(case, levels, variant, **smoke.wrapper_kw(plan, mma))   # (as the smoke builds it)
        info = w.plan(qo, kv_indptr, idx, last, share_prefixes=True)
        assert bool(info.level_prefill_items.any()) == on_prefill and info.flat == flat, name
        assert info.joined == joined, name
        assert info.num_levels == (1 if flat else levels), name


def test_level_kernels_and_the_fold_compile(isolated_cache):
    from rtattn.codegen.spec import standard
    from rtattn.kernels import compile_spec
    from rtattn.level_fold import compile_fold
    spec, softmax, causal = C.level_spec(standard(causal=True, window=True, alibi=True, m_tiles=2))
    assert softmax and causal and spec.variant == "causal_window_alibi_levels"
    # the decode kernel as a level running alongside the prefill kernel (the default with one)
    from rtattn.families import decode
    src = decode.render(spec.with_(independent=True), "h200").source
    assert "#define RTATTN_INDEPENDENT_LEVEL 1" in src and "RTATTN_INDEPENDENT" not in decode.render(spec, "h200").source
    assert compile_spec(spec.with_(independent=True), "sm_90", quiet=True)[1][:4] == b"\x7fELF"
    # ... and its build that joins the prefill level's states into its suffix rows (join_levels)
    joining = spec.with_(independent=True, level_join=True)
    assert "#define RTATTN_LEVEL_JOIN 1" in decode.render(joining, "h200").source and joining.uri.endswith("_ind_join")
    assert compile_spec(joining, "sm_90", quiet=True)[1][:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="level_join=True needs independent=True"):
        spec.with_(level_join=True)
    # the fold's three job shapes (D/32 = 2, 4, 8 columns per lane where jobs outnumber warps)
    for dtype, D, softmax in (("bfloat16", 128, True), ("bfloat16", 64, True), ("float16", 256, False)):
        assert compile_fold(dtype, D, softmax, "sm_90")[:4] == b"\x7fELF"
    # the shared groups' prefill kernel, on the same spec (its tile from the family's policy)
    from dataclasses import replace
    from rtattn.codegen.render import render_prefill
    from rtattn.families.prefill import compile_prefill
    from rtattn.families import resources
    h200 = resources.device_for_arch("sm_90")
    tile = C.shared_prefill_tile(h200, 128, 4, 16, 64, "sync")
    assert tile.rows == 128 and C.shared_prefill_tile(h200, 128, 4, 256, 64) is None
    # the smallest tile holding every query of a step: 16 decode queries x 4 heads fill 64 rows
    assert [C.shared_prefill_tile(h200, 128, 4, 16, n, "sync").rows for n in (9, 16, 17, 1000)] == [64, 64, 128, 128]
    assert C.shared_prefill_tile(h200, 256, 4, 16, 64, "sync").rows == 64   # (head_dim 256: at most 64 rows)
    assert compile_prefill(spec, tile, "sm_90", quiet=True)[1][:4] == b"\x7fELF"
    # ... and on the family's sm_90a kernels (the default on cc 9.0): 64 rows of wgmma for 16
    # queries at g = 4, past them (d128) 128 rows of wgmma when asked, of the ws kernel by default
    wg = [C.shared_prefill_tile(h200, 128, 4, 16, 16), C.shared_prefill_tile(h200, 128, 4, 16, 17, "wgmma")]
    assert [(t.mma, t.rows) for t in wg] == [("wgmma", 64), ("wgmma", 128)]
    auto128 = C.shared_prefill_tile(h200, 128, 4, 16, 17)
    assert (auto128.mma, auto128.rows, auto128.kv_evict_first) == ("ws", 128, False)
    assert (C.shared_prefill_tile(h200, 256, 4, 16, 64, "wgmma").rows, C.shared_prefill_tile(h200, 64, 1, 16, 200,
                                                                                            "wgmma").rows) == (64, 64)
    assert compile_prefill(spec, wg[0], "sm_90", quiet=True)[1][:4] == b"\x7fELF"
    # a shared level reads its prefix once per query tile: evict-first KV copies, except on the
    # warp-specialized kernel (which refuses them)
    assert tile.kv_evict_first and all(t.kv_evict_first and t.tag.endswith("_ef_b" + str(t.min_blocks)) for t in wg)
    assert "#define RTATTN_PREFILL_KV_EVICT_FIRST" in render_prefill(spec, wg[0]).source
    assert "#define RTATTN_PREFILL_KV_EVICT_FIRST" not in render_prefill(spec, replace(wg[0], kv_evict_first=False)).source
    ws = C.shared_prefill_tile(h200, 128, 4, 16, 64, "ws")
    assert ws.mma == "ws" and not ws.kv_evict_first


def test_prefill_kernels_let_the_next_grid_launch_only_after_their_wait():
    """The concurrent decode level skips its entry wait because the prefill kernel before it
    calls allow_next_grid only after its own wait_for_previous_grid (the step's inputs are
    ready by then): every prefill kernel source must keep that order."""
    from rtattn.runtime import cuda_src_dir
    files = sorted(cuda_src_dir().glob("prefill*.cuh"))
    assert files
    for f in files:
        text = "\n".join(line.split("//")[0] for line in f.read_text().splitlines())   # code, not comments
        if "allow_next_grid();" in text:
            assert "wait_for_previous_grid();" in text.split("allow_next_grid();")[0], f.name


# ----------------------------------------------------------------------------- GPU tier
def nbhd(*values, id: str):
    """A neighbourhood case (gpu_all.sh's nbhd stage: pytest -m gpu -k nbhd): groups 3, 5, 7, pages 4 and 128."""
    return pytest.param(*values, id=f"{id}-nbhd")


@pytest.mark.gpu
def test_gpu_small_cascade_matches_float64():
    """Small and isolated first: 4 requests over one 64-token prefix."""
    c = gpu_case(one_prefix_batch(4, 64, 20, 16), 32, 8, 128, 16)
    w = gpu_wrapper(c)
    out, lse = gpu_run(c, w)
    assert w.info.num_levels == 2
    check_gpu(c, out, lse, Variant())


@pytest.mark.gpu
@pytest.mark.parametrize("heads, D, ps, levels, dtype", [
    ((32, 8), 128, 16, 3, "bfloat16"), ((32, 32), 64, 16, 2, "bfloat16"), ((32, 2), 128, 1, 2, "bfloat16"),
    ((32, 1), 128, 16, 3, "bfloat16"), ((8, 8), 256, 16, 2, "bfloat16"), ((32, 4), 128, 16, 2, "float16"),
    nbhd((28, 4), 128, 16, 3, "bfloat16", id="28/4-d128-p16-L3"), nbhd((40, 8), 128, 128, 2, "bfloat16", id="40/8-d128-p128-L2"),
    nbhd((12, 4), 64, 4, 2, "bfloat16", id="12/4-d64-p4-L2")])
def test_gpu_cascade_matches_float64(heads, D, ps, levels, dtype):
    rng = np.random.default_rng(D + ps)
    batch = shared_batch(rng, ps, groups=((5, 40 // ps + 1), (3, 3), (1, 2)), system_pages=max(1, 300 // ps), loners=2,
                         suffix_pages=(1, max(2, 64 // ps)))
    c = gpu_case(batch, *heads, D, ps, dtype)
    w = gpu_wrapper(c, levels)
    out, lse = gpu_run(c, w)
    assert w.info.num_levels == levels
    check_gpu(c, out, lse, Variant())


@pytest.mark.gpu
@pytest.mark.parametrize("heads, D, ps, dtype", [
    ((32, 8), 128, 16, "bfloat16"), ((32, 8), 64, 1, "bfloat16"), ((32, 2), 128, 64, "bfloat16"),
    ((32, 1), 128, 16, "bfloat16"), ((8, 8), 256, 16, "bfloat16"), ((32, 4), 128, 16, "float16"),
    ((32, 32), 128, 16, "bfloat16")])
def test_gpu_shared_levels_on_prefill_tiles_match_float64(heads, D, ps, dtype):
    """Many requests under shared prefixes (groups of 70 and 40 below a system prompt): both
    shared levels on the prefill kernel (several tiles, KV split over its grid), the suffixes
    on decode, across GQA 1-32, head dims 64-256 and page sizes 1-64."""
    rng = np.random.default_rng(D + ps + heads[1])
    batch = shared_batch(rng, ps, groups=((70, max(1, 96 // ps)), (40, max(1, 40 // ps))), system_pages=max(1, 700 // ps),
                         loners=3, suffix_pages=(1, max(2, 48 // ps)))
    c = gpu_case(batch, *heads, D, ps, dtype)
    w = gpu_wrapper(c, 3)
    out, lse = gpu_run(c, w)
    assert w.info.num_levels == 3 and w.info.level_prefill_items[:2].all() and not w.info.level_prefill_items[2]
    check_gpu(c, out, lse, Variant())


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(REF))
@pytest.mark.parametrize("qo_len", [1, 3])
@pytest.mark.parametrize("prefill", [True, False])
def test_gpu_variants_with_absolute_positions(variant, qo_len, prefill):
    """Every cascade variant on either family: positions (causal, window, ALiBi) are the
    queries' real ones on every level, also where a prefill tile holds several requests' queries."""
    rng = np.random.default_rng(7)
    batch = shared_batch(rng, 16, groups=((12, 3), (9, 2)), system_pages=6, loners=1, suffix_pages=(2, 4))
    B = len(batch[0]) - 1
    c = gpu_case(batch, 32, 8, 128, 16, qo=np.arange(B + 1) * qo_len)
    w = gpu_wrapper(c, 3, variant, prefill=prefill)
    out, lse = gpu_run(c, w, variant)
    assert bool(w.info.level_prefill_items[:2].all()) == prefill
    check_gpu(c, out, lse, REF[variant])


@pytest.mark.gpu
def test_gpu_matches_single_format_on_the_same_cache_and_is_bitwise_deterministic():
    import torch
    c = gpu_case(one_prefix_batch(16, 1024, 128, 16, seed=3), 32, 8, 128, 16)
    w = gpu_wrapper(c)
    out, lse = gpu_run(c, w)
    single = W.BatchDecodeWrapper(32, 8, 128, 16, max_batch=c.B, max_pages=int(c.kv_indptr[-1]))
    single.plan(c.kv_indptr, c.idx, c.last)
    so, sl = torch.empty_like(out), torch.empty_like(lse)
    single.run(c.q, c.k, c.v, out=so, lse=sl)
    torch.cuda.synchronize()
    diff = float((out.float() - so.float()).norm() / so.float().norm())
    assert diff < 1e-2 and float((lse - sl).abs().max()) < 1e-2, (diff, float((lse - sl).abs().max()))
    again, lse2 = gpu_run(c, w)
    other, lse3 = gpu_run(c, gpu_wrapper(c))
    assert torch.equal(out, again) and torch.equal(out, other) and torch.equal(lse, lse2) and torch.equal(lse, lse3)
    assert w.info.level_prefill_items[0] > 0   # 16 queries over the prefix: on prefill tiles
    wd = gpu_wrapper(c, prefill=False)   # every level on decode: the same attention
    dec, dlse = gpu_run(c, wd)
    assert wd.prefill is None and not wd.info.level_prefill_items.any()
    assert float((dec.float() - out.float()).norm() / out.float().norm()) < 1e-2 and float((dlse - lse).abs().max()) < 1e-2
    # the levels serialized (concurrent_levels=False): the same kernels' arithmetic, the same bits
    ws = gpu_wrapper(c, concurrent_levels=False)
    ser, slse = gpu_run(c, ws)
    assert w.concurrent_levels and not ws.concurrent_levels and torch.equal(ser, out) and torch.equal(slse, lse)


@pytest.mark.gpu
def test_gpu_concurrent_level_reads_the_query_the_kernel_before_wrote():
    """The concurrent decode level starts without its own wait for the previous grid: q written by
    the kernel right before run() (no plan() copy between them, a long kernel before that) is what
    every level reads."""
    import torch
    from types import SimpleNamespace
    c = gpu_case(one_prefix_batch(16, 2048, 128, 16, seed=5), 32, 8, 128, 16)
    w = gpu_wrapper(c)
    w.plan(c.qo, c.kv_indptr, c.idx, c.last, share_prefixes=True)
    assert w.concurrent_levels and w.info.level_prefill_items[0] > 0
    torch.cuda.synchronize()
    big = torch.randn(4096, 4096, device="cuda")
    qn = torch.empty_like(c.q)
    out = torch.full_like(c.q, float("nan"))
    lse = torch.full(tuple(c.q.shape[:2]), float("nan"), device="cuda")
    for _ in range(3):
        big = big @ big / 64.0          # a long kernel first
    torch.neg(c.q, out=qn)              # then q, right before the levels
    w.run(qn, c.k, c.v, out=out, lse=lse)
    torch.cuda.synchronize()
    check_gpu(SimpleNamespace(**{**vars(c), "q": qn}), out, lse, Variant())


def graph_replay_steps(w, steps, variant, pool, maxb, seed):
    """One StepGraph captured at the first step (q/out/lse sized for `maxb` queries) replayed for
    each step's page table (plan() first), into poisoned outputs: each replay checked against
    float64 and bitwise against eager run(). Returns (each step's launch list, whether it had
    prefill items, the graph's stats)."""
    import torch
    from rtattn.graphs import StepGraph
    from rtattn.runtime import Stream
    H, Hk, D, ps = w.num_qo_heads, w.kernel.num_kv_heads, w.head_dim, w.page_size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn((pool, ps, Hk, D), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    q = torch.randn((maxb, H, D), generator=gen, device="cuda").to(torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.zeros((maxb, H), device="cuda")
    params = variant_params(variant, H)
    s, graph, seen = Stream(), None, []
    for kv_indptr, idx, last, _ in steps:
        B = len(kv_indptr) - 1
        torch.cuda.synchronize()
        w.plan(None, kv_indptr, idx, last, share_prefixes=True, stream=s)
        seen.append((w.launch_list(), bool(w.info.level_prefill_items.any())))
        if graph is None:
            graph = StepGraph([w.prepare(q, k, v, out=out, lse=lse, params=params, stream=s)], s)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        s.synchronize()
        c = SimpleNamespace(q=q[:B], k=k, v=v, qo=np.arange(B + 1), kv_indptr=kv_indptr, idx=idx, last=last, ps=ps,
                            dtype="bfloat16")
        check_gpu(c, out[:B], lse[:B], REF[variant])
        eager_o, eager_l = torch.empty_like(q[:B]), torch.empty_like(lse[:B])
        w.run(q[:B], k, v, out=eager_o, lse=eager_l, params=params, stream=s)
        s.synchronize()
        assert torch.equal(eager_o, out[:B]) and torch.equal(eager_l, lse[:B]), f"{seen[-1]}: graph != eager"
    graph.close()
    return seen, graph.stats


@pytest.mark.gpu
def test_gpu_graph_replays_across_replans():
    """One StepGraph captured at step 0 serves steps whose requests join and leave shared prefixes."""
    rng = np.random.default_rng(11)
    pool, maxb = 400, 16
    w = C.CascadeWrapper(3, 32, 8, 128, 16, max_batch=maxb, max_pages=pool, variant="alibi", prefill=True)
    # groups come and go, and the shared prefix moves between the families (13 and 15 queries: prefill)
    groups = [((3, 2), (2, 1)), ((12, 2),), ((2, 3), (2, 2), (2, 1)), ((10, 1), (4, 2)), ((1, 1),)]
    steps = [shared_batch(rng, 16, groups=g, loners=1, pool=pool) for g in groups]
    seen, stats = graph_replay_steps(w, steps, "alibi", pool, maxb, seed=1)
    assert [p for _, p in seen] == [False, True, False, True, False]
    # an executable per launch list (without the prefill kernel; with it, the decode items single
    # queries at step 1 -- "prefill-q1" -- and not at step 3), each replayed again
    assert [l for l, _ in seen] == ["levels", "prefill-q1", "levels", "prefill", "levels"]
    assert stats["instantiations"] == 3 and stats["replays"] == len(steps)


# (GPU cases below: every variant on the bench shape, plain on the others -- each case compiles its builds)
CASES_32_8 = [(v, (32, 8)) for v in ("plain", "causal", "sliding_window", "alibi", "soft_cap", "sigmoid")]


@pytest.mark.gpu
@pytest.mark.parametrize("variant, heads, D, ps", [(v, h, 128, 16) for v, h in CASES_32_8] + [
    ("plain", (32, 32), 64, 1), ("plain", (8, 8), 256, 64), ("alibi", (32, 2), 128, 16)])
def test_gpu_flat_plan_matches_float64_and_is_bitwise_deterministic(variant, heads, D, ps):
    """The flat plan (each request's whole page list, one level: the decode and merge kernels,
    no fold; flat=True) for 16 requests over a short prefix: float64 reference with
    poisoned outputs, the same bits on a second run and from a second wrapper."""
    import torch
    c = gpu_case(one_prefix_batch(16, 1024 // ps * ps, 3 * ps + 5, ps, seed=ps), *heads, D, ps)
    make = lambda: C.CascadeWrapper(2, *heads, D, ps, max_batch=16, max_pages=int(c.kv_indptr[-1]),  # noqa: E731
                                    variant=variant, flat=True, prefill=False)   # (no prefill build to compile)
    w = make()
    out, lse = gpu_run(c, w, variant)
    assert w.info.flat and w.launch_list() == "flat"
    check_gpu(c, out, lse, REF[variant])
    again, lse2 = gpu_run(c, w, variant)
    other, lse3 = gpu_run(c, make(), variant)
    assert torch.equal(out, again) and torch.equal(out, other) and torch.equal(lse, lse2) and torch.equal(lse, lse3)


@pytest.mark.gpu
def test_gpu_graph_replays_across_the_launch_lists():
    """One StepGraph over steps whose plans need each launch list in turn: flat (6 requests over
    one prefix, flat=True), join (12 over one prefix on prefill tiles, join_levels=True), levels
    (two small groups and a loner: the general path on decode), prefill-q1 (a tree whose two shared
    levels are on prefill tiles: the fold, its decode items single queries), flat again; the graph
    holds one executable per list."""
    ps, pool, maxb = 16, 600, 24
    w = C.CascadeWrapper(3, 32, 8, 128, ps, max_batch=maxb + 8, max_pages=pool, prefill=True, flat=True,
                         join_levels=True, num_pages_pool=pool)
    rng = np.random.default_rng(4)
    steps = [one_prefix_batch(6, 300, 40, ps, seed=1), one_prefix_batch(12, 300, 40, ps, seed=2),
             shared_batch(rng, ps, groups=((3, 2), (2, 1)), loners=1, pool=pool),
             shared_batch(rng, ps, groups=((12, 3), (10, 2)), system_pages=6, loners=1, pool=pool),
             one_prefix_batch(5, 200, 20, ps, seed=3)]
    seen, stats = graph_replay_steps(w, steps, "plain", pool, maxb, seed=2)
    assert [l for l, _ in seen] == ["flat", "join", "levels", "prefill-q1", "flat"] and stats["instantiations"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("variant, heads, D, ps, B", [(v, h, 128, 16, 20) for v, h in CASES_32_8] + [
    ("plain", (32, 32), 64, 1, 40), ("plain", (8, 8), 256, 64, 40), ("causal", (32, 1), 128, 16, 20),
    ("plain", (32, 4), 128, 16, 64), nbhd("plain", (28, 4), 128, 16, 32, id="plain-28/4-B32"),
    nbhd("soft_cap", (28, 4), 128, 16, 20, id="soft_cap-28/4-B20"), nbhd("causal", (40, 8), 128, 128, 24, id="causal-40/8-p128-B24")])
def test_gpu_joined_levels_match_float64_and_the_fold(variant, heads, D, ps, B):
    """join_levels=True: the prefix on prefill tiles, each suffix row written by the decode kernel
    after joining the prefix's states (no fold kernel): float64 reference with poisoned outputs,
    close to the fold's result on the same cache, the same bits on a second run and from a
    second wrapper."""
    import torch
    c = gpu_case(one_prefix_batch(B, 700, 2 * ps + 9 if ps < 64 else 40, ps, seed=B), *heads, D, ps)
    w = gpu_wrapper(c, 2, variant, join_levels=True)
    out, lse = gpu_run(c, w, variant)
    # (join-narrow: the shared level on one prefill CTA per SM, where a decode CTA fits beside it)
    assert w.info.joined and w.launch_list() in ("join", "join-narrow") and w.info.level_prefill_items[0] > 0
    check_gpu(c, out, lse, REF[variant])
    again, lse2 = gpu_run(c, w, variant)
    other, lse3 = gpu_run(c, gpu_wrapper(c, 2, variant, join_levels=True), variant)
    assert torch.equal(out, again) and torch.equal(out, other) and torch.equal(lse, lse2) and torch.equal(lse, lse3)
    folded, flse = gpu_run(c, gpu_wrapper(c, 2, variant), variant)   # the fold kernel's result
    assert float((folded.float() - out.float()).norm() / folded.float().norm()) < 1e-2
    assert float((flse - lse).abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant, heads, B, unsplit", [("plain", (32, 8), 24, False), ("causal", (32, 4), 32, True),
                                                        ("alibi", (28, 4), 20, True), ("soft_cap", (64, 8), 32, False)])
def test_gpu_uneven_suffixes_join_match_float64(variant, heads, B, unsplit):
    """join_uneven (and join_unsplit): one prefix on prefill tiles under suffixes of unequal lengths
    (plan_union's path), each suffix row written by the joining decode build (no fold kernel):
    float64 reference with poisoned outputs, the same bits on a second run, close to the fold's."""
    import torch
    rng = np.random.default_rng(B)
    c = gpu_case(unequal_suffix_batch(B, 1024, 16, rng, scale=4 if not unsplit else 16), *heads, 128, 16)
    kw = dict(join_uneven=True, join_unsplit=unsplit)
    w = gpu_wrapper(c, 2, variant, join_levels=True, **kw)
    out, lse = gpu_run(c, w, variant)
    assert w.info.joined and w.info.union is not None and w.launch_list() == "join"
    check_gpu(c, out, lse, REF[variant])
    again, lse2 = gpu_run(c, w, variant)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
    folded, flse = gpu_run(c, gpu_wrapper(c, 2, variant), variant)   # the fold kernel's result
    assert float((folded.float() - out.float()).norm() / folded.float().norm()) < 1e-2
    assert float((flse - lse).abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant, join, heads, D, B", [
    ("plain", False, (32, 8), 128, 16), ("causal", True, (32, 8), 128, 16), ("alibi", False, (32, 8), 128, 64),
    ("plain", True, (32, 8), 128, 64), ("sigmoid", True, (32, 32), 64, 40), ("plain", False, (8, 8), 256, 64),
    nbhd("plain", True, (28, 4), 128, 32, id="plain-join-28/4-B32"), nbhd("causal", False, (40, 8), 128, 16, id="causal-40/8-B16")])
def test_gpu_shared_levels_on_the_wgmma_kernel_match_float64(variant, join, heads, D, B):
    """prefill_mma="wgmma": the shared prefix on the prefill family's sm_90a kernel (64- and
    128-row tiles), folded or joined: float64 reference with poisoned outputs, and the bits of a
    second run."""
    import torch
    c = gpu_case(one_prefix_batch(B, 1500, 40, 16, seed=B), *heads, D, 16)
    w = gpu_wrapper(c, 2, variant, prefill_mma="wgmma", join_levels=join)
    out, lse = gpu_run(c, w, variant)
    assert w.prefill_tile.mma == "wgmma" and w.info.level_prefill_items[0] > 0 and w.info.joined == join
    check_gpu(c, out, lse, REF[variant])
    again, lse2 = gpu_run(c, w, variant)
    assert torch.equal(out, again) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant, join, heads, D, B", [
    ("plain", True, (32, 8), 128, 14), ("causal", False, (32, 8), 128, 14), ("alibi", True, (32, 8), 128, 10),
    ("plain", True, (32, 32), 64, 40)])
def test_gpu_shared_level_at_one_cta_per_sm_matches_float64(variant, join, heads, D, B):
    """prefill_ctas_per_sm=1: the shared level's grid one CTA per SM, the decode level's CTAs with
    items beside it and those without leaving at once (the concurrent and joining builds): float64
    reference with poisoned outputs, and the bits of a second run."""
    import torch
    c = gpu_case(one_prefix_batch(B, 3000, 40, 16, seed=B), *heads, D, 16)
    w = gpu_wrapper(c, 2, variant, join_levels=join, prefill_ctas_per_sm=1)
    out, lse = gpu_run(c, w, variant)
    assert w.planner.prefill.num_ctas == w.device.props.sm_count // heads[1]
    assert w.info.level_prefill_items[0] > 0 and w.info.joined == join
    check_gpu(c, out, lse, REF[variant])
    again, lse2 = gpu_run(c, w, variant)
    assert torch.equal(out, again) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, D, B, prefix", [
    ((64, 8), 128, 128, 2048), ((32, 4), 128, 128, 1024), ((64, 8), 128, 160, 1024), ((32, 8), 64, 256, 1024),
    ((32, 8), 256, 256, 1024), ((32, 8), 256, 128, 1024)])
def test_gpu_fold_of_many_rows_with_few_states_matches_float64(heads, D, B, prefix):
    """Many query rows with 2-5 states each (a short prefix over 128-256 requests, the fold's
    (row, head) jobs 2-8 times its warps): its warps take 2 or 4 jobs a round where the states fit
    (cascade_fold.cuh; at 160 requests the rows' state counts differ within a warp's jobs), one
    otherwise. Float64 reference with poisoned outputs, and the bits of a second run."""
    import torch
    c = gpu_case(one_prefix_batch(B, prefix, 40, 16, seed=B), *heads, D, 16)
    w = gpu_wrapper(c, 2)
    out, lse = gpu_run(c, w)
    jobs, warps = B * heads[0], w.fold_ctas * THREADS // 32
    assert not w.info.joined and jobs > warps and w.info.num_state_rows <= 5 * w.info.num_qo_tokens
    check_gpu(c, out, lse, Variant())
    again, lse2 = gpu_run(c, w)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
