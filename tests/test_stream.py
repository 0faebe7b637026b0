"""Streams (owned, borrowed, foreign) and events."""
import time

import pytest
from cuda.bindings import driver as cu

from rtattn.runtime import DeviceBuffer, Event, NoDeviceError, Stream, as_stream, has_device


class _Proto:  # the CUDA stream protocol
    def __cuda_stream__(self):
        return (0, 0xABC)


class _TorchLike:
    cuda_stream = 0x1234


class _CupyLike:
    ptr = 0x5678


def test_wrap_handles_and_foreign_objects():
    assert Stream.wrap(0x99).handle == 0x99
    assert Stream.wrap(cu.CUstream(0x77)).handle == 0x77
    assert Stream.wrap(_Proto()).handle == 0xABC
    assert Stream.wrap(_TorchLike()).handle == 0x1234
    assert Stream.wrap(_CupyLike()).handle == 0x5678
    s = Stream.wrap(0x42)
    assert Stream.wrap(s) is s and as_stream(s) is s
    assert not s.owned and s.__cuda_stream__() == (0, 0x42) and int(s) == 0x42


def test_default_stream():
    assert as_stream(None).handle == 0
    assert Stream.default().handle == 0
    assert Stream.default() == as_stream(0)


def test_wrap_keeps_foreign_object_alive():
    obj = _Proto()
    s = Stream.wrap(obj)
    assert s._owner is obj


def test_wrap_rejects_junk():
    with pytest.raises(TypeError, match="cannot use str as a CUDA stream"):
        Stream.wrap("stream")


@pytest.mark.skipif(has_device(), reason="GPU-less path")
def test_owned_stream_needs_device():
    with pytest.raises(NoDeviceError):
        Stream()
    with pytest.raises(NoDeviceError):
        Event()


@pytest.mark.gpu
def test_owned_stream_lifecycle(device):
    with Stream() as s:
        assert s.owned and s.handle != 0
        s.synchronize()
    s.close()  # idempotent


@pytest.mark.gpu
def test_events_elapsed_and_query(device):
    s = Stream()
    buf = DeviceBuffer(64 << 20)
    start, end = Event(), Event()
    start.record(s)
    for _ in range(20):
        buf.memset(7, stream=s)
    end.record(s)
    end.synchronize()
    assert end.query()
    ms = start.elapsed_ms(end)
    assert 0.0 < ms < 10_000.0
    nt = Event(timing=False)
    nt.record(s)
    with pytest.raises(ValueError, match="timing=True"):
        nt.elapsed_ms(end)


@pytest.mark.gpu
def test_stream_wait_orders_work(device):
    a, b = Stream(), Stream()
    buf = DeviceBuffer(1 << 20)
    buf.memset(1, stream=a)
    ev = Event(timing=False).record(a)
    b.wait(ev)
    buf.memset(2, stream=b)
    b.synchronize()
    assert (buf.copy_to_host() == 2).all()


@pytest.mark.gpu
def test_wrap_torch_and_cupy_streams(device):
    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()
    assert Stream.wrap(ts).handle == ts.cuda_stream
    Stream.wrap(ts).synchronize()
    try:
        import cupy
    except Exception:
        return
    cs = cupy.cuda.Stream(non_blocking=True)
    assert Stream.wrap(cs).handle == cs.ptr


@pytest.mark.gpu
def test_many_streams_and_events_release(device):
    t0 = time.perf_counter()
    for _ in range(2000):
        with Stream() as s:
            Event(timing=False).record(s).close()
    assert time.perf_counter() - t0 < 30


@pytest.mark.gpu
def test_fresh_thread_needs_no_explicit_context(device):
    """Borrowed/default streams and raw copies work on a thread that never
    made a context current (worker threads of a serving loop)."""
    import threading

    import numpy as np

    from rtattn.runtime import memcpy_dtoh_async, memcpy_htod_async
    buf = DeviceBuffer(64)
    errors = []

    def worker():
        try:
            src = np.arange(16, dtype=np.int32)
            dst = np.empty_like(src)
            memcpy_htod_async(buf.ptr, src.ctypes.data, 64, None)
            memcpy_dtoh_async(dst.ctypes.data, buf.ptr, 64, None)
            as_stream(None).synchronize()
            assert (dst == src).all()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
