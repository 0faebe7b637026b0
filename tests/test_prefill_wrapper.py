"""BatchPrefillWrapper logic on the CPU (fake device, kernels and memory, as tests/test_wrapper.py
does for decode): refusals before launch, the launch as a list of kernel calls, argument packing
for paged and ragged KV; and (GPU tier) graph replay while the plan changes underneath."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rtattn import prefill_wrapper as PW
from rtattn.plan.layout import indptr_from_lengths, paged_kv
from rtattn.runtime import export

import fakes


@pytest.fixture
def fake_gpu(monkeypatch):
    return SimpleNamespace(kernels=fakes.install_prefill(monkeypatch))


def cuda(shape, dtype="bfloat16", ptr=1 << 30):
    return export(ptr, shape, dtype, 0)


def test_paged_run_packs_pointers_and_enqueues_attention_then_merge(fake_gpu):
    w = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=2048, max_pages=200)
    qo, kv = [700, 300], [700, 1300]
    ip, idx, last = paged_kv(kv, 16, shuffle_seed=1)
    info = w.plan(indptr_from_lengths(qo), ip, idx, last)
    assert info.tile_q == w.tile.rows // 4 and w.tile.tag == "wg_q128_kv32_w8_s3_pp_b2"   # the fake GPU is an H200
    long = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=2, max_qo_tokens=2048, max_pages=2 * 4096 // 16)
    assert long.tile.tag == "ws_q128_kv64_w8_s4_b1"   # KV bound 4096 tokens per request: warp-specialized
    q, k, v, o = (cuda((1000, 32, 128)), cuda((130, 16, 8, 128), ptr=1 << 32), cuda((130, 16, 8, 128), ptr=1 << 33),
                  cuda((1000, 32, 128), ptr=1 << 34))
    w.run(q, k, v, out=o)
    names, grid, params = w.kernels.enqueued[-1]
    assert names == ["attention", "merge"] and grid == (w.num_ctas, 8, 1)
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(params)
    assert (st.q, st.k_cache, st.v_cache, st.o) == (q.ptr, k.ptr, v.ptr, o.ptr)
    assert (st.group_size, st.page_shift, st.k_stride_page, st.k_stride_tok) == (4, 4, 16 * 8 * 128, 8 * 128)


def test_ragged_kv_is_rows_of_one_tensor(fake_gpu):
    w = PW.BatchPrefillWrapper(16, 4, 64, kv_layout="ragged", max_batch=4, max_qo_tokens=512, max_kv_tokens=4096)
    assert w.page_size == 1 and not w.tile.paged
    w.plan(indptr_from_lengths([100, 28]), indptr_from_lengths([1000, 28]))
    q, k, v = cuda((128, 16, 64)), cuda((1028, 4, 64), ptr=1 << 32), cuda((1028, 4, 64), ptr=1 << 33)
    w.run(q, k, v)
    st = w.kernels.rendered.params.ctypes_type().from_buffer_copy(w.kernels.enqueued[-1][2])
    assert (st.k_stride_page, st.k_stride_tok, st.k_stride_head) == (4 * 64, 0, 64)
    with pytest.raises(ValueError, match="k has 1000 tokens"):
        w.run(q, cuda((1000, 4, 64), ptr=1 << 32), v)
    with pytest.raises(ValueError, match="only qo_indptr and kv_indptr"):
        w.plan(indptr_from_lengths([1]), indptr_from_lengths([5]), np.arange(5))
    with pytest.raises(ValueError, match="max_kv_tokens"):
        w.plan(indptr_from_lengths([1]), indptr_from_lengths([5000]))


def test_bad_input_is_refused_naming_the_argument(fake_gpu):
    with pytest.raises(ValueError, match="page_size"):
        PW.BatchPrefillWrapper(32, 8, 128, 256, max_batch=4, max_qo_tokens=64, max_pages=8)
    with pytest.raises(ValueError, match="max_pages"):
        PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=64)
    with pytest.raises(ValueError, match="kv_layout"):
        PW.BatchPrefillWrapper(32, 8, 128, 16, kv_layout="NDH", max_batch=4, max_qo_tokens=64, max_pages=8)
    with pytest.raises(ValueError, match="multiple"):
        PW.BatchPrefillWrapper(30, 8, 128, 16, max_batch=4, max_qo_tokens=64, max_pages=8)
    w = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=64, max_pages=8)
    ip, idx, last = paged_kv([20, 30], 16)
    with pytest.raises(ValueError, match="causal: request 0 has qo_len 21"):
        w.plan(indptr_from_lengths([21, 30]), ip, idx, last)
    with pytest.raises(ValueError, match="kv_indices and kv_last_page_len"):
        w.plan(indptr_from_lengths([20, 30]), ip)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(cuda((50, 32, 128)), cuda((8, 16, 8, 128)), cuda((8, 16, 8, 128)))
    w.plan(indptr_from_lengths([20, 30]), ip, idx, last)
    with pytest.raises(ValueError, match="q"):
        w.run(cuda((49, 32, 128)), cuda((8, 16, 8, 128)), cuda((8, 16, 8, 128)))
    with pytest.raises(TypeError, match="q"):
        w.run(cuda((50, 32, 128), "float16"), cuda((8, 16, 8, 128)), cuda((8, 16, 8, 128)))
    with pytest.raises(ValueError, match="v_cache"):
        w.run(cuda((50, 32, 128)), cuda((8, 16, 8, 128)), cuda((8, 16, 4, 128)))
    with pytest.raises(ValueError, match="k_cache holds 2 pages"):
        w.run(cuda((50, 32, 128)), cuda((2, 16, 8, 128)), cuda((2, 16, 8, 128)))
    with pytest.raises(ValueError, match="variant 'causal' takes parameters"):
        w.run(cuda((50, 32, 128)), cuda((8, 16, 8, 128)), cuda((8, 16, 8, 128)), params={"soft_cap": 1.0})
    huge = export(1 << 32, (8, 16, 8, 128), "bfloat16", 0, (2**31, 8 * 128, 128, 1))  # 4 GiB per page
    with pytest.raises(ValueError, match="k_cache: page and token strides"):
        w.run(cuda((50, 32, 128)), huge, cuda((8, 16, 8, 128)))
    w.run(cuda((50, 32, 128)), export(1 << 32, (8, 16, 8, 128), "bfloat16", 0, (2**31 - 8, 8 * 128, 128, 1)),
          cuda((8, 16, 8, 128)))   # just under 2**32 bytes: accepted


def test_run_is_the_decode_fast_path(fake_gpu):
    """run() imports each tensor object once (TensorImports) and rebinds one prepared launch,
    writing only the per-call members; a new tensor object changes only its own pointer."""
    w = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=64, max_pages=8)
    ip, idx, last = paged_kv([20, 30], 16)
    w.plan(indptr_from_lengths([20, 30]), ip, idx, last)
    q, k, v = cuda((50, 32, 128)), cuda((8, 16, 8, 128), ptr=1 << 32), cuda((8, 16, 8, 128), ptr=1 << 33)
    o1, o2 = cuda((50, 32, 128), ptr=1 << 34), cuda((50, 32, 128), ptr=1 << 35)
    w.run(q, k, v, out=o1)
    launch, imports = w._reusable(), w._imports.imports
    w.run(q, k, v, out=o1)
    assert w._imports.imports == imports and w._reusable() is launch
    w.run(q, k, v, out=o2)
    assert w._imports.imports == imports + 1
    first, second, third = (w.kernels.rendered.params.ctypes_type().from_buffer_copy(e[2])
                            for e in w.kernels.enqueued[-3:])
    assert bytes(first) == bytes(second) and (third.o, third.q) == (o2.ptr, q.ptr)
    assert bytes(w.kernels.enqueued[-1][2]) == bytes(launch.args)


def test_prepare_takes_max_batch_tensors_and_refuses_a_larger_plan(fake_gpu):
    w = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=128, max_pages=16)
    ip, idx, last = paged_kv([20, 30], 16)
    w.plan(indptr_from_lengths([20, 30]), ip, idx, last)
    q, k, v = cuda((64, 32, 128)), cuda((16, 16, 8, 128), ptr=1 << 32), cuda((16, 16, 8, 128), ptr=1 << 33)
    launch = w.prepare(q, k, v, out=cuda((64, 32, 128), ptr=1 << 34))
    launch()
    with pytest.raises(ValueError, match="q has shape"):
        w.run(q, k, v)                     # run() is exact
    ip, idx, last = paged_kv([40, 30], 16)
    w.plan(indptr_from_lengths([40, 30]), ip, idx, last)
    with pytest.raises(ValueError, match="prepared with 64 query tokens"):
        launch()


@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_misaligned_out_is_refused(fake_gpu, monkeypatch, family):
    """out is written two elements at a time: a 2-byte aligned out is refused before launch
    (shared by both wrappers)."""
    from rtattn.wrapper import BatchDecodeWrapper
    fakes.install(monkeypatch, fakes.FakeKernels)
    ip, idx, last = paged_kv([20, 30], 16)
    if family == "decode":
        w = BatchDecodeWrapper(32, 8, 128, 16, max_batch=4, max_pages=8)
        w.plan(ip, idx, last)
        n = 2
    else:
        w = PW.BatchPrefillWrapper(32, 8, 128, 16, max_batch=4, max_qo_tokens=64, max_pages=8)
        w.plan(indptr_from_lengths([20, 30]), ip, idx, last)
        n = 50
    q, k, v = cuda((n, 32, 128)), cuda((8, 16, 8, 128), ptr=1 << 32), cuda((8, 16, 8, 128), ptr=1 << 33)
    with pytest.raises(ValueError, match="out: base pointer and strides must be 4-byte aligned"):
        w.run(q, k, v, out=cuda((n, 32, 128), ptr=(1 << 34) + 2))


# ----------------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
def test_graph_replay_follows_the_plan():
    """One captured launch (DecodeGraphs.replay takes any prepared Launch) replays correctly
    after plan() changes lengths and page tables underneath: same buffers, same kernel arguments,
    one capture."""
    import torch
    from decode_cases import rel_error
    from rtattn.graphs.decode_graphs import DecodeGraphs
    from rtattn.plan import reference as ref
    H, Hk, D, ps, pool = 16, 4, 128, 16, 200
    gen = torch.Generator(device="cuda").manual_seed(8)
    k = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(1024, H, D, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty(1024, H, D, dtype=torch.bfloat16, device="cuda")
    w = PW.BatchPrefillWrapper(H, Hk, D, ps, max_batch=8, max_qo_tokens=1024, max_pages=pool)
    g = DecodeGraphs(w, max_execs=1)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(8)
    for qo, kv in (([900, 40, 12], [900, 40, 300]), ([200, 3, 77, 5], [200, 1000, 77, 5])):
        ip, _, last = paged_kv(kv, ps)
        idx = rng.permutation(pool)[: int(ip[-1])].astype(np.int32)
        qi, T = indptr_from_lengths(qo), sum(qo)
        w.plan(qi, ip, idx, last, stream=stream)
        out.fill_(float("nan"))
        g.replay(w.prepare(q[:T], k, v, out=out[:T], stream=stream), stream)
        stream.synchronize()
        f64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
        want, _ = ref.reference_attention(f64(q[:T]), f64(k), f64(v), qi, ip, idx, last, ps, ref.Variant(causal=True))
        assert rel_error(out[:T].float().cpu().numpy(), want) < 2e-2
    assert g.stats["captures"] == 1 and g.stats["replays"] == 2


@pytest.mark.gpu
def test_step_graph_mixing_decode_and_prefill():
    """One StepGraph holds a decode launch and a prefill launch on the same caches; both
    wrappers replan with new lengths and the replayed graph gives both right answers."""
    import torch
    from decode_cases import rel_error
    from rtattn.graphs.step_graph import StepGraph
    from rtattn.plan import reference as ref
    from rtattn.wrapper import BatchDecodeWrapper
    H, Hk, D, ps, pool = 16, 4, 128, 16, 300
    gen = torch.Generator(device="cuda").manual_seed(9)
    k = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    q_dec = torch.randn(8, H, D, generator=gen, device="cuda").to(torch.bfloat16)
    q_pre = torch.randn(1024, H, D, generator=gen, device="cuda").to(torch.bfloat16)
    o_dec, o_pre = torch.empty_like(q_dec), torch.empty_like(q_pre)
    dec = BatchDecodeWrapper(H, Hk, D, ps, max_batch=8, max_pages=pool, num_pages_pool=pool)
    pre = PW.BatchPrefillWrapper(H, Hk, D, ps, max_batch=8, max_qo_tokens=1024, max_pages=pool, num_pages_pool=pool)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(9)
    f64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
    graph = None
    for dec_kv, pre_qo, pre_kv in (([700, 33, 2000], [500, 7], [500, 900]), ([90, 1500], [300, 60, 1], [300, 800, 40])):
        dip, _, dlast = paged_kv(dec_kv, ps)
        didx = rng.permutation(pool)[: int(dip[-1])].astype(np.int32)
        pip, _, plast = paged_kv(pre_kv, ps)
        pidx = rng.permutation(pool)[: int(pip[-1])].astype(np.int32)
        B, T = len(dec_kv), sum(pre_qo)
        dec.plan(dip, didx, dlast, stream=stream)
        pre.plan(indptr_from_lengths(pre_qo), pip, pidx, plast, stream=stream)
        if graph is None:   # the tensors' shapes follow the batch; their pointers do not
            graph = StepGraph([dec.prepare(q_dec[:B], k, v, out=o_dec[:B], stream=stream),
                               pre.prepare(q_pre[:T], k, v, out=o_pre[:T], stream=stream)], stream)
        o_dec.fill_(float("nan"))
        o_pre.fill_(float("nan"))
        graph.replay()
        stream.synchronize()
        want, _ = ref.reference_attention(f64(q_dec[:B]), f64(k), f64(v), np.arange(B + 1, dtype=np.int32), dip,
                                          didx, dlast, ps)
        assert rel_error(o_dec[:B].float().cpu().numpy(), want) < 2e-2
        want, _ = ref.reference_attention(f64(q_pre[:T]), f64(k), f64(v), indptr_from_lengths(pre_qo), pip, pidx,
                                          plast, ps, ref.Variant(causal=True))
        assert rel_error(o_pre[:T].float().cpu().numpy(), want) < 2e-2
    graph.close()


@pytest.mark.gpu
def test_decode_graphs_step_runs_the_prefill_wrapper():
    """DecodeGraphs(p).step() (the per-layer graph path) takes the prefill wrapper as it takes
    decode's: right answers across two plans, one exec updated in place."""
    import torch
    from decode_cases import rel_error
    from rtattn.graphs.decode_graphs import DecodeGraphs
    from rtattn.plan import reference as ref
    H, Hk, D, ps, pool = 16, 4, 128, 16, 200
    gen = torch.Generator(device="cuda").manual_seed(10)
    k = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(pool, ps, Hk, D, generator=gen, device="cuda").to(torch.bfloat16)
    w = PW.BatchPrefillWrapper(H, Hk, D, ps, max_batch=8, max_qo_tokens=1024, max_pages=pool)
    g = DecodeGraphs(w, max_execs=1)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(10)
    f64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
    for qo, kv in (([4, 4, 4], [900, 40, 300]), ([300, 3, 77], [300, 1000, 77])):
        ip, _, last = paged_kv(kv, ps)
        idx = rng.permutation(pool)[: int(ip[-1])].astype(np.int32)
        qi, T = indptr_from_lengths(qo), sum(qo)
        q = torch.randn(T, H, D, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        w.plan(qi, ip, idx, last, stream=stream)
        g.step(q, k, v, out=out, stream=stream)
        stream.synchronize()
        want, _ = ref.reference_attention(f64(q), f64(k), f64(v), qi, ip, idx, last, ps, ref.Variant(causal=True))
        assert rel_error(out.float().cpu().numpy(), want) < 2e-2
    assert g.stats["replays"] == 2


def test_queue_order_reaches_the_planner(fake_gpu):
    qo = kv = [1024] * 16
    ip, idx, last = paged_kv(kv, 16, shuffle_seed=2)
    plans = {}
    for order in ("lpt", "request"):
        w = PW.BatchPrefillWrapper(32, 32, 128, 16, max_batch=16, max_qo_tokens=16384, max_pages=1024,
                                   queue_order=order)
        assert w.planner.queue_order == order
        plans[order] = w.plan(indptr_from_lengths(qo), ip, idx, last)
    assert plans["lpt"].queue_order == "lpt" and plans["request"].queue_order == "request"
    assert plans["request"].max_load == plans["lpt"].max_load   # equal requests: balanced either way
    with pytest.raises(ValueError, match="queue_order"):
        PW.BatchPrefillWrapper(32, 32, 128, 16, max_batch=16, max_qo_tokens=16384, max_pages=1024, queue_order="x")
