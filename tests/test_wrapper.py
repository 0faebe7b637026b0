"""BatchDecodeWrapper logic on the CPU: the device, kernels and memory are replaced by fakes, so
validation, planning and argument packing are tested without a GPU (the GPU tier runs them for real)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rtattn import wrapper as W
from rtattn.codegen import spec as S
from rtattn.families.decode import render
from rtattn.plan.layout import paged_kv
from rtattn.runtime import export

import fakes
from fakes import FakeKernels


@pytest.fixture
def fake_gpu(monkeypatch):
    made = []

    def kernels(spec):
        made.append(FakeKernels(spec))
        return made[-1]

    copies = []
    fakes.install(monkeypatch, kernels, memcpy=lambda dst, src, n, stream=None, device=None: copies.append((dst, src, n)))
    return SimpleNamespace(kernels=made, copies=copies)


def cuda(shape, dtype="bfloat16", ptr=1 << 30, strides=None):
    return export(ptr, shape, dtype, 0, strides=strides)


def _wrapper(**kw):
    args = dict(max_batch=8, max_pages=64)
    args.update(kw)
    return W.BatchDecodeWrapper(32, 8, 128, 16, **args)


def test_plan_copies_the_plan_once_and_run_packs_every_pointer(fake_gpu):
    w = _wrapper()
    kv_indptr, kv_indices, last = paged_kv([100, 20, 300], 16, shuffle_seed=1)
    info = w.plan(kv_indptr, kv_indices, last)
    assert info.batch == 3 and fake_gpu.copies == [(w.workspace_ptr, w.pinned.ptr, w.layout.plan_bytes)]
    first = w.pinned
    info2 = w.plan(*paged_kv([7, 9, 11, 13], 16, shuffle_seed=2))   # double-buffered: the other pinned buffer
    assert w.pinned is not first and fake_gpu.copies[1] == (w.workspace_ptr, w.pinned.ptr, w.layout.plan_bytes)
    assert info2.batch == 4 and info.views["plan_info"][3] == 3   # step 1's plan untouched by step 2's
    w.plan(kv_indptr, kv_indices, last)
    assert w.pinned is first
    q, k, v, o = cuda((3, 32, 128)), cuda((40, 16, 8, 128), ptr=1 << 32), cuda((40, 16, 8, 128), ptr=1 << 33), \
        cuda((3, 32, 128), ptr=1 << 34)
    out = w.run(q, k, v, out=o)
    assert out is o
    params, (num_ctas, grid_y) = fake_gpu.kernels[0].launches[0], fake_gpu.kernels[0].grids[0]
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(params)
    assert (st.q, st.k_cache, st.v_cache, st.o, st.lse) == (q.ptr, k.ptr, v.ptr, o.ptr, None)
    assert (st.k_stride_page, st.k_stride_tok, st.k_stride_head) == (16 * 8 * 128, 8 * 128, 128)
    assert st.plan.work_indptr == w.workspace_ptr + w.layout.offsets["work_indptr"]
    assert st.group_size == 4 and st.page_shift == 4 and (num_ctas, grid_y) == (w.num_ctas, 8)
    assert abs(st.sm_scale - 128 ** -0.5) < 1e-7


def test_hnd_layout_and_combined_kv_cache(fake_gpu):
    w = _wrapper(kv_layout="HND")
    w.plan(*paged_kv([40], 16))
    kv = cuda((5, 2, 8, 16, 128), ptr=1 << 32)
    w.run(cuda((1, 32, 128)), kv, out=cuda((1, 32, 128), ptr=1 << 34))
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(fake_gpu.kernels[0].launches[0])
    assert st.k_cache == kv.ptr and st.v_cache == kv.ptr + 8 * 16 * 128 * 2
    assert (st.k_stride_page, st.k_stride_tok, st.k_stride_head) == (2 * 8 * 16 * 128, 128, 16 * 128)


@pytest.mark.parametrize("bad, match", [
    (dict(q=cuda((3, 32, 64))), r"q has shape"),
    (dict(q=cuda((3, 32, 128), dtype="float16")), "dtype float16"),
    (dict(k=cuda((2, 16, 8, 128), ptr=1 << 32)), "holds 2 pages"),
    (dict(k=cuda((40, 16, 8, 128), ptr=(1 << 32) + 8)), "16-byte aligned"),
    (dict(q=cuda((3, 32, 128), strides=(32 * 128 + 4, 128, 1))), "q: base pointer and strides"),
    (dict(q=np.zeros((3, 32, 128), np.float16)), "CUDA device memory"),
    (dict(o=cuda((3, 32, 128), ptr=1 << 34, strides=(4096, 1, 32))), "contiguous"),
])
def test_bad_tensors_are_refused_before_launch(fake_gpu, bad, match):
    w = _wrapper()
    w.plan(*paged_kv([100, 20, 300], 16))
    t = dict(q=cuda((3, 32, 128)), k=cuda((40, 16, 8, 128), ptr=1 << 32), v=cuda((40, 16, 8, 128), ptr=1 << 33),
             o=cuda((3, 32, 128), ptr=1 << 34))
    t.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        w.run(t["q"], t["k"], t["v"], out=t["o"])
    assert fake_gpu.kernels[0].launches == []


def test_run_before_plan_and_bad_construction(fake_gpu):
    w = _wrapper()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(cuda((1, 32, 128)), cuda((4, 16, 8, 128)), cuda((4, 16, 8, 128)))
    with pytest.raises(ValueError, match="power of two"):
        W.BatchDecodeWrapper(32, 8, 128, 12, max_batch=4, max_pages=8)
    with pytest.raises(ValueError, match="multiple"):
        W.BatchDecodeWrapper(30, 8, 128, 16, max_batch=4, max_pages=8)
    with pytest.raises(ValueError, match="unknown variant"):
        W.BatchDecodeWrapper(32, 8, 128, 16, max_batch=4, max_pages=8, variant="nope")


def test_variant_parameters_are_checked_and_packed(fake_gpu):
    w = _wrapper(variant="soft_cap")
    w.plan(*paged_kv([10], 16))
    args = (cuda((1, 32, 128)), cuda((4, 16, 8, 128), ptr=1 << 32), cuda((4, 16, 8, 128), ptr=1 << 33))
    with pytest.raises(ValueError, match="missing"):
        w.run(*args, out=cuda((1, 32, 128), ptr=1 << 34))
    w.run(*args, out=cuda((1, 32, 128), ptr=1 << 34), params={"soft_cap": 30.0})
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(fake_gpu.kernels[0].launches[0])
    assert st.extra.soft_cap == 30.0


def test_plan_bounds_are_enforced(fake_gpu):
    w = _wrapper(max_batch=2)
    with pytest.raises(ValueError, match="max_batch"):
        w.plan(*paged_kv([10, 10, 10], 16))


def test_decode_kernels_calls_without_a_gpu():
    """DecodeKernels.calls: decode grid (ctas, kv heads), then the merge kernel when asked, both
    reading one argument buffer; PDL only where the device has it."""
    from rtattn.codegen.spec import standard
    from rtattn.kernels import DecodeKernels
    from rtattn.runtime.launch import Params

    k = object.__new__(DecodeKernels)
    k.rendered = render(standard(), "h200")
    k.kernel, k.merge = SimpleNamespace(handle=0xD0, name="decode"), SimpleNamespace(handle=0xE0, name="merge")
    k.merge_ctas, k.pdl_capable = 264, False
    p = Params(64)
    r = k.rendered
    both, one = k.calls(p, 33, 8, merge=True), k.calls(p, 33, 8, merge=False)
    assert [(c.func, c.grid, c.block, c.smem, c.pdl) for c in both] == [
        (0xD0, (33, 8, 1), (r.threads, 1, 1), r.smem_bytes, False), (0xE0, (264, 1, 1), (256, 1, 1), 0, False)]
    assert all(c.params is p for c in both) and [c.func for c in one] == [0xD0]
    k.pdl_capable = True
    assert all(c.pdl for c in k.calls(p, 33, 8)) and not any(c.pdl for c in k.calls(p, 33, 8, pdl=False))


def test_num_ctas_override_sets_the_grid_and_the_plan(fake_gpu):
    w = _wrapper(num_ctas=5)
    assert w.num_ctas == 5 and w.planner.num_ctas == 5
    info = w.plan(*paged_kv([100, 20, 300], 16, shuffle_seed=1))
    assert len(info.views["work_indptr"]) == 6     # one queue per CTA column
    q, k, v = cuda((3, 32, 128)), cuda((40, 16, 8, 128), ptr=1 << 32), cuda((40, 16, 8, 128), ptr=1 << 33)
    w.run(q, k, v, out=cuda((3, 32, 128), ptr=1 << 34))
    assert fake_gpu.kernels[-1].grids[-1] == (5, 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="num_ctas"):
            _wrapper(num_ctas=bad)


@pytest.mark.parametrize("fused", [False, True])
def test_fused_merge_packs_counters_and_skips_the_merge_kernel(fake_gpu, fused):
    w = _wrapper(fused_merge=fused, max_pages=600)
    w.plan(*paged_kv([3000, 20, 5000], 16, shuffle_seed=1))
    assert w.info.num_merge_rows > 0
    w.run(cuda((3, 32, 128)), cuda((700, 16, 8, 128), ptr=1 << 32), cuda((700, 16, 8, 128), ptr=1 << 33),
          out=cuda((3, 32, 128), ptr=1 << 34))
    k = fake_gpu.kernels[-1]
    st = k.rendered.params.ctypes_type().from_buffer_copy(k.launches[-1])
    assert st.fused_merge == int(fused) and k.merges[-1] == (not fused)
    assert st.merge_counters == w.workspace_ptr + w.layout.merge_counters_offset(32, 128)
    assert w.planner.workspace_bytes() >= w.layout.merge_counters_offset(32, 128) + 4 * 32


def test_run_launches_the_merge_kernel_only_for_a_plan_with_merge_rows(fake_gpu):
    """run() follows the plan: no merge rows, no merge kernel (it would find nothing to do), and
    the argument struct is the same either way; prepare() keeps the merge for later plans."""
    w = _wrapper(max_pages=600)
    t = (cuda((3, 32, 128)), cuda((700, 16, 8, 128), ptr=1 << 32), cuda((700, 16, 8, 128), ptr=1 << 33))
    o = cuda((3, 32, 128), ptr=1 << 34)
    k = fake_gpu.kernels[-1]
    for kv, split in (([3000, 20, 5000], True), ([30, 20, 50], False), ([3000, 20, 5000], True)):
        w.plan(*paged_kv(kv, 16, shuffle_seed=1))
        assert (w.info.num_merge_rows > 0) == split
        w.run(*t, out=o)
        assert k.merges[-1] == split
        assert k.launches[-1] == bytes(w.prepare(*t, out=o).args)
    w.plan(*paged_kv([30, 20, 50], 16, shuffle_seed=1))
    w.prepare(*t, out=o)()
    assert k.merges[-1]   # under an unsplit plan, the replayable launch still merges


def _tensors(pages, n=3):
    return (cuda((n, 32, 128)), cuda((pages, 16, 8, 128), ptr=1 << 32), cuda((pages, 16, 8, 128), ptr=1 << 33),
            cuda((n, 32, 128), ptr=1 << 34))


def test_replay_after_an_out_of_pool_replan_is_impossible(fake_gpu):
    """A launch prepared on 40-page caches keeps replaying whatever plan is in the workspace, so
    plan() must refuse page 40 before it writes the pinned buffer or queues the copy."""
    w = _wrapper()
    kvp, idx, last = paged_kv([100, 20, 300], 16, shuffle_seed=1)   # pages 0..27
    w.plan(kvp, idx, last)
    q, k, v, o = _tensors(40)
    launch = w.prepare(q, k, v, out=o)
    assert w.planner.num_pages_pool == 40
    idx_bad = idx.copy()
    idx_bad[5] = 40
    pinned = [b.array.copy() for b in w._pinned]
    copies, info = len(fake_gpu.copies), w.info
    with pytest.raises(ValueError, match=r"kv_indices\[5\] = 40 is outside the page pool \[0, 40\)"):
        w.plan(kvp, idx_bad, last)
    assert len(fake_gpu.copies) == copies and w.info is info          # nothing queued
    assert all((b.array == p).all() for b, p in zip(w._pinned, pinned))  # nothing written
    launch()                                                           # still the valid plan
    idx_ok = idx.copy()
    idx_ok[5] = 39
    w.plan(kvp, idx_ok, last)                                          # in the pool: fine
    assert len(fake_gpu.copies) == copies + 1


def test_the_pool_is_the_smallest_cache_and_can_be_given(fake_gpu):
    w = _wrapper()
    kvp, idx, last = paged_kv([100, 20, 300], 16)   # pages 0..27
    w.plan(kvp, idx, last)
    w.prepare(*_tensors(40)[:3], out=_tensors(40)[3])
    w.prepare(*_tensors(30)[:3], out=_tensors(30)[3])   # a smaller cache shrinks the pool
    w.prepare(*_tensors(64)[:3], out=_tensors(64)[3])   # a larger one does not grow it
    assert w.planner.num_pages_pool == 30
    with pytest.raises(ValueError, match=r"holds 20 pages but the plan reads page 27"):
        w.prepare(*_tensors(20)[:3], out=_tensors(20)[3])
    with pytest.raises(ValueError, match="page pool"):
        w.plan(*paged_kv([16 * 31], 16))
    g = _wrapper(num_pages_pool=50)
    with pytest.raises(ValueError, match=r"kv_indices\[0\] = 50 is outside the page pool \[0, 50\)"):
        g.plan(np.array([0, 1], np.int32), np.array([50], np.int32), np.array([3], np.int32))
    g.plan(kvp, idx, last)
    with pytest.raises(ValueError, match="fewer than num_pages_pool=50"):
        g.prepare(*_tensors(40)[:3], out=_tensors(40)[3])
    for bad in (0, 2.0):
        with pytest.raises((ValueError, TypeError), match="num_pages_pool"):
            _wrapper(num_pages_pool=bad)


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=0), "head_dim"), (dict(head_dim=100), "head_dim=100 is not supported"),
    (dict(page_size=3), "power of two"), (dict(page_size=0), "page_size"),
    (dict(num_ctas=0), "num_ctas must be >= 1"), (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(max_qo_tokens=0), "max_qo_tokens must be >= 1"),
])
def test_bad_configuration_is_refused_with_its_name(fake_gpu, kw, match):
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, max_batch=4, max_pages=8)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        W.BatchDecodeWrapper(**args)


def _args():
    return (cuda((1, 32, 128)), cuda((4, 16, 8, 128), ptr=1 << 32), cuda((4, 16, 8, 128), ptr=1 << 33))


def test_window_is_planned_and_run_refuses_another(fake_gpu):
    w = _wrapper(variant="sliding_window")
    with pytest.raises(ValueError, match="window_left: variant 'window' has a sliding window"):
        w.plan(*paged_kv([50], 16))
    with pytest.raises(ValueError, match="window_left=-2 is negative"):
        w.plan(*paged_kv([50], 16), window_left=-2)
    info = w.plan(*paged_kv([50], 16), window_left=20)
    assert info.planned_kv_tokens == 50 - 16        # KV 16..49: q_pos 49 - 20 = 29, down to page 16
    o = cuda((1, 32, 128), ptr=1 << 34)
    with pytest.raises(ValueError, match=r"params\['window_left'\]=21 disagrees with the planned window_left=20"):
        w.run(*_args(), out=o, params={"window_left": 21})
    assert fake_gpu.kernels[0].launches == []
    w.run(*_args(), out=o)                            # the window comes from the plan
    w.run(*_args(), out=o, params={"window_left": 20})
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(fake_gpu.kernels[0].launches[0])
    assert st.extra.window_left == 20
    launch = w.prepare(*_args(), out=o)
    w.plan(*paged_kv([50], 16), window_left=30)
    with pytest.raises(ValueError, match="prepared for window 20"):
        launch()
    plain = _wrapper()
    with pytest.raises(ValueError, match="has no sliding window"):
        plain.plan(*paged_kv([50], 16), window_left=5)


def test_variant_properties_reach_the_planner(fake_gpu):
    assert _wrapper(variant="causal").planner.causal
    assert not _wrapper(variant="sliding_window").planner.causal
    from rtattn.codegen import spec as S
    s = S.custom_variant("my_causal_mask", "struct M : rtattn::VariantBase {};", "M", causal=True)
    assert _wrapper(variant=s).planner.causal and s.variant == "my_causal_mask"


@pytest.mark.parametrize("bad, err, match", [
    (cuda((16,), dtype="float32", ptr=1 << 35), ValueError, r"params\['sinks'\] has shape \[16\], expected \[32\]"),
    (cuda((32,), dtype="bfloat16", ptr=1 << 35), TypeError, r"params\['sinks'\] has dtype bfloat16"),
    (cuda((32,), dtype="float32", ptr=1 << 35, strides=(2,)), ValueError, "must be contiguous"),
    (np.zeros(32, np.float32), ValueError, "CUDA device memory"),
])
def test_sinks_are_checked(fake_gpu, bad, err, match):
    w = _wrapper(variant="sinks")
    w.plan(*paged_kv([10], 16))
    with pytest.raises(err, match=match):
        w.run(*_args(), out=cuda((1, 32, 128), ptr=1 << 34), params={"sinks": bad})
    w.run(*_args(), out=cuda((1, 32, 128), ptr=1 << 34), params={"sinks": cuda((32,), "float32", ptr=1 << 35)})
    assert len(fake_gpu.kernels[0].launches) == 1


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_soft_cap_must_be_positive(fake_gpu, cap):
    w = _wrapper(variant="soft_cap")
    w.plan(*paged_kv([10], 16))
    with pytest.raises(ValueError, match="soft_cap"):
        w.run(*_args(), out=cuda((1, 32, 128), ptr=1 << 34), params={"soft_cap": cap})
def test_run_imports_each_tensor_once_and_packs_what_prepare_packs(fake_gpu):
    w = _wrapper(max_pages=600)
    w.plan(*paged_kv([100, 20, 300], 16, shuffle_seed=1))
    q, k, v, o = cuda((3, 32, 128)), cuda((40, 16, 8, 128), ptr=1 << 32), cuda((40, 16, 8, 128), ptr=1 << 33), \
        cuda((3, 32, 128), ptr=1 << 34)
    lse = cuda((3, 32), "float32", ptr=1 << 35)
    for _ in range(3):
        w.run(q, k, v, out=o, lse=lse, sm_scale=0.5)
    k_run = fake_gpu.kernels[0]
    assert w._imports.imports == 5 and w._imports.reuses == 10
    assert k_run.launches[0] == k_run.launches[2] == w.prepare(q, k, v, out=o, lse=lse, sm_scale=0.5).params
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(k_run.launches[0])
    assert (st.lse, st.sm_scale) == (lse.ptr, 0.5) and abs(st.sm_scale_log2 - 0.5 / np.log(2)) < 1e-6
    w.run(q, k, v, out=o)          # the same buffer, other arguments: nothing left from the last call
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(k_run.launches[-1])
    assert st.lse is None and abs(st.sm_scale - 128 ** -0.5) < 1e-7
    # what depends on the plan is checked on every call, with the tensors' cached imports
    w.plan(*paged_kv([100, 20, 300, 8], 16, shuffle_seed=1))
    with pytest.raises(ValueError, match=r"q has shape \[3, 32, 128\], expected \[4, 32, 128\]"):
        w.run(q, k, v, out=o)
    with pytest.raises(ValueError, match="outside the page pool"):    # the pool learnt from the caches
        w.plan(*paged_kv([3000, 20, 5000], 16, shuffle_seed=1))
    w.plan(*paged_kv([100, 20, 300], 16, shuffle_seed=1))             # reads pages 0..27
    n = len(k_run.launches)
    with pytest.raises(ValueError, match="k_cache holds 20 pages but the plan reads page 27"):
        w.run(q, cuda((20, 16, 8, 128), ptr=1 << 32), v, out=o)
    assert len(k_run.launches) == n


def test_run_converts_a_foreign_stream_once_and_still_refuses_scales_per_call(fake_gpu):
    class TorchStream:
        reads = 0

        @property
        def cuda_stream(self):
            TorchStream.reads += 1
            return 0x7300
    w = _wrapper()
    w.plan(*paged_kv([10], 16))
    s = TorchStream()
    for _ in range(3):
        w.run(*_args(), out=cuda((1, 32, 128), ptr=1 << 34), stream=s)
    assert TorchStream.reads == 1 and len(fake_gpu.kernels[0].launches) == 3
    with pytest.raises(ValueError, match="k_scale applies to fp8"):   # the no-scales shortcut skips no check
        w.run(*_args(), out=cuda((1, 32, 128), ptr=1 << 34), stream=s, k_scale=0.5)
    assert len(fake_gpu.kernels[0].launches) == 3


def test_a_view_changed_in_place_is_validated_again(fake_gpu):
    w = _wrapper()
    w.plan(*paged_kv([100, 20, 300], 16))
    q, k, v, o = cuda((3, 32, 128)), cuda((40, 16, 8, 128), ptr=1 << 32), cuda((40, 16, 8, 128), ptr=1 << 33), \
        cuda((3, 32, 128), ptr=1 << 34)
    w.run(q, k, v, out=o)
    q.ptr += 8                      # misaligned now: the fingerprint changed, the checks run again
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(q, k, v, out=o)
    q.ptr += 8
    w.run(q, k, v, out=o)
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(fake_gpu.kernels[0].launches[-1])
    assert st.q == q.ptr


def test_batch_invariant_builds_the_folding_kernel_and_plans_chunk_runs(fake_gpu):
    """mode="batch-invariant": the decode kernel's invariant build (its own name, the fold state
    in shared memory), chunk-run plans (chunk_tokens in the plan header, items on chunk
    boundaries), and a chunk that does not start kernel blocks refused before anything runs."""
    from rtattn.families.decode import smem_bytes as decode_smem_bytes
    from rtattn.plan import fields as F
    w = _wrapper(mode="batch-invariant", max_pages=600)
    auto = _wrapper(max_pages=600)
    assert w.spec.invariant and not auto.spec.invariant and w.spec.uri == auto.spec.uri + "_inv"
    assert w.kernels.rendered.smem_bytes == decode_smem_bytes(auto.spec) + 16 * (128 + 4) * 4   # o, (m, l) twice
    info = w.plan(*paged_kv([3000, 20, 5000], 16, shuffle_seed=1))
    C = w.planner.bounds.chunk_tokens
    assert info.views["plan_info"][F.INFO_CHUNK_TOKENS] == C == 128 and info.num_merge_rows > 0
    assert (info.views["item_kv_start"][:info.num_items] % C == 0).all()
    assert auto.plan(*paged_kv([3000, 20, 5000], 16, shuffle_seed=1)).views["plan_info"][F.INFO_CHUNK_TOKENS] == 0
    w.run(*_tensors(700)[:3], out=_tensors(700)[3])
    assert fake_gpu.kernels[0].merges[-1]   # split rows: the merge kernel (its invariant build) follows
    with pytest.raises(ValueError, match="not a multiple of the decode kernel's KV block"):
        W.BatchDecodeWrapper(32, 8, 128, 16, max_batch=8, max_pages=64, mode="batch-invariant",
                             variant=S.standard(num_warps=8), chunk_tokens=64)
