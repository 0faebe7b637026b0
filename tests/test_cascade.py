"""CascadeWrapper. CPU tier: the fake GPU (tests/fakes.py) checks planning into one plan set,
one copy per plan, the kernels' fixed arguments (graphs survive replans), the plan the kernels
would read (run by the float64 executor) and the refusals. GPU tier (marked gpu): the kernels
against float64 and against single-format rtattn on the same cache, bitwise determinism,
graph replay across replans."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rtattn import cascade as C
from rtattn import wrapper as W
from rtattn.level_fold import params_struct
from rtattn.plan.cascade import execute_cascade
from rtattn.plan.reference import Variant, reference_attention
from rtattn.runtime import export

import fakes
from cascade_cases import one_prefix_batch, shared_batch


class FakeCascadeKernels(fakes.FakeKernels):
    pdl_capable = True

    def __init__(self, spec):
        super().__init__(spec)
        self.other = []   # (function, grid, params) of launches past the decode kernel

    def _launch(self, fn, grid, threads, smem, params, stream, pdl):
        self.other.append((fn, grid, params))


@pytest.fixture
def fake_gpu(monkeypatch):
    made, copies = [], []

    def kernels(spec):
        made.append(FakeCascadeKernels(spec))
        return made[-1]

    fakes.install(monkeypatch, kernels, memcpy=lambda dst, src, n, stream=None: copies.append((dst, src, n)))
    monkeypatch.setattr(W, "as_stream", lambda s=None: SimpleNamespace(handle=0))
    for name in ("DeviceBuffer", "PinnedBuffer"):
        monkeypatch.setattr(C, name, fakes.FakeBuffer)
    monkeypatch.setattr(C, "Event", lambda timing=False: SimpleNamespace(record=lambda s=None: None,
                                                                         synchronize=lambda: None))
    monkeypatch.setattr(C, "memcpy_htod_async", lambda dst, src, n, stream=None: copies.append((dst, src, n)))
    monkeypatch.setattr(C, "fold_function", lambda *a: "fold")
    return SimpleNamespace(kernels=made, copies=copies)


def cuda(shape, dtype="bfloat16", ptr=1 << 30):
    return export(ptr, shape, dtype, 0)


def _pinned_bytes(w):
    return w._pinned[w._slot ^ 1].array


def test_plan_is_one_copy_of_one_plan_set_and_the_kernel_reads_it(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(6, 256, 40, 16, seed=1)
    w = C.CascadeWrapper(2, 32, 8, 128, 16, max_batch=8, max_pages=pool + 4)
    info = w.plan(None, kv_indptr, idx, last, share_prefixes=True)
    n = w.planner.planset.plan_bytes
    assert fake_gpu.copies[-1] == (w.workspace_ptr, w._pinned[0].ptr, n) and info.num_levels == 2
    q, o, lse = cuda((6, 32, 128)), cuda((6, 32, 128), ptr=1 << 34), cuda((6, 32), "float32", ptr=1 << 35)
    kc, vc = cuda((pool, 16, 8, 128), ptr=1 << 32), cuda((pool, 16, 8, 128), ptr=1 << 33)
    w.run(q, kc, vc, out=o, lse=lse)
    k = fake_gpu.kernels[0]
    assert k.merges == [False] and k.grids == [(w.kernel.num_ctas, 8)]
    st = k.rendered.params.ctypes_type().from_buffer_copy(k.launches[0])
    assert st.plan.work_indptr == w.workspace_ptr + w.kernel.layout.offsets["work_indptr"]
    assert st.partial_o == w.workspace_ptr + w.kernel.state_o_offset and st.fused_merge == 0
    (fn, grid, fold), = k.other
    f = params_struct("bfloat16").ctypes_type().from_buffer_copy(fold)
    ptrs = w.planner.planset.device_ptrs(w.workspace_ptr)
    assert fn == "fold" and grid == (132 * 2, 1, 1)
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
    w = C.CascadeWrapper(3, 32, 8, 64, 16, max_batch=10, max_pages=200, variant="alibi")
    q, o = cuda((10, 32, 64)), cuda((10, 32, 64), ptr=1 << 34)
    kc, vc = cuda((200, 16, 8, 64), ptr=1 << 32), cuda((200, 16, 8, 64), ptr=1 << 33)
    alibi = cuda((32,), "float32", ptr=1 << 36)
    seen = set()
    for step, groups in enumerate((((3, 2), (2, 1)), ((4, 2),), ((2, 3), (2, 2), (2, 1)))):
        kv_indptr, idx, last, _ = shared_batch(rng, 16, groups=groups, loners=1, pool=200)
        B = len(kv_indptr) - 1
        w.plan(None, kv_indptr, idx, last, share_prefixes=True)
        launch = w.prepare(export(q.ptr, (B, 32, 64), "bfloat16", 0), kc, vc,
                           out=export(o.ptr, (B, 32, 64), "bfloat16", 0), params={"alibi_slopes": alibi})
        seen.add((launch.levels.params, launch.fold_params))
    assert len(seen) == 1
    st = fake_gpu.kernels[0].rendered.params.ctypes_type().from_buffer_copy(next(iter(seen))[0])
    ptrs = w.planner.planset.device_ptrs(w.workspace_ptr)
    assert (st.extra.cascade_q_pos, st.extra.cascade_kv_offset) == (ptrs["q_pos"], ptrs["kv_offset"])
    assert w.spec.variant_type == "rtattn::LevelPositions<rtattn::StandardAttention<false, false, false, true>>"


def test_levels_in_flashinfer_convention(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(4, 64, 20, 16)
    w = C.CascadeWrapper(2, 8, 8, 64, 16, max_batch=4, max_pages=pool)
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


def test_bad_input_is_refused_before_any_launch(fake_gpu):
    kv_indptr, idx, last, pool = one_prefix_batch(4, 64, 20, 16)
    w = C.CascadeWrapper(2, 8, 8, 64, 16, max_batch=4, max_qo_tokens=24, max_pages=pool, variant="causal")
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
    assert fake_gpu.kernels[0].launches == []
