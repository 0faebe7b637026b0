"""DLPack import/export. CPU tier uses numpy and hand-made producers; the GPU
tier round-trips every dtype through torch and cupy."""
import ctypes
import gc
import weakref

import numpy as np
import pytest

from rtattn.runtime import ITEMSIZE, DLPackTensor, Stream, TensorView, as_tensor, export, normalize_dtype
from rtattn.runtime import dlpack as dl

NUMPY_DTYPES = ["float32", "float16", "float64", "int32", "int64", "int8", "uint8"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_import_numpy_every_dtype(dtype):
    a = np.arange(24).astype(dtype).reshape(2, 3, 4)
    v = as_tensor(a)
    assert (v.ptr, v.shape, v.strides, v.dtype) == (a.ctypes.data, (2, 3, 4), (12, 4, 1), dtype)
    assert v.device_type == "cpu" and v.is_contiguous() and v.nbytes == a.nbytes and v.itemsize == a.itemsize
    np.testing.assert_array_equal(v.numpy(), a)


def test_import_strided_numpy_view():
    a = np.arange(64, dtype=np.float32).reshape(8, 8)[1::2, ::4]
    v = as_tensor(a)
    assert v.shape == (4, 2) and v.strides == (16, 4) and not v.is_contiguous()
    assert v.ptr == a.ctypes.data
    np.testing.assert_array_equal(v.numpy(), a)


def test_import_keeps_producer_memory_alive():
    a = np.arange(1000, dtype=np.int32)
    ref = weakref.ref(a.base if a.base is not None else a)
    v = as_tensor(a)
    del a
    gc.collect()
    assert ref() is not None
    assert v.numpy().sum() == sum(range(1000))
    del v
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("bad", [np.zeros(3, np.complex64), np.zeros(3, bool)])
def test_unsupported_dtype(bad):
    with pytest.raises(TypeError, match="unsupported DLPack dtype"):
        as_tensor(bad)


def test_require_cuda_refuses_host_memory():
    with pytest.raises(ValueError, match="lives in cpu memory; rtattn needs CUDA device memory"):
        as_tensor(np.zeros(4, np.float32), require="cuda")
    with pytest.raises(ValueError, match="needs CUDA device memory"):
        as_tensor(as_tensor(np.zeros(4, np.float32)), require="cuda")


def test_not_a_tensor():
    with pytest.raises(TypeError, match="no __dlpack__"):
        as_tensor([1, 2, 3])


@pytest.mark.parametrize("dtype", list(dl.DTYPES))
@pytest.mark.parametrize("versioned", [False, True])
def test_export_capsule_structure(dtype, versioned):
    """Read our capsule back with raw ctypes, as a C consumer would."""
    t = export(0x7000_0000, (3, 5), dtype, device_id=1, strides=(10, 2))
    assert t.__dlpack_device__() == (2, 1)
    cap = t.__dlpack__(max_version=(1, 1) if versioned else None)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    assert ctypes.pythonapi.PyCapsule_IsValid(cap, name) == 1
    ptr = ctypes.pythonapi.PyCapsule_GetPointer(cap, name)
    m = (dl._DLManagedTensorVersioned if versioned else dl._DLManagedTensor).from_address(ptr)
    if versioned:
        assert (m.version.major, m.version.minor) == (1, 1) and m.flags == 0
    tt = m.dl_tensor
    assert tt.data == 0x7000_0000 and tt.ndim == 2 and tt.byte_offset == 0
    assert (tt.device.device_type, tt.device.device_id) == (2, 1)
    assert (tt.dtype.code, tt.dtype.bits, tt.dtype.lanes) == (*dl.DTYPES[dtype], 1)
    assert [tt.shape[i] for i in range(2)] == [3, 5] and [tt.strides[i] for i in range(2)] == [10, 2]
    before = dl.live_exports()
    del cap  # unconsumed: the capsule destructor must release the struct
    gc.collect()
    assert dl.live_exports() == before - 1


@pytest.mark.parametrize("dtype", list(dl.DTYPES))
@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 1)])
def test_export_import_roundtrip_every_dtype(dtype, max_version):
    """Also covers bf16/fp8 imports, which numpy cannot produce."""
    t = export(0x1000, (4, 2), dtype, device_id=0)
    v = as_tensor(t.__dlpack__(max_version=max_version))
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device_type) == (0x1000, (4, 2), (2, 1), dtype, "cuda")
    assert v.nbytes == 8 * ITEMSIZE[dtype]
    del v
    gc.collect()
    assert dl.live_exports() == 0


def test_export_to_numpy_zero_copy_and_owner_lifetime():
    class Owner:
        pass
    a = np.arange(12, dtype=np.float32)
    owner = Owner()
    owner.a = a
    ref = weakref.ref(owner)
    t = export(a.ctypes.data, (3, 4), "float32", owner=owner, device_type="cpu")
    del owner
    b = np.from_dlpack(t)
    del t
    gc.collect()
    assert ref() is not None  # the consumer still holds it
    b[0, 0] = 42.0
    assert a[0] == 42.0  # same memory
    del b
    gc.collect()
    assert ref() is None and dl.live_exports() == 0


def test_export_strided_to_numpy():
    a = np.arange(16, dtype=np.int32)
    t = export(a.ctypes.data, (4, 2), "int32", strides=(4, 2), owner=a, device_type="cpu")
    np.testing.assert_array_equal(np.from_dlpack(t), a.reshape(4, 4)[:, ::2])


def test_export_readonly_flag():
    a = np.arange(4, dtype=np.uint8)
    t = export(a.ctypes.data, (4,), "uint8", owner=a, device_type="cpu", readonly=True)
    assert as_tensor(t.__dlpack__(max_version=(1, 0))).readonly
    a.flags.writeable = False
    assert as_tensor(a).readonly


def test_export_errors():
    with pytest.raises(TypeError, match="unsupported dtype"):
        export(0, (2,), "complex64")
    with pytest.raises(ValueError, match="do not match"):
        export(0, (2, 2), "float32", strides=(1,))
    with pytest.raises(ValueError, match="negative strides"):
        export(0, (2,), "float32", strides=(-1,))
    t = export(0x10, (2,), "float32", device_id=0)
    with pytest.raises(BufferError, match="copy"):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        t.__dlpack__(dl_device=(1, 0))


def test_consumed_capsule_is_refused():
    cap = export(0x10, (2,), "float32").__dlpack__()
    as_tensor(cap)
    with pytest.raises(ValueError, match="already used"):
        as_tensor(cap)


class _CudaProducer:
    """A fake CUDA producer: records the stream handshake, never touches memory."""

    def __init__(self, legacy=False):
        self.legacy = legacy
        self.seen = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None, **kw):
        if self.legacy and max_version is not None:
            raise TypeError("unexpected keyword argument 'max_version'")
        self.seen.append((stream, max_version))
        return export(0xDEAD000, (8,), "bfloat16").__dlpack__(max_version=max_version)


def test_stream_handshake_values():
    p = _CudaProducer()
    v = as_tensor(p)
    assert v.dtype == "bfloat16" and v.device_type == "cuda"
    as_tensor(p, stream=Stream.wrap(0x4321))
    as_tensor(p, stream=0)  # legacy default stream as a handle -> 1 per spec
    as_tensor(p, stream=-1)
    assert [s for s, _ in p.seen] == [1, 0x4321, 1, -1]
    assert all(mv == (1, 1) for _, mv in p.seen)


def test_pre_1_0_producer_fallback():
    p = _CudaProducer(legacy=True)
    assert as_tensor(p, require="cuda").dtype == "bfloat16"
    assert p.seen == [(1, None)]


def test_numpy_producer_gets_no_stream():
    class NoStream:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None, max_version=None):
            assert stream is None
            return np.zeros(2, np.float32).__dlpack__(max_version=max_version)
    assert as_tensor(NoStream()).shape == (2,)


def test_normalize_dtype():
    assert normalize_dtype("bf16") == "bfloat16"
    assert normalize_dtype(np.float16) == "float16"
    assert normalize_dtype("torch.float8_e4m3fn") == "float8_e4m3fn"
    assert normalize_dtype("e5m2") == "float8_e5m2"
    with pytest.raises(TypeError, match="unsupported dtype"):
        normalize_dtype("complex64")


def test_tensorview_is_exportable():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    v = as_tensor(a)
    assert isinstance(v, TensorView) and not isinstance(v, DLPackTensor)
    np.testing.assert_array_equal(np.from_dlpack(v), a)


# ------------------------------------------------------------------ GPU tier
TORCH_DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int32", "int64", "uint8"]


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_export_roundtrip(device, dtype):
    torch = _torch()
    from rtattn.runtime import DeviceBuffer
    buf = DeviceBuffer(4 * 6 * ITEMSIZE[dtype])
    buf.memset(0)
    t = torch.from_dlpack(buf.as_tensor(dtype, (4, 6)))
    assert t.dtype == getattr(torch, dtype) and t.shape == (4, 6) and t.device.type == "cuda"
    assert t.data_ptr() == buf.ptr  # zero copy
    t.view(torch.uint8).fill_(0x3C)
    torch.cuda.synchronize()
    assert (buf.copy_to_host() == 0x3C).all()
    del buf  # torch keeps the memory alive
    gc.collect()
    assert (t.view(torch.uint8) == 0x3C).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_import_every_dtype(device, dtype):
    torch = _torch()
    x = torch.zeros(3, 8, dtype=torch.float32, device="cuda").to(getattr(torch, dtype))
    sl = x[:, 2:6]
    v = as_tensor(sl, require="cuda")
    assert v.dtype == dtype and v.shape == (3, 4) and v.strides == (8, 1)
    assert v.ptr == sl.data_ptr() and v.device_type == "cuda" and v.device_id == 0
    # and back to torch through our exporter
    back = torch.from_dlpack(export(v.ptr, v.shape, v.dtype, v.device_id, v.strides, owner=v))
    assert back.data_ptr() == sl.data_ptr() and back.stride() == sl.stride()


@pytest.mark.gpu
def test_torch_stream_handshake(device):
    torch = _torch()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.ones(1 << 20, device="cuda")
    v = as_tensor(x, stream=Stream.wrap(s))
    assert v.numel == 1 << 20
    from rtattn.runtime import DeviceBuffer
    buf = DeviceBuffer(64)
    mine = Stream()
    buf.memset(1, stream=mine)
    t = torch.from_dlpack(buf.as_tensor("uint8", (64,), stream=mine))
    assert int(t.sum()) == 64


CUPY_DTYPES = ["float32", "float16", "int32", "int64", "uint8"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", CUPY_DTYPES)
def test_cupy_roundtrip(device, dtype):
    cupy = pytest.importorskip("cupy")
    from rtattn.runtime import DeviceBuffer
    buf = DeviceBuffer(32 * ITEMSIZE[dtype])
    buf.memset(0)
    c = cupy.from_dlpack(buf.as_tensor(dtype, (4, 8)))
    assert c.data.ptr == buf.ptr and c.dtype == np.dtype(dtype)
    c += 1
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(buf.copy_to_host().view(dtype), np.ones(32, dtype))
    v = as_tensor(c[:, 1:3])
    assert v.ptr == c.data.ptr + ITEMSIZE[dtype] and v.strides == (8, 1) and v.dtype == dtype


# ------------------------------------------------------------ property tests
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       dtype=st.sampled_from(list(dl.DTYPES)), versioned=st.booleans(), data=st.data())
def test_roundtrip_any_shape_strides_dtype(shape, dtype, versioned, data):
    strides = data.draw(st.lists(st.integers(0, 64), min_size=len(shape), max_size=len(shape)))
    t = export(0x4000, shape, dtype, strides=strides)
    v = as_tensor(t.__dlpack__(max_version=(1, 1) if versioned else None))
    assert (v.shape, v.strides, v.dtype, v.ptr) == (tuple(shape), tuple(strides), dtype, 0x4000)
    assert v.numel == int(np.prod(shape)) and v.nbytes == v.numel * ITEMSIZE[dtype]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(1, 9), r0=st.integers(0, 3), step=st.integers(1, 3),
       dtype=st.sampled_from(NUMPY_DTYPES))
def test_numpy_slices_view_the_same_bytes(rows, cols, r0, step, dtype):
    a = np.arange(rows * cols).astype(dtype).reshape(rows, cols)[r0::step, ::step]
    v = as_tensor(a)
    np.testing.assert_array_equal(v.numpy(), a)
    assert v.ptr == a.ctypes.data and v.is_contiguous() == a.flags.c_contiguous
    if a.size:  # numel_span reaches exactly the last element
        last = a.ctypes.data + sum((n - 1) * s for n, s in zip(a.shape, a.strides))
        assert v.ptr + (dl.numel_span(v.shape, v.strides) - 1) * v.itemsize == last
