"""Device binding: every device-bound object (streams, events, buffers, modules, wrappers, graphs)
works on any ordinal, from any thread, with several devices in one process, and leaves the
caller's current context as it found it; a tensor or stream of another device is refused
before launch, naming it.

CPU tier: rtattn's real runtime over the fake driver of tests/fake_driver.py (two or three fake
H200s, per-thread current contexts, resources owned by contexts, stricter than the real driver).
GPU tier (-m gpu): the same rules on the real driver, on every visible device.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from fake_driver import drv  # noqa: F401 (the fixture: three fake devices)
from rtattn.plan.layout import paged_kv
from rtattn.runtime import DeviceBuffer, Device, Event, PinnedBuffer, Stream, current_device, export
from rtattn.runtime import driver

H_QO, H_KV, D, PS = 8, 2, 64, 16




def _ctx(ordinal: int) -> int:
    return Device(ordinal).context_handle or int(Device(ordinal).context)


def _in_thread(fn):
    """Run fn() on a fresh thread (no current context); re-raise what it raised."""
    box = []

    def body():
        try:
            box.append(("ok", fn()))
        except BaseException as e:   # noqa: BLE001 - handed back to the test
            box.append(("err", e))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    kind, value = box[0]
    if kind == "err":
        raise value
    return value


def _wrapper(device, **kw):
    import rtattn
    return rtattn.BatchDecodeWrapper(H_QO, H_KV, D, PS, max_batch=8, max_pages=64, device=device, **kw)


def _tensors(device: int, batch: int, pages: int = 40):
    """q, k, v, out on `device` (fake device memory: the kernels are recorded, not run)."""
    def buf(shape):
        return DeviceBuffer(int(np.prod(shape)) * 2, device).as_tensor("bfloat16", shape)
    return (buf((batch, H_QO, D)), buf((pages, PS, H_KV, D)), buf((pages, PS, H_KV, D)), buf((batch, H_QO, D)))


def test_runtime_objects_run_in_their_devices_context_and_restore_the_callers(drv):
    driver.set_current_context(_ctx(0))   # what torch.cuda.set_device(0) leaves on this thread
    s = Stream(device=1)
    ev = Event(timing=False, device=1)
    buf = DeviceBuffer(256, device=2)
    pinned = PinnedBuffer(256, device=1)
    pinned.view(np.uint8)[:] = 7
    buf.copy_from_host(np.arange(64, dtype=np.int32))
    ev.record(s)
    s.wait(ev)
    s.synchronize()
    assert driver.get_current_context() == _ctx(0)          # never changed for the caller
    assert drv.owner[s.handle] == _ctx(1) and drv.owner[int(ev.handle)] == _ctx(1)
    assert drv.memory[buf.ptr][0] == _ctx(2)
    assert (buf.copy_to_host(np.empty(64, np.int32)) == np.arange(64)).all()
    assert s.device is Device(1) and Stream.wrap(s.handle).device is Device(1)   # borrowed: asked of the driver
    buf.free(), s.close(), ev.close()
    assert drv.errors == [] and driver.get_current_context() == _ctx(0)


def test_event_link_records_then_waits_in_one_context_entry_of_its_device(drv, monkeypatch):
    driver.set_current_context(_ctx(0))
    producer, consumer, ev = Stream(device=1), Stream(device=1), Event(timing=False, device=1)
    enters, enter = [], Device.enter
    monkeypatch.setattr(Device, "enter", lambda self: enters.append(self.ordinal) or enter(self))
    n = len(drv.calls)
    ev.link(producer.handle, consumer.handle)
    assert drv.calls[n:] == [("cuEventRecord", _ctx(1)), ("cuStreamWaitEvent", _ctx(1))] and enters == [1]
    assert drv.errors == [] and driver.get_current_context() == _ctx(0)


def test_the_default_device_is_the_threads_current_one_and_nothing_is_left_current(drv):
    assert _in_thread(lambda: current_device().ordinal) == 0        # no context current: device 0
    driver.set_current_context(_ctx(2))
    assert current_device() is Device(2)
    assert Stream().device is Device(2) and DeviceBuffer(16).device is Device(2)

    def fresh():
        Stream(device=1).synchronize()
        DeviceBuffer(64, device=2).memset(3)
        return driver.get_current_context()
    assert _in_thread(fresh) == 0                                    # a fresh thread stays without one
    assert drv.errors == []


def test_a_wrapper_on_any_ordinal_runs_from_another_thread_on_its_own_device(drv):
    w = _wrapper(device=1)
    kvp, idx, last = paged_kv([100, 20, 300], PS, shuffle_seed=1)
    s = Stream(device=1)

    def step():
        driver.set_current_context(_ctx(0))                          # this thread's framework is on cuda:0
        info = w.plan(kvp, idx, last, stream=s)
        out = w.run(*_tensors(1, 3)[:3], stream=s)
        return info, out, driver.get_current_context()
    info, out, ctx_after = _in_thread(step)
    assert ctx_after == _ctx(0) and drv.errors == []
    assert {d for d, *_ in drv.launches} == {1} and all(rec[3] == s.handle for rec in drv.launches)
    copy = drv.copies[-1]
    assert copy[0] == 1 and copy[1] == w.workspace_ptr and copy[3] == w.layout.plan_bytes
    plan = drv.memory[w.workspace.ptr][1][:w.layout.plan_bytes]
    assert (plan == info.buffer[:w.layout.plan_bytes]).all()        # the device got this plan's bytes
    assert out.device_id == 1 and drv.memory[out.ptr][0] == _ctx(1)  # allocated on the wrapper's device


def test_wrappers_of_several_devices_in_one_process_and_threads_never_mix(drv):
    ws = [_wrapper(device=d) for d in range(3)]
    assert len({id(w.kernels) for w in ws}) == 3                      # kernels loaded once per device
    assert [drv.owner[int(w.kernels.kernel.handle)] for w in ws] == [_ctx(d) for d in range(3)]
    streams = [Stream(device=d) for d in range(3)]
    tensors = [_tensors(d, 4) for d in range(3)]
    failed = []

    def rank(d):
        rng = np.random.default_rng(d)
        try:
            for step in range(20):
                kvp, idx, last = paged_kv(rng.integers(1, 160, size=4), PS, shuffle_seed=step)   # <= 40 pages
                ws[d].plan(kvp, idx, last, stream=streams[d])
                ws[d].run(*tensors[d][:3], out=tensors[d][3], stream=streams[d])
        except BaseException as e:   # noqa: BLE001 - reported by the test
            failed.append(e)
    threads = [threading.Thread(target=rank, args=(d,)) for d in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert failed == [] and drv.errors == []
    by_dev = {d: [rec for rec in drv.launches if rec[0] == d] for d in range(3)}
    assert all(len(by_dev[d]) >= 20 for d in range(3))
    assert all(rec[3] == streams[d].handle for d in range(3) for rec in by_dev[d])


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "out", "lse"])
def test_a_tensor_of_another_device_is_refused_before_launch_naming_it(drv, name):
    w = _wrapper(device=1)
    w.plan(*paged_kv([100, 20, 300], PS, shuffle_seed=1))
    q, k, v, o = _tensors(1, 3)
    lse = DeviceBuffer(3 * H_QO * 4, 1).as_tensor("float32", (3, H_QO))
    args = dict(q=q, k_cache=k, v_cache=v, out=o, lse=lse)
    t = args[name]
    args[name] = export(t.ptr, t.shape, t.dtype, 0, strides=t.strides)   # the same shape, on cuda:0
    before = len(drv.launches)
    with pytest.raises(ValueError, match=rf"^{name} is on cuda:0, the wrapper runs on cuda:1"):
        w.run(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    assert len(drv.launches) == before


def test_a_stream_or_workspace_of_another_device_is_refused_before_launch(drv):
    w = _wrapper(device=1)
    w.plan(*paged_kv([100, 20], PS, shuffle_seed=1))
    q, k, v, o = _tensors(1, 2)
    before = len(drv.launches)
    with pytest.raises(ValueError, match=r"stream 0x[0-9a-f]+ belongs to cuda:2, but this launch runs on cuda:1"):
        w.run(q, k, v, out=o, stream=Stream(device=2))
    assert len(drv.launches) == before
    with pytest.raises(ValueError, match=r"^stream: .* runs on cuda:2, this event belongs to cuda:1"):
        Event(timing=False, device=1).record(Stream(device=2))
    with pytest.raises(ValueError, match=r"^stream 0x[0-9a-f]+ belongs to cuda:0, but this launch runs on cuda:1"):
        w.plan(*paged_kv([10, 20], PS, shuffle_seed=1), stream=Stream(device=0))   # before planning or copying
    assert w.info.batch == 2 and w.info.num_qo_tokens == 2
    ws0 = DeviceBuffer(1 << 22, 0).as_tensor("uint8", (1 << 22,))
    with pytest.raises(ValueError, match=r"^workspace is on cuda:0, the wrapper runs on cuda:1"):
        _wrapper(device=1, workspace=ws0)
    assert drv.errors == []


def test_plan_copies_in_its_devices_context_waiting_only_for_the_copy_of_two_plans_ago(drv):
    w = _wrapper(device=1)
    s = Stream(device=1)
    Device(0).set_current()
    steps = []
    for seed in range(3):
        n = len(drv.calls)
        w.plan(*paged_kv([100, 20 + seed], PS, shuffle_seed=seed), stream=s)
        steps.append([c for c in drv.calls[n:] if c[0] in ("cuEventSynchronize", "cuMemcpyHtoDAsync", "cuEventRecord")])
    copy = [("cuMemcpyHtoDAsync", _ctx(1)), ("cuEventRecord", _ctx(1))]
    assert steps == [copy, copy, [("cuEventSynchronize", _ctx(1))] + copy]   # slot 0 again: its first copy
    assert [c[4] for c in drv.copies[-3:]] == [s.handle] * 3 and drv.copies[-3][2] == drv.copies[-1][2]
    assert driver.get_current_context() == _ctx(0) and drv.errors == []


def test_graphs_capture_and_replay_on_their_device_from_any_thread(drv):
    from rtattn.graphs import DecodeGraphs, StepGraph
    w = _wrapper(device=2)
    s = Stream(device=2)
    tensors = [_tensors(2, 4) for _ in range(2)]
    w.plan(*paged_kv([50, 60, 70, 80], PS, shuffle_seed=3), stream=s)

    def capture_and_replay():
        driver.set_current_context(_ctx(0))
        sg = StepGraph([w.prepare(q, k, v, out=o, stream=s) for q, k, v, o in tensors], s)
        sg.replay()
        g = DecodeGraphs(w, max_execs=1)
        for q, k, v, o in tensors:   # one exec, its kernel nodes updated in place for the second layer
            g.step(q, k, v, out=o, stream=s)
        assert g.stats["instantiations"] == 1 and g.stats["param_updates"] == 1, g.stats
        return sg, driver.get_current_context()
    sg, ctx_after = _in_thread(capture_and_replay)
    assert ctx_after == _ctx(0) and drv.errors == []
    assert drv.owner[int(sg.exec.handle)] == _ctx(2)
    assert drv.launches and {d for d, *_ in drv.launches} == {2}
    with pytest.raises(ValueError, match=r"belongs to cuda:0, but this launch runs on cuda:2"):
        sg.exec.launch(Stream(device=0))


def test_a_prefill_wrapper_runs_on_its_device_and_refuses_another_devices_q(drv):
    import rtattn
    p = rtattn.BatchPrefillWrapper(H_QO, H_KV, D, PS, max_batch=4, max_qo_tokens=64, max_pages=64, device=2)
    s = Stream(device=2)
    kvp, idx, last = paged_kv([100, 40], PS, shuffle_seed=4)
    driver.set_current_context(_ctx(1))
    p.plan(np.array([0, 20, 36], np.int32), kvp, idx, last, stream=s)
    _, k, v, _ = _tensors(2, 1)
    q = DeviceBuffer(36 * H_QO * D * 2, 2).as_tensor("bfloat16", (36, H_QO, D))
    out = p.run(q, k, v, stream=s)
    assert out.device_id == 2 and {rec[0] for rec in drv.launches} == {2}
    q1 = DeviceBuffer(36 * H_QO * D * 2, 1).as_tensor("bfloat16", (36, H_QO, D))
    before = len(drv.launches)
    with pytest.raises(ValueError, match=r"^q is on cuda:1, the wrapper runs on cuda:2"):
        p.run(q1, k, v, stream=s)
    assert len(drv.launches) == before and driver.get_current_context() == _ctx(1) and drv.errors == []


def test_a_launch_runs_on_the_device_its_kernels_were_loaded_on(drv):
    from rtattn.kernels import decode_kernels
    from rtattn.runtime.launch import KernelCall, Launch, Params
    from rtattn.codegen.spec import standard
    k0, k2 = (decode_kernels(standard(head_dim=D), d) for d in (0, 2))
    p = Params(64)
    call = KernelCall(k2.merge, 1, 32, 0, p)
    launch = Launch([call])
    assert launch.device is Device(2)
    driver.set_current_context(_ctx(0))
    launch(Stream(device=2))                                # enqueued in cuda:2's context
    assert drv.launches[-1][0] == 2 and driver.get_current_context() == _ctx(0) and drv.errors == []
    with pytest.raises(ValueError, match=r"^calls: kernels loaded on cuda:2, cuda:0 in one launch"):
        Launch([call, KernelCall(k0.merge, 1, 32, 0, p)])


# ---------------------------------------------------------------------------- GPU tier
def _device_copy(a: np.ndarray, device: int, dtype: str):
    buf = DeviceBuffer(a.nbytes, device)
    buf.copy_from_host(a)
    return buf.as_tensor(dtype, a.shape)


class _GpuCase:
    """A float16 decode batch on one device: rtattn buffers (no framework), a wrapper built on the
    calling thread, poisoned outputs, and the float64 reference."""

    def __init__(self, ordinal: int, seed: int = 0):
        import rtattn
        from rtattn.plan import reference as ref
        rng = np.random.default_rng(seed + ordinal)
        kv_lens = rng.integers(1, 400, size=4)
        self.table = paged_kv(kv_lens, PS)
        n_pages = int(self.table[0][-1]) + 3
        idx = rng.permutation(n_pages)[:int(self.table[0][-1])].astype(np.int32)
        self.table = (self.table[0], idx, self.table[2])
        q = rng.standard_normal((4, H_QO, D)).astype(np.float16)
        k, v = (rng.standard_normal((n_pages, PS, H_KV, D)).astype(np.float16) for _ in range(2))
        self.ordinal, self.shape = ordinal, q.shape
        self.w = rtattn.BatchDecodeWrapper(H_QO, H_KV, D, PS, max_batch=8, max_pages=128, dtype="float16",
                                           device=ordinal)
        self.q, self.k, self.v = (_device_copy(a, ordinal, "float16") for a in (q, k, v))
        self.out = _device_copy(np.full(q.shape, np.nan, np.float16), ordinal, "float16")
        self.want, _ = ref.reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                               np.arange(5), *self.table, PS)

    def step(self) -> int:
        """plan + run on a stream of the case's device, synchronized: the thread's context after."""
        s = Stream(device=self.ordinal)
        self.w.plan(*self.table, stream=s)
        self.w.run(self.q, self.k, self.v, out=self.out, stream=s)
        s.synchronize()
        return driver.get_current_context()

    def error(self) -> float:
        got = self.out.owner.copy_to_host(np.empty(self.shape, np.float16)).astype(np.float64)
        if not np.isfinite(got).all():
            return float("inf")
        return float(np.linalg.norm(got - self.want) / np.linalg.norm(self.want))


@pytest.mark.gpu
@pytest.mark.parametrize("ordinal", range(max(1, driver.device_count())))
def test_gpu_a_wrapper_run_from_a_fresh_thread_matches_the_reference(ordinal):
    """On each visible device: a wrapper built here and planned and run from a fresh thread (no
    current context) matches the float64 reference on poisoned outputs, and the thread is left
    with no current context."""
    case = _GpuCase(ordinal)
    assert _in_thread(case.step) == 0
    assert case.error() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(driver.device_count() < 2, reason="needs two GPUs")
def test_gpu_two_devices_from_two_threads_and_tensors_of_the_other_refused():
    cases = [_GpuCase(d, seed=7) for d in (0, 1)]
    failed = []

    def rank(case):
        try:
            driver.set_current_context(Device(1 - case.ordinal).context_handle or int(Device(1 - case.ordinal).context))
            for _ in range(5):
                assert case.step() == Device(1 - case.ordinal).context_handle   # the other device: untouched
        except BaseException as e:   # noqa: BLE001 - reported by the test
            failed.append(e)
    threads = [threading.Thread(target=rank, args=(c,)) for c in cases]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert failed == [] and all(c.error() < 5e-3 for c in cases)
    a, b = cases
    with pytest.raises(ValueError, match=r"^q is on cuda:1, the wrapper runs on cuda:0"):
        a.w.run(b.q, a.k, a.v, out=a.out)
    with pytest.raises(ValueError, match=r"stream 0x[0-9a-f]+ belongs to cuda:1, but this launch runs on cuda:0"):
        a.w.run(a.q, a.k, a.v, out=a.out, stream=Stream(device=1))


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["ctypes", "bindings"])
def test_gpu_each_plan_lands_in_the_workspace_through_either_driver_entry(entry):
    """plan()'s copy, event and wait (one context entry, libcuda's direct calls or cuda.bindings):
    after every plan of a run of different batches, planned from a thread whose current context
    is none, the workspace holds exactly that plan's bytes."""
    from rtattn.runtime import libcuda
    before = libcuda.ENTRY
    libcuda.set_entry(entry)
    try:
        w = _wrapper(0)
        s = Stream(device=0)
        rng = np.random.default_rng(3)

        def steps():
            for i in range(5):   # slots 0, 1, 0, 1, 0: plans 3-5 wait on their slot's copy
                lens = rng.integers(0, 100, int(rng.integers(1, 9)))   # (<= 56 of max_pages=64)
                w.plan(*paged_kv(lens, PS, shuffle_seed=i), stream=s)
                s.synchronize()
                got = np.empty(w.layout.plan_bytes, np.uint8)
                w.workspace.copy_to_host(got)
                assert np.array_equal(got, w.pinned.array[:w.layout.plan_bytes]), i
            return driver.get_current_context()
        assert _in_thread(steps) == 0
    finally:
        libcuda.ENTRY = before
