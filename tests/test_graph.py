"""CUDA graphs of the decode wrapper: capture / instantiate / update / replay.

CPU tier: legacy-stream refusal, no-device refusal, and DecodeGraphs' pool logic (replay vs
instantiate vs in-place update vs re-instantiate) with the wrapper's device and the graph API
replaced by fakes. GPU tier (-m gpu): graph replay against eager runs and the float64
reference, across re-plans (requests finishing and joining), pointer changes (update path),
with outputs poisoned before every replay.
"""
from __future__ import annotations

from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest

from rtattn import wrapper as W
from rtattn.graphs import decode_graphs as DG
from rtattn.graphs import graph as G
from rtattn.graphs.device_arrays import DeviceArray, bf16_bits_to_f32, f32_to_bf16_bits, rounded
from rtattn.plan.layout import paged_kv
from rtattn.runtime import NoDeviceError, Stream, export, has_device

import fakes as fakes_mod
from fakes import FakeKernels


# =============================================================================== CPU tier
def test_capture_on_the_legacy_stream_is_refused():
    called = []
    for s in (None, 0, 1, Stream.default()):
        with pytest.raises(G.GraphCaptureError, match="legacy default stream"):
            G.capture(lambda: called.append(1), s)
    assert called == []  # refused before anything ran


@pytest.mark.skipif(has_device(), reason="checks the GPU-less path")
def test_capture_without_a_device_raises_no_device_error():
    with pytest.raises(NoDeviceError, match="cannot capture"):
        G.capture(lambda: None, 0x1234)


def test_bf16_round_trip_rounds_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, 3.14159], np.float32)
    b = f32_to_bf16_bits(x)
    assert [int(v) for v in b] == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0x4049]
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]
    assert rounded(x[:4], "bfloat16").tolist() == [1.0, 1.0, 1.015625, -2.5]


# ---- fakes: a wrapper whose device/kernels are fake, and a fake graph API
class FakeGraph:
    def __init__(self, calls: list):
        self.calls = list(calls)     # (KernelCall, argument bytes) per captured kernel
        self.destroyed = False

    def instantiate(self):
        return FakeExec(self)

    def destroy(self):
        self.destroyed = True


class FakeExec:
    refuse_update = False

    def __init__(self, graph):
        self.graph, self.nodes = graph, [c for c, _ in graph.calls]
        self.params = [p for _, p in graph.calls]
        self.launched, self.destroyed = 0, False

    def kernel_nodes(self):
        return [G.KernelNode(i, c.func, c.grid, c.block, c.smem) for i, c in enumerate(self.nodes)]

    matches = G.GraphExec.matches

    def set_call_params(self, i, call):
        self.params[i] = bytes(call.params)

    def update(self, graph):
        if FakeExec.refuse_update or len(graph.calls) != len(self.params):
            return G.UpdateResult(False, "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED")
        self.params = [p for _, p in graph.calls]
        return G.UpdateResult(True)

    def launch(self, stream):
        self.launched += 1

    def destroy(self, graph_too=False):
        self.destroyed = True


@pytest.fixture
def fakes(monkeypatch):
    fakes_mod.install(monkeypatch, FakeKernels)
    monkeypatch.setattr(FakeExec, "refuse_update", False)
    captured = []

    def capture(fn, stream):
        G.capturable_stream(stream)
        before = [len(w.kernels.enqueued) for w in made]
        fn()
        new = [c for w, n in zip(made, before) for c in w.kernels.enqueued[n:]]
        captured.append(new)
        return FakeGraph(new)

    made = []
    monkeypatch.setattr(G, "capture", capture)
    return SimpleNamespace(captured=captured, made=made, monkeypatch=monkeypatch)


def _wrapper(fakes, variant="plain"):
    w = W.BatchDecodeWrapper(32, 8, 128, 16, max_batch=8, max_pages=64, variant=variant)
    fakes.made.append(w)
    return w


def cuda(shape, ptr, dtype="bfloat16"):
    return export(ptr, shape, dtype, 0)


def _layer(i, n):
    """Layer i's tensors: q/out views of max-batch buffers (same base pointer for any n)."""
    base = (1 << 36) + i * (1 << 30)
    return dict(q=cuda((n, 32, 128), base), k=cuda((40, 16, 8, 128), base + (1 << 28)),
                v=cuda((40, 16, 8, 128), base + (2 << 28)), o=cuda((n, 32, 128), base + (3 << 28)))


def _step(g, t, **kw):
    return g.step(t["q"], t["k"], t["v"], out=t["o"], stream=0x5000, **kw)


def _struct(w, params):
    return w.kernels.rendered.params.ctypes_type().from_buffer_copy(params)


def test_same_pointers_replay_one_graph_across_replans(fakes):
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, max_execs=1)
    merges = []
    for lens in ([100, 20, 300], [101, 21, 301], [1], [101, 5, 301, 77, 9], [400]):   # grow, no split, join, shrink
        w.plan(*paged_kv(lens, 16, shuffle_seed=len(lens)))
        merges.append(w.info.num_merge_rows > 0)
        out = _step(g, _layer(0, len(lens)))
        assert out.shape == (len(lens), 32, 128)
    assert merges[2] is False and True in merges   # plans with and without merge rows: one graph
    assert g.stats == dict(captures=1, instantiations=1, updates=0, param_updates=0, reinstantiations=0,
                           replays=5)
    assert len(fakes.captured) == 1 and len(fakes.captured[0]) == 2  # one launch: decode and merge kernels


def test_a_captured_step_graph_never_replays_an_out_of_pool_plan(fakes):
    """The graph replays whatever plan is in the workspace: a replan reading past the caches it
    was captured on (40 pages) must be refused by plan(), before its copy is queued."""
    from rtattn.graphs.step_graph import StepGraph
    copies = []
    fakes_mod.install(fakes.monkeypatch, FakeKernels, memcpy=lambda *a, **k: copies.append(a))
    w = _wrapper(fakes)
    kvp, idx, last = paged_kv([100, 20, 300], 16, shuffle_seed=3)
    w.plan(kvp, idx, last)
    layers = [_layer(i, 3) for i in range(2)]
    sg = StepGraph([w.prepare(t["q"], t["k"], t["v"], out=t["o"], stream=0x5000) for t in layers], 0x5000)
    sg.replay()
    bad = idx.copy()
    bad[-1] = 40
    with pytest.raises(ValueError, match=r"kv_indices\[27\] = 40 is outside the page pool \[0, 40\)"):
        w.plan(kvp, bad, last)
    assert len(copies) == 1   # only the first plan's copy was ever queued


def test_step_graph_keeps_an_executable_per_launch_list(fakes):
    """A launch whose kernel list follows its plan (a CascadeLaunch with or without its prefill
    kernel): one executable per list, captured the first time a replay needs it; replans that
    keep the list replay it; rebind() updates the current list's and drops the others'."""
    from rtattn.graphs.step_graph import StepGraph

    class Switching:
        def __init__(self):
            self.config_key, self.ran = ("a",), []

        def __call__(self, stream):
            self.ran.append(self.config_key)

    launch = Switching()
    sg = StepGraph([launch], 0x5000)
    first = sg.exec
    for key in ("a", "b", "b", "a", "b"):
        launch.config_key = (key,)
        sg.replay()
        assert sg.exec is sg._execs[((key,),)] and sg.exec.launched
    assert sg.stats["instantiations"] == 2 and sg.stats["captures"] == 2 and launch.ran == [("a",), ("b",)]
    assert sg._execs[(("a",),)] is first and first.launched == 2
    b = sg.exec
    assert sg.rebind([launch]) and sg.exec is b and list(sg._execs) == [(("b",),)] and first.destroyed
    launch.config_key = ("a",)
    sg.replay()
    assert sg.stats["instantiations"] == 3 and sg.exec is not first
    sg.close()
    assert b.destroyed and sg._execs == {}


def test_new_pointers_update_the_exec_in_place_with_node_params(fakes):
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, max_execs=1)
    w.plan(*paged_kv([100, 20, 300], 16))
    for step in range(2):
        for layer in range(3):
            _step(g, _layer(layer, 3))
    assert g.stats["instantiations"] == 1 and g.stats["captures"] == 1
    assert g.stats["param_updates"] == 5 and g.stats["replays"] == 6 and g.num_execs == 1
    (ex,) = next(iter(g._pools.values())).values()
    assert all(_struct(w, p).q == _layer(2, 3)["q"].ptr for p in ex.params)  # holds the last layer's struct


def test_capture_mode_updates_through_cuGraphExecUpdate(fakes):
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, update="capture", max_execs=1)
    w.plan(*paged_kv([100, 20, 300], 16))
    _step(g, _layer(0, 3))
    _step(g, _layer(1, 3))
    assert g.stats["updates"] == 1 and g.stats["instantiations"] == 1 and g.stats["captures"] == 2


def test_refused_update_re_instantiates_and_says_why(fakes, caplog):
    FakeExec.refuse_update = True
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, update="capture", max_execs=1)
    w.plan(*paged_kv([100, 20, 300], 16))
    _step(g, _layer(0, 3))
    with caplog.at_level("WARNING", logger="rtattn.graphs"):
        _step(g, _layer(1, 3))
    assert g.stats["reinstantiations"] == 1 and g.stats["instantiations"] == 2
    assert "TOPOLOGY_CHANGED" in g.reasons[0] and "re-instantiating" in caplog.text


def test_one_exec_per_layer_means_no_updates(fakes):
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, max_execs=3)
    w.plan(*paged_kv([100, 20, 300], 16))
    for _ in range(4):
        for layer in range(3):
            _step(g, _layer(layer, 3))
    assert g.stats["instantiations"] == 3 and g.stats["param_updates"] == 0 and g.stats["replays"] == 12


def test_default_pool_replays_a_models_layers_with_no_update(fakes):
    """The default pool keeps one exec per layer: after a model's first step, every step() is
    run()'s binding plus one graph launch (run() makes one launch per kernel), never a node update."""
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w)
    w.plan(*paged_kv([100, 20, 300], 16))
    layers = [_layer(i, 3) for i in range(32)]
    for _ in range(3):
        for t in layers:
            _step(g, t)
    assert g.stats["instantiations"] == 32 and g.stats["param_updates"] == 0 and g.stats["updates"] == 0
    assert g.stats["replays"] == 96 and len(fakes.captured) == 32
    assert all(ex.launched == 3 for pool in g._pools.values() for ex in pool.values())


def test_configurations_get_separate_graphs(fakes):
    a, b = _wrapper(fakes), _wrapper(fakes, variant="causal")
    assert DG.config_key(a._reusable()) != DG.config_key(b._reusable())
    g = DG.DecodeGraphs(a, max_execs=1)
    for w in (a, b):
        w.plan(*paged_kv([100, 20, 300], 16))
    for _ in range(2):
        _step(g, _layer(0, 3))
        _step(g, _layer(0, 3), wrapper=b)
    assert g.num_execs == 2 and g.stats["instantiations"] == 2 and g.stats["param_updates"] == 0


def test_step_refuses_legacy_stream_and_bad_tensors_before_capture(fakes):
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w, max_execs=1)
    w.plan(*paged_kv([100, 20, 300], 16))
    t = _layer(0, 3)
    with pytest.raises(G.GraphCaptureError, match="legacy"):
        g.step(t["q"], t["k"], t["v"], out=t["o"], stream=None)
    with pytest.raises(ValueError, match="q has shape"):
        g.step(_layer(0, 2)["q"], t["k"], t["v"], out=t["o"], stream=0x5000)
    assert fakes.captured == [] and g.stats["replays"] == 0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="update must be"):
        DG.DecodeGraphs(None, update="nope")
    with pytest.raises(ValueError, match="max_execs"):
        DG.DecodeGraphs(None, max_execs=0)
    with pytest.raises(ValueError, match="no wrapper"):
        DG.DecodeGraphs(None).step(None, None, stream=0x5000)


# =============================================================================== GPU tier
H, HK, D, PS = 32, 8, 128, 16
TOL = 2e-2


class Arrays:
    """bf16 device tensors from torch when importable, else rtattn's own DeviceArrays."""

    def __init__(self):
        try:
            import torch
            self.torch = torch
        except ImportError:
            self.torch = None

    def randn(self, shape, rng, scale=1.0):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if self.torch is not None:
            t = self.torch.from_numpy(x).to("cuda").to(self.torch.bfloat16)
            self.torch.cuda.synchronize()
            return t, t.float().cpu().numpy().astype(np.float64)
        return DeviceArray.from_host(x, "bfloat16"), rounded(x, "bfloat16")

    def empty(self, shape, dtype="bfloat16"):
        if self.torch is not None:
            return self.torch.empty(shape, device="cuda", dtype=getattr(self.torch, dtype))
        return DeviceArray(shape, dtype)

    def rows(self, t, n):
        return t[:n] if self.torch is not None else t.view(n)

    def poison(self, t):
        if self.torch is not None:
            t.fill_(float("nan"))
            self.torch.cuda.synchronize()
        else:
            s = Stream()
            t.fill_nan(s)
            s.synchronize()

    def host(self, t, n):
        if self.torch is not None:
            return t[:n].float().cpu().numpy().astype(np.float64)
        return t.download(n)


def _errors(got, want):
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _lse_err(got, want):
    if np.isnan(got).any() or (np.isneginf(got) != np.isneginf(want)).any():
        return float("inf")
    fin = np.isfinite(want)
    return float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0


class Layers:
    """L layers of a decode model: per layer q/out buffers for max_batch rows and a KV pool."""

    def __init__(self, arrays, num_layers, max_batch, pool_pages, seed=0):
        rng = np.random.default_rng(seed)
        self.a, self.max_batch = arrays, max_batch
        self.q, self.k, self.v, self.out, self.lse = [], [], [], [], []
        for _ in range(num_layers):
            q, qh = arrays.randn((max_batch, H, D), rng)
            k, kh = arrays.randn((pool_pages, PS, HK, D), rng)
            v, vh = arrays.randn((pool_pages, PS, HK, D), rng)
            self.q.append((q, qh))
            self.k.append((k, kh))
            self.v.append((v, vh))
            self.out.append(arrays.empty((max_batch, H, D)))
            self.lse.append(arrays.empty((max_batch, H), "float32"))

    def tensors(self, layer, n):
        a = self.a
        return (a.rows(self.q[layer][0], n), self.k[layer][0], self.v[layer][0], a.rows(self.out[layer], n),
                a.rows(self.lse[layer], n))

    def reference(self, layer, n, kv):
        from rtattn.plan.reference import reference_attention
        qo = np.arange(n + 1, dtype=np.int32)
        return reference_attention(self.q[layer][1][:n], self.k[layer][1], self.v[layer][1], qo, *kv, PS)

    def check(self, layer, n, kv, what=""):
        want_o, want_lse = self.reference(layer, n, kv)
        got_o = self.a.host(self.out[layer], n)
        got_lse = self.a.host(self.lse[layer], n)
        err, lerr = _errors(got_o, want_o), _lse_err(got_lse, want_lse)
        assert err < TOL, f"{what} layer {layer}: O relative error {err:.3e} (NaN = not written)"
        assert lerr < 2e-2, f"{what} layer {layer}: LSE max abs error {lerr:.3e}"
        return got_o


def _kv(lens, seed, pool_pages):
    """Page tables over the pool with random (non-contiguous) page ids."""
    indptr, _, last = paged_kv(lens, PS)
    ids = np.random.default_rng(seed).permutation(pool_pages)[: int(indptr[-1])].astype(np.int32)
    return indptr, ids, last


def _wrapper_gpu(max_batch, pool_pages, **kw):
    return W.BatchDecodeWrapper(H, HK, D, PS, max_batch=max_batch, max_pages=pool_pages, **kw)


@pytest.mark.gpu
def test_graph_replay_equals_eager_run():
    a = Arrays()
    L = Layers(a, 1, 8, 96)
    w = _wrapper_gpu(8, 96)
    s = Stream()
    kv = _kv([100, 20, 300, 1, 640], 1, 96)
    w.plan(*kv, stream=s)
    q, k, v, o, lse = L.tensors(0, 5)
    a.poison(L.out[0]), a.poison(L.lse[0])
    w.run(q, k, v, out=o, lse=lse, stream=s)
    s.synchronize()
    eager = L.check(0, 5, kv, "eager")
    eager_lse = a.host(L.lse[0], 5)
    g = DG.DecodeGraphs(w, max_execs=1)
    for rep in range(3):
        a.poison(L.out[0]), a.poison(L.lse[0])
        g.step(q, k, v, out=o, lse=lse, stream=s)
        s.synchronize()
        graph = L.check(0, 5, kv, f"graph replay {rep}")
        assert np.array_equal(graph, eager), "graph replay differs bitwise from the eager run"
        assert np.array_equal(a.host(L.lse[0], 5), eager_lse)
    assert g.stats["instantiations"] == 1 and g.stats["replays"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["rtattn", "torch"])
def test_replan_with_different_lengths_then_replay(stream_kind):
    """One graph, captured at step 0, replayed while the batch grows, a request finishes and
    another joins (new pages), the batch shrinks and grows again."""
    a = Arrays()
    if stream_kind == "torch" and a.torch is None:
        pytest.skip("torch not importable")
    pool = 512
    L = Layers(a, 1, 16, pool, seed=3)
    w = _wrapper_gpu(16, pool)
    s = Stream() if stream_kind == "rtattn" else a.torch.cuda.Stream()
    g = DG.DecodeGraphs(w, max_execs=1)
    schedule = [[100, 20, 300], [101, 21, 301], [102, 302, 7], [103, 303, 8, 1, 2000, 45],
                [1], list(range(1, 800, 50)), [5, 4096]]
    for i, lens in enumerate(schedule):
        n = len(lens)
        kv = _kv(lens, 10 + i, pool)
        a.poison(L.out[0]), a.poison(L.lse[0])
        w.plan(*kv, stream=s)
        q, k, v, o, lse = L.tensors(0, n)
        g.step(q, k, v, out=o, lse=lse, stream=s)
        s.synchronize()
        L.check(0, n, kv, f"step {i} (batch {n})")
    assert g.stats["captures"] == 1 and g.stats["instantiations"] == 1
    assert g.stats["replays"] == len(schedule) and g.stats["param_updates"] == g.stats["updates"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("update", ["nodes", "capture"])
def test_pointer_change_updates_in_place(update):
    a = Arrays()
    pool = 256
    L = Layers(a, 3, 8, pool, seed=5)
    w = _wrapper_gpu(8, pool)
    s = Stream()
    g = DG.DecodeGraphs(w, update=update, max_execs=1)
    for step, lens in enumerate([[50, 700, 3], [51, 701, 4, 1000], [52, 5]]):
        kv = _kv(lens, 20 + step, pool)
        w.plan(*kv, stream=s)
        for layer in range(3):
            a.poison(L.out[layer]), a.poison(L.lse[layer])
        for layer in range(3):
            q, k, v, o, lse = L.tensors(layer, len(lens))
            g.step(q, k, v, out=o, lse=lse, stream=s)
        s.synchronize()
        for layer in range(3):
            L.check(layer, len(lens), kv, f"{update} step {step}")
    assert g.stats["instantiations"] == 1 and g.stats["reinstantiations"] == 0
    key = "param_updates" if update == "nodes" else "updates"
    (ex,) = next(iter(g._pools.values())).values()
    funcs = [hex(int(k.func)) for k in ex.kernel_nodes()]
    handles = [hex(int(w.kernels.decode.handle))]
    assert g.stats[key] == 8, (g.stats, "node funcs", funcs, "kernel handles", handles)  # 9 calls, 1st instantiates


@pytest.mark.gpu
def test_step_graph_replays_all_layers_across_replans():
    from rtattn.graphs import StepGraph
    a = Arrays()
    pool, layers = 256, 4
    L = Layers(a, layers, 8, pool, seed=7)
    w = _wrapper_gpu(8, pool)
    s = Stream()
    kv = _kv([30, 40], 1, pool)
    w.plan(*kv, stream=s)
    # prepared on max-batch views (graph capture): later plans of up to 8 requests fit them
    launches = [w.prepare(*L.tensors(i, 8)[:3], out=L.tensors(i, 8)[3], lse=L.tensors(i, 8)[4], stream=s)
                for i in range(layers)]
    sg = StepGraph(launches, s)
    assert len(sg.exec.kernel_nodes()) in (layers, 2 * layers)
    for step, lens in enumerate([[30, 40], [31, 41, 900], [600], [1, 2, 3, 4, 5, 6, 7, 8]]):
        kv = _kv(lens, 30 + step, pool)
        for i in range(layers):
            a.poison(L.out[i]), a.poison(L.lse[i])
        w.plan(*kv, stream=s)
        sg.replay()
        s.synchronize()
        for i in range(layers):
            L.check(i, len(lens), kv, f"step graph step {step}")
    # rebind to the layers in reverse order: same topology -> update in place
    assert sg.rebind(launches[::-1]) is True and sg.stats["updates"] == 1
    sg.close()


@pytest.mark.gpu
def test_graph_api_update_refusal_and_invalidated_capture():
    from rtattn.runtime import CudaError, DeviceBuffer
    a = Arrays()
    L = Layers(a, 1, 4, 32)
    w = _wrapper_gpu(4, 32)
    s = Stream()
    w.plan(*_kv([20, 30], 1, 32), stream=s)
    q, k, v, o, lse = L.tensors(0, 2)
    launch = w.prepare(q, k, v, out=o, lse=lse, stream=s)
    one = G.capture(lambda: launch(s), s)
    two = G.capture(lambda: (launch(s), launch(s)), s)
    kinds = one.node_types()
    assert len(two.nodes()) == 2 * len(one.nodes()) and len(one.kernel_nodes()) == len(kinds)
    ex = one.instantiate()
    res = ex.update(two)
    assert not res and "TOPOLOGY" in res.reason, res
    assert ex.update(G.capture(lambda: launch(s), s))  # same topology: fine
    ex.launch(s)
    s.synchronize()
    # an allocation during a thread-local capture is refused; the stream stays usable
    with pytest.raises(CudaError):
        G.capture(lambda: DeviceBuffer(1 << 20), s)
    again = G.capture(lambda: launch(s), s).instantiate()
    again.launch(s)
    s.synchronize()
    for x in (ex, again):
        x.destroy(graph_too=True)
    one.destroy(), two.destroy()
    assert ex.destroyed and one.destroyed


# ---- the decode-loop demo end to end on a simulated device (host memory, numpy "kernels")
class HostBuffer:
    """DeviceBuffer stand-in: real host memory, so pointers can be dereferenced by the fakes."""

    def __init__(self, nbytes, device=None):
        self.nbytes = int(nbytes)
        self.mem = np.zeros(max(self.nbytes, 1), np.uint8)
        self.ptr = self.mem.ctypes.data
        self.device = SimpleNamespace(ordinal=0)

    @property
    def array(self):
        return self.mem

    def memset(self, value=0, stream=None):
        self.mem[:] = value & 0xFF

    def copy_from_host(self, a, stream=None, offset=0):
        raw = np.ascontiguousarray(a).view(np.uint8).ravel()
        self.mem[offset:offset + raw.size] = raw

    def copy_to_host(self, out, stream=None, offset=0):
        out.view(np.uint8).ravel()[:] = self.mem[offset:offset + out.nbytes]
        return out


def _strided(ptr, shape, strides, dtype=np.uint16):
    import ctypes as C
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    base = np.ctypeslib.as_array((C.c_uint16 * span).from_address(ptr))
    return np.lib.stride_tricks.as_strided(base, shape, tuple(s * 2 for s in strides))


class SimKernels(FakeKernels):
    """Executes a launch with the float64 reference on the memory its argument struct points at,
    for the batch of the wrapper's latest plan; records instead while a fake capture runs."""
    recording = None

    def record(self, calls, stream):
        if SimKernels.recording is not None:
            SimKernels.recording += [(self, c, bytes(c.params)) for c in calls]
        else:
            self.execute(bytes(calls[0].params))

    def execute(self, params):
        from rtattn.plan.reference import reference_attention
        st = self.rendered.params.ctypes_type().from_buffer_copy(params)
        kv_indptr, kv_indices, last = self.kv
        n, (H, Hk, D, ps) = len(last), self.dims
        pages = int(kv_indices[:kv_indptr[-1]].max()) + 1
        q = bf16_bits_to_f32(_strided(st.q, (n, H, D), (st.q_stride_tok, st.q_stride_head, 1)))
        kshape = (pages, ps, Hk, D)
        k = bf16_bits_to_f32(_strided(st.k_cache, kshape, (st.k_stride_page, st.k_stride_tok, st.k_stride_head, 1)))
        v = bf16_bits_to_f32(_strided(st.v_cache, kshape, (st.v_stride_page, st.v_stride_tok, st.v_stride_head, 1)))
        o, _ = reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                   np.arange(n + 1, dtype=np.int32), kv_indptr, kv_indices, last, ps)
        _strided(st.o, (n, H, D), (st.o_stride_tok, st.o_stride_head, 1))[...] = f32_to_bf16_bits(o)


class SimExec:
    def __init__(self, calls):
        self.calls = list(calls)   # (kernels, KernelCall, argument bytes)

    def kernel_nodes(self):
        return [G.KernelNode(i, c.func, c.grid, c.block, c.smem) for i, (_, c, _) in enumerate(self.calls)]

    matches = G.GraphExec.matches

    def set_call_params(self, i, call):
        k, c, _ = self.calls[i]
        self.calls[i] = (k, c, bytes(call.params))

    def update(self, graph):
        if len(graph.calls) != len(self.calls):
            return G.UpdateResult(False, "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED")
        self.calls = list(graph.calls)
        return G.UpdateResult(True)

    def launch(self, stream):
        for k, c, params in self.calls:
            if c.function is k.decode:
                k.execute(params)

    def destroy(self, graph_too=False):
        pass


def test_demo_decode_loop_on_a_simulated_device(monkeypatch, capsys):
    from rtattn.graphs import demo_decode_loop as demo
    from rtattn.graphs import device_arrays
    fakes_mod.install(monkeypatch, SimKernels, device=fakes_mod.fake_device("sim"), buffer=HostBuffer,
                      memcpy=lambda dst, src, n, stream=None, device=None: ctypes_memmove(dst, src, n))
    monkeypatch.setattr(device_arrays, "DeviceBuffer", HostBuffer)
    plan = W.BatchDecodeWrapper.plan

    def plan_and_remember(self, kv_indptr, kv_indices, kv_last_page_len, qo_indptr=None, stream=None):
        self.kernels.kv = (kv_indptr, kv_indices, kv_last_page_len)
        self.kernels.dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        return plan(self, kv_indptr, kv_indices, kv_last_page_len, qo_indptr, stream)
    monkeypatch.setattr(W.BatchDecodeWrapper, "plan", plan_and_remember)

    class SimStream:
        def __cuda_stream__(self):
            return (0, 0x5000)

        def synchronize(self):
            pass
    monkeypatch.setattr(demo, "Stream", SimStream)

    def capture(fn, stream):
        G.capturable_stream(stream)
        SimKernels.recording = []
        try:
            fn()
            calls = SimKernels.recording
        finally:
            SimKernels.recording = None
        return SimpleNamespace(calls=calls, instantiate=lambda: SimExec(calls), destroy=lambda: None)
    monkeypatch.setattr(G, "capture", capture)

    rc = demo.main(["--layers", "3", "--steps", "12", "--batch", "4", "--max-len", "80", "--heads", "4/2",
                    "--head-dim", "64", "--check-every", "3"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "all checks passed" in text and "'reinstantiations': 0" in text
    assert "'instantiations': 1" in text and "'param_updates': 35" in text   # 12 steps x 3 layers - 1


def ctypes_memmove(dst, src, n):
    import ctypes as C
    C.memmove(dst, src, n)


# ---- graph.py against a stub libcuda.so.1: checks how cuda.bindings passes and returns
# graph handles, node lists, kernel-node params and update results, without a GPU
STUB_C = (Path(__file__).resolve().parent.parent / "tools" / "stub_libcuda.c").read_text()

STUB_DRIVE = r'''
from types import SimpleNamespace
from cuda.bindings import driver as cu
from rtattn.graphs import graph as G
from rtattn.graphs.decode_graphs import DecodeGraphs
from rtattn.runtime import Stream
s = Stream.wrap(0x5000)
import gc, weakref
class Junk: pass
junk, capturing, collected = Junk(), [False], []
junk.me = junk   # unreachable garbage with a finalizer (as a wrapper's buffers in a reference cycle)
weakref.finalize(junk, lambda: collected.append(capturing[0]))
del junk
def busy():   # enough allocations for a collection, were the collector on
    capturing[0] = True
    keep = [[] for _ in range(20 * gc.get_threshold()[0])]
    capturing[0] = False
assert gc.isenabled()
G.capture(busy, s)
# never during the capture (a collection right after it, once the collector is back, may come first)
assert gc.isenabled() and True not in collected, collected
gc.collect()
assert collected == [False], collected   # collected after the capture, not during it
g = G.capture(lambda: None, s)
k = g.kernel_nodes()
assert [int(n.node) for n in k] == [0x1000, 0x2000] and [int(n.func) for n in k] == [0x11000, 0x11000], k
assert k[0].grid == (132, 8, 1) and k[0].block == (128, 1, 1) and k[0].smem == 4096
ex = g.instantiate()
ex.set_kernel_params(1, b"PARAMS" + bytes(64))
ex.launch(s)
assert ex.update(G.Graph(cu.CUgraph(0xABC0), g.device))
r = ex.update(G.Graph(cu.CUgraph(0xBAD0), g.device))
assert not r and r.reason, r
from rtattn.runtime.launch import KernelCall, Launch, Params
fn = SimpleNamespace(handle=cu.CUfunction(0x11000), name="k")
def layer(arg):   # two calls of one kernel sharing one argument buffer, as the stub's two nodes
    p = Params(arg + bytes(8))
    return Launch([KernelCall(fn, (132, 8), 128, 4096, p, pdl=True), KernelCall(fn, (132, 8), 128, 4096, p)])
dg = DecodeGraphs(max_execs=1)
for arg in (b"LAYER0", b"LAYER1", b"LAYER1"):
    dg.replay(layer(arg), s)
assert dg.stats["instantiations"] == 1 and dg.stats["param_updates"] == 1 and dg.stats["replays"] == 3, dg.stats
from rtattn.runtime import libcuda
libcuda.set_entry("bindings")
layer(b"BINDNG")(s)
print("STUB-DRIVE-OK")
'''


@pytest.mark.skipif(has_device(), reason="uses a stub driver instead of a GPU")
def test_graph_api_against_a_stub_driver(tmp_path):
    import shutil
    import subprocess
    import sys
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler for the stub libcuda")
    (tmp_path / "stub.c").write_text(STUB_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "stub.c"), "-ldl"],
                   check=True)
    env = dict(__import__("os").environ, LD_LIBRARY_PATH=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", STUB_DRIVE], env=env, capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "STUB-DRIVE-OK" in out, out
    assert "begin 0x5000 1" in out                                   # thread-local capture mode
    assert "setparams 0x2000 func=0x11000 grid=132,8,1 block=128 smem=4096 arg=PARAMS" in out
    assert "setparams 0x1000 func=0x11000 grid=132,8,1 block=128 smem=4096 arg=LAYER1" in out \
        and "setparams 0x2000 func=0x11000 grid=132,8,1 block=128 smem=4096 arg=LAYER1" in out  # both nodes
    # the ctypes launch structs as cuda.h lays them out: config, PDL attribute, argument pointer
    pdl = cu_pdl_attribute()
    assert f"launchex f=0x11000 grid=132,8,1 block=128,1,1 smem=4096 stream=0x5000 attrs=1 attr={pdl}:1 arg=LAYER0" in out
    assert "launchex f=0x11000 grid=132,8,1 block=128,1,1 smem=4096 stream=0x5000 attrs=0 arg=LAYER0" in out
    # the cuda.bindings entry makes the same calls
    assert f"launchex f=0x11000 grid=132,8,1 block=128,1,1 smem=4096 stream=0x5000 attrs=1 attr={pdl}:1 arg=BINDNG" in out


def cu_pdl_attribute() -> int:
    from cuda.bindings import driver as cu
    return int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)


def test_any_launch_pools_by_its_calls_shapes_mixed_families_included(fakes):
    """DecodeGraphs.replay takes any Launch: calls of two kernels' families in one launch pool by
    (kernel, grid, block, smem, pdl) per call, and update in place node by node."""
    from rtattn.codegen.spec import standard
    from rtattn.runtime.launch import Launch, Params
    a, b = FakeKernels(standard()), FakeKernels(standard(causal=True))
    fakes.made.append(SimpleNamespace(kernels=a))
    fakes.made.append(SimpleNamespace(kernels=b))

    def mixed(tag: bytes):
        pa, pb = Params(tag + bytes(10)), Params(tag[::-1] + bytes(10))
        return Launch(a.calls(pa, 33, 8, merge=False) + b.calls(pb, 16, 4, merge=True))
    g = DG.DecodeGraphs(max_execs=1)
    for tag in (b"L0", b"L1", b"L1", b"L2"):
        g.replay(mixed(tag), 0x5000)
    assert g.stats["instantiations"] == 1 and g.stats["param_updates"] == 2 and g.stats["replays"] == 4
    (ex,) = next(iter(g._pools.values())).values()
    assert [p[:2] for p in ex.params] == [b"L2", b"2L", b"2L"]      # node i took call i's arguments
    other = Launch(a.calls(Params(bytes(12)), 34, 8, merge=False))   # another grid: its own pool
    g.replay(other, 0x5000)
    assert g.num_execs == 2 and DG.config_key(other) != DG.config_key(mixed(b"L0"))


def test_step_graph_refuses_a_replan_with_another_window(fakes, monkeypatch):
    """A StepGraph's packed arguments hold the window of its prepare(): a replan under another
    window must be refused before the replay, not silently masked with the old window."""
    from rtattn.graphs import StepGraph
    w = _wrapper(fakes, variant="sliding_window")
    w.plan(*paged_kv([100, 20], 16), window_left=32)
    t = _layer(0, 2)
    sg = StepGraph([w.prepare(t["q"], t["k"], t["v"], out=t["o"], stream=0x5000)], 0x5000)
    sg.replay()
    w.plan(*paged_kv([101, 21], 16), window_left=32)
    sg.replay()
    w.plan(*paged_kv([102, 22], 16), window_left=64)
    with pytest.raises(ValueError, match="prepared for window 32"):
        sg.replay()
    assert sg.stats["replays"] == 2


def test_replays_refuse_a_replan_with_more_query_tokens(fakes):
    """A prepared launch and a StepGraph hold q/out views of the tokens they were prepared with:
    a replan with more tokens must be refused before the replay (it would read q and write out
    past them); fewer tokens replay fine."""
    from rtattn.graphs import StepGraph
    w = _wrapper(fakes)
    w.plan(*paged_kv([100, 20, 7], 16))
    t = _layer(0, 3)
    launch = w.prepare(t["q"], t["k"], t["v"], out=t["o"], stream=0x5000)
    sg = StepGraph([launch], 0x5000)
    w.plan(*paged_kv([101, 21], 16))          # fewer requests: fits
    sg.replay()
    launch()
    w.plan(*paged_kv([102, 22, 8, 5], 16))    # one more token than q holds
    with pytest.raises(ValueError, match="prepared with 3 query tokens"):
        sg.replay()
    with pytest.raises(ValueError, match="prepared with 3 query tokens"):
        launch()
    with pytest.raises(ValueError, match="prepared with 3 query tokens"):
        DG.DecodeGraphs(w, max_execs=1).replay(launch, 0x5000)
    assert sg.stats["replays"] == 1


def test_prepare_takes_max_batch_views_and_run_stays_exact(fakes):
    """prepare() accepts q/out with more rows than the plan (capacity for later, larger plans);
    run() wants exactly the plan's tokens, and neither takes fewer."""
    from rtattn.graphs import StepGraph
    w = _wrapper(fakes)
    w.plan(*paged_kv([100, 20], 16))
    big, small = _layer(0, 4), _layer(1, 1)
    sg = StepGraph([w.prepare(big["q"], big["k"], big["v"], out=big["o"], stream=0x5000)], 0x5000)
    w.plan(*paged_kv([101, 21, 5, 9], 16))   # up to the 4 rows prepared
    sg.replay()
    with pytest.raises(ValueError, match=r"expected \[4, 32, 128\]"):
        w.run(_layer(2, 3)["q"], big["k"], big["v"], out=_layer(2, 3)["o"])
    with pytest.raises(ValueError, match="expected at least"):
        w.prepare(small["q"], small["k"], small["v"], out=small["o"], stream=0x5000)


def test_default_pool_keeps_one_exec_per_layer(fakes):
    """The default pool holds a model's layers (up to 256 argument sets per configuration): 32
    layers that come back with the same tensors every step replay with no node update."""
    w = _wrapper(fakes)
    g = DG.DecodeGraphs(w)
    for step in range(3):
        w.plan(*paged_kv([100 + step, 20, 300], 16))
        for layer in range(32):
            _step(g, _layer(layer, 3))
    assert g.stats["instantiations"] == 32 and g.stats["param_updates"] == 0 and g.stats["updates"] == 0
    assert g.stats["replays"] == 96
