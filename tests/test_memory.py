"""Device and pinned buffers, copies, deterministic release."""
import gc

import numpy as np
import pytest

from rtattn.runtime import (DeviceBuffer, Event, NoDeviceError, PinnedBuffer, Stream, has_device,
                            memcpy_dtoh_async, memcpy_htod_async)


@pytest.mark.skipif(has_device(), reason="GPU-less path")
def test_buffers_need_a_device():
    with pytest.raises(NoDeviceError):
        DeviceBuffer(1024)
    with pytest.raises(NoDeviceError):
        PinnedBuffer(1024)


@pytest.mark.gpu
def test_roundtrip_memset_and_offsets(device):
    with DeviceBuffer(4096) as buf:
        buf.memset(0xAB)
        assert (buf.copy_to_host() == 0xAB).all()
        a = np.arange(256, dtype=np.float32)
        buf.copy_from_host(a, offset=1024)
        out = np.empty(256, np.float32)
        buf.copy_to_host(out, offset=1024)
        np.testing.assert_array_equal(out, a)
        other = DeviceBuffer(1024)
        other.copy_from_device(buf.ptr + 1024, 1024)
        np.testing.assert_array_equal(other.copy_to_host().view(np.float32), a)
    assert buf.freed
    with pytest.raises(ValueError, match="after free"):
        buf.memset(0)


@pytest.mark.gpu
def test_range_checks(device):
    buf = DeviceBuffer(64)
    with pytest.raises(ValueError, match="outside"):
        buf.copy_from_host(np.zeros(65, np.uint8))
    with pytest.raises(ValueError, match="outside"):
        buf.copy_from_host(np.zeros(8, np.uint8), offset=60)
    with pytest.raises(ValueError, match="C-contiguous"):
        buf.copy_from_host(np.zeros((8, 8), np.uint8)[:, ::2])
    assert DeviceBuffer(0).ptr == 0


@pytest.mark.gpu
def test_pinned_async_copies(device):
    n = 1 << 20
    host = PinnedBuffer(4 * n)
    back = PinnedBuffer(4 * n)
    src = host.view(np.float32, 0, n)
    src[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    s = Stream()
    dbuf = DeviceBuffer(4 * n)
    start, end = Event(), Event()
    start.record(s)
    dbuf.copy_from_host(src, stream=s)
    dbuf.copy_to_host(back.view(np.float32, 0, n), stream=s)
    end.record(s)
    s.synchronize()
    np.testing.assert_array_equal(back.view(np.float32, 0, n), src)
    assert start.elapsed_ms(end) > 0
    # the thin wrappers too
    memcpy_htod_async(dbuf.ptr, host.ptr, 16, s)
    memcpy_dtoh_async(back.ptr, dbuf.ptr, 16, s)
    s.synchronize()


@pytest.mark.gpu
def test_pinned_views(device):
    p = PinnedBuffer(256)
    assert p.array.dtype == np.uint8 and p.array.shape == (256,)
    v = p.view(np.int32, 16, 4)
    v[:] = [1, 2, 3, 4]
    assert p.array[16:32].view(np.int32).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="aligned"):
        p.view(np.int32, 2, 1)
    with pytest.raises(ValueError, match="outside"):
        p.view(np.int64, 248, 2)
    # a view keeps the buffer alive
    v2 = PinnedBuffer(64).view(np.uint8)
    gc.collect()
    v2[:] = 3
    assert v2.sum() == 192
    p.free()
    p.free()
    with pytest.raises(ValueError, match="after free"):
        p.array


@pytest.mark.gpu
@pytest.mark.serial
def test_no_leak_over_10000_cycles(device):
    DeviceBuffer(1 << 20).free()  # warm up the allocator
    device.synchronize()
    free_before, _ = device.mem_info()
    for i in range(10_000):
        b = DeviceBuffer(1 << 20)
        if i % 2:
            b.free()
        else:
            del b  # the finalizer path
    device.synchronize()
    free_after, _ = device.mem_info()
    assert free_before - free_after < 64 << 20, (free_before, free_after)


@pytest.mark.gpu
def test_pinned_no_leak(device):
    for _ in range(500):
        with PinnedBuffer(1 << 20):
            pass
