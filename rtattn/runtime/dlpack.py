"""DLPack exchange: import any ``__dlpack__`` producer as a :class:`TensorView`,
and export device memory to any consumer (torch, cupy, jax, numpy).

Written with ctypes against the DLPack 1.x C ABI because cuda.core's exporter
refuses bf16 and fp8. Both capsule flavours are handled: ``dltensor_versioned``
(DLPack >= 1.0) and the legacy ``dltensor``.
"""
from __future__ import annotations

import ctypes
import math
import threading
import weakref
from ctypes import POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DTYPES", "ITEMSIZE", "TensorView", "DLPackTensor", "as_tensor", "export",
    "normalize_dtype", "numpy_dtype", "numel_span", "contiguous_strides",
]

# ------------------------------------------------------------------ dtypes
# rtattn's dtype names -> (DLDataTypeCode, bits). Codes from dlpack.h 1.1.
_kDLInt, _kDLUInt, _kDLFloat, _kDLBfloat = 0, 1, 2, 4
_kDLFloat8_e4m3fn, _kDLFloat8_e5m2 = 10, 12

DTYPES: dict[str, tuple[int, int]] = {
    "float32": (_kDLFloat, 32),
    "float16": (_kDLFloat, 16),
    "bfloat16": (_kDLBfloat, 16),
    "float8_e4m3fn": (_kDLFloat8_e4m3fn, 8),
    "float8_e5m2": (_kDLFloat8_e5m2, 8),
    "int32": (_kDLInt, 32),
    "int64": (_kDLInt, 64),
    "uint8": (_kDLUInt, 8),
    # Not kernel dtypes, but handy for references and indices.
    "float64": (_kDLFloat, 64),
    "int8": (_kDLInt, 8),
}
ITEMSIZE: dict[str, int] = {k: bits // 8 for k, (_, bits) in DTYPES.items()}
_BY_CODE = {v: k for k, v in DTYPES.items()}

_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "double": "float64", "fp64": "float64",
}


def normalize_dtype(dtype) -> str:
    """An rtattn dtype name from a name, alias, numpy dtype or torch dtype."""
    s = str(dtype).removeprefix("torch.")
    if s not in DTYPES:
        try:
            s = np.dtype(dtype).name
        except TypeError:
            s = _ALIASES.get(s, s)
    s = _ALIASES.get(s, s)
    if s not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype!r}; rtattn supports {', '.join(DTYPES)}")
    return s


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for ``dtype``; bf16/fp8 have none (raises TypeError)."""
    name = normalize_dtype(dtype)
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"numpy has no {name} dtype (ml_dtypes is not a dependency)") from None


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def numel_span(shape, strides=None) -> int:
    """Elements from the first to one past the last addressed element."""
    shape = tuple(int(n) for n in shape)
    if any(n == 0 for n in shape):
        return 0
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


# ------------------------------------------------------------ C structures
class _DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", _DLDevice), ("ndim", c_int32), ("dtype", _DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, c_void_p)


class _DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", _DELETER)]


class _DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class _DLManagedTensorVersioned(Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", c_void_p), ("deleter", _DELETER),
                ("flags", c_uint64), ("dl_tensor", _DLTensor)]


_FLAG_READ_ONLY = 1
DLPACK_VERSION = (1, 1)

_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
_DEVICE_NAMES = {_kDLCPU: "cpu", _kDLCUDA: "cuda", _kDLCUDAHost: "cuda_host", _kDLCUDAManaged: "cuda_managed",
                 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm", 11: "rocm_host", 14: "oneapi"}
_DEVICE_CODES = {v: k for k, v in _DEVICE_NAMES.items()}
_CUDA_READABLE = ("cuda", "cuda_managed")  # what a kernel may dereference

# Capsule names must outlive the capsules (the capsule stores the pointer).
_N_LEGACY, _N_LEGACY_USED = c_char_p(b"dltensor"), c_char_p(b"used_dltensor")
_N_VERS, _N_VERS_USED = c_char_p(b"dltensor_versioned"), c_char_p(b"used_dltensor_versioned")

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_SetName.restype = c_int
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, c_void_p)
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, _CAPSULE_DESTRUCTOR]
_api.PyCapsule_New.restype = ctypes.py_object
# Raw-pointer twins for the capsule destructor: converting a dying object to
# py_object there would resurrect it.
_raw_is_valid = ctypes.PYFUNCTYPE(c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", _api))


# ------------------------------------------------------------- TensorView
@dataclass
class TensorView:
    """A borrowed strided tensor: what rtattn kernels are given.

    ``strides`` are in elements. ``owner`` keeps the memory alive (the producer,
    or the DLPack import that must call the producer's deleter).
    """
    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device_type: str = "cuda"
    device_id: int = 0
    owner: object = field(default=None, repr=False, compare=False)
    readonly: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        """C-contiguous (size-1 dims may have any stride; empty tensors are)."""
        if self.numel == 0:
            return True
        expect = contiguous_strides(self.shape)
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.strides, expect))

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view of host memory (cpu / cuda_host / cuda_managed)."""
        if self.device_type not in ("cpu", "cuda_host", "cuda_managed"):
            raise ValueError(f"numpy() needs host-accessible memory, this tensor is on {self.device_type}")
        dt = numpy_dtype(self.dtype)
        holder = _ArrayHolder(self, {
            "data": (self.ptr, self.readonly), "shape": tuple(self.shape), "typestr": dt.str,
            "strides": tuple(s * dt.itemsize for s in self.strides), "version": 3})
        return np.asarray(holder)

    # A TensorView can be handed straight back to any DLPack consumer.
    def __dlpack_device__(self):
        return (_DEVICE_CODES.get(self.device_type, _kDLCUDA), self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        _check_export_request(self, dl_device, copy)
        _stream_handshake(getattr(self, "stream", None), stream, self.device_type, self.device_id)
        return _new_capsule(self, max_version)


class _ArrayHolder:
    def __init__(self, owner, iface):
        self.owner = owner
        self.__array_interface__ = iface


# ------------------------------------------------------------------ import
class _Imported:
    """Holds a consumed DLManagedTensor; calls the producer's deleter once."""

    def __init__(self, managed_ptr: int, versioned: bool, producer):
        self.producer = producer  # belt and braces: some producers' deleters are lax
        self.managed_ptr = managed_ptr
        self._finalizer = weakref.finalize(self, _call_deleter, managed_ptr, versioned)


def _call_deleter(ptr: int, versioned: bool) -> None:
    m = (_DLManagedTensorVersioned if versioned else _DLManagedTensor).from_address(ptr)
    if m.deleter:
        m.deleter(ptr)


def _consumer_stream(stream) -> int:
    """The DLPack ``stream=`` value for a CUDA producer: 1 means legacy default."""
    if stream is None:
        return 1
    if isinstance(stream, int) and stream == -1:
        return -1  # explicit "no synchronization"
    from .stream import as_stream
    h = as_stream(stream).handle
    return 1 if h == 0 else h


def as_tensor(obj, stream=None, *, require: str | None = None, keep_producer: bool = True) -> TensorView:
    """View ``obj`` (a DLPack producer, a DLPack capsule, or a TensorView).

    ``stream``: the consumer stream the data will be read on (CUDA producers
    order their pending writes before it). ``require="cuda"`` refuses memory a
    kernel cannot read (numpy arrays, pinned host tensors). ``keep_producer=False``:
    the view holds the DLPack import (which keeps the memory alive) but not ``obj``
    itself, so a cache of views can let ``obj`` die (rtattn.tensors.TensorImports).
    """
    if isinstance(obj, TensorView):
        view = obj
    elif type(obj).__name__ == "PyCapsule":
        view = _from_capsule(obj, None)
    elif hasattr(obj, "__dlpack__"):
        dev = _device_of(obj)
        if require == "cuda" and dev not in _CUDA_READABLE:
            raise ValueError(f"{type(obj).__name__} lives in {dev} memory; rtattn needs CUDA device memory here")
        kwargs = {"stream": _consumer_stream(stream)} if dev in ("cuda", "rocm") else {}
        try:
            cap = obj.__dlpack__(max_version=DLPACK_VERSION, **kwargs)
        except TypeError:  # pre-1.0 producers do not know max_version
            cap = obj.__dlpack__(**kwargs)
        view = _from_capsule(cap, obj if keep_producer else None)
    else:
        raise TypeError(f"cannot view {type(obj).__name__} as a tensor: it has no __dlpack__ "
                        f"(pass a torch/cupy/jax/numpy array or a TensorView)")
    if require == "cuda" and view.device_type not in _CUDA_READABLE:
        raise ValueError(f"tensor lives in {view.device_type} memory; rtattn needs CUDA device memory here")
    return view


def _device_of(obj) -> str:
    if not hasattr(obj, "__dlpack_device__"):
        return "cpu"
    code, _ = obj.__dlpack_device__()
    return _DEVICE_NAMES.get(int(code), f"dldevice{int(code)}")


def _from_capsule(cap, producer) -> TensorView:
    if _api.PyCapsule_IsValid(cap, _N_VERS):
        versioned, name, used = True, _N_VERS, _N_VERS_USED
    elif _api.PyCapsule_IsValid(cap, _N_LEGACY):
        versioned, name, used = False, _N_LEGACY, _N_LEGACY_USED
    else:
        raise ValueError("not an unconsumed DLPack capsule (already used, or not 'dltensor[_versioned]')")
    ptr = _api.PyCapsule_GetPointer(cap, name)
    if versioned:
        m = _DLManagedTensorVersioned.from_address(ptr)
        if m.version.major != DLPACK_VERSION[0]:
            raise BufferError(f"DLPack major version {m.version.major} is not supported (need {DLPACK_VERSION[0]})")
        readonly = bool(m.flags & _FLAG_READ_ONLY)
    else:
        m = _DLManagedTensor.from_address(ptr)
        readonly = False
    t = m.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _BY_CODE.get((code, bits)) if lanes == 1 else None
    if dtype is None:  # capsule stays unconsumed: its destructor frees it
        raise TypeError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes}); "
                        f"rtattn supports {', '.join(DTYPES)}")
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else contiguous_strides(shape)
    dev = _DEVICE_NAMES.get(t.device.device_type, f"dldevice{t.device.device_type}")
    data = (t.data or 0) + t.byte_offset
    if _api.PyCapsule_SetName(cap, used) != 0:
        raise RuntimeError("PyCapsule_SetName failed")
    owner = _Imported(ptr, versioned, producer)
    return TensorView(ptr=data, shape=shape, strides=strides, dtype=dtype, device_type=dev,
                      device_id=t.device.device_id, owner=owner, readonly=readonly)


# ------------------------------------------------------------------ export
@dataclass
class DLPackTensor(TensorView):
    """A TensorView made by :func:`export`; ``stream`` is the producer stream
    whose pending writes consumers are ordered after."""
    stream: object = field(default=None, repr=False, compare=False)


def export(ptr: int, shape, dtype, device_id: int = 0, strides=None, owner=None, *,
           stream=None, device_type: str = "cuda", readonly: bool = False) -> DLPackTensor:
    """Describe memory at ``ptr`` so any DLPack consumer can use it without a copy.
    ``owner`` is kept alive for as long as any consumer holds the memory."""
    dtype = normalize_dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ValueError(f"strides {strides} do not match shape {shape}")
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides {strides} are not supported")
    if device_type not in _DEVICE_CODES:
        raise ValueError(f"unknown device_type {device_type!r}")
    return DLPackTensor(ptr=int(ptr), shape=shape, strides=strides, dtype=dtype, device_type=device_type,
                        device_id=int(device_id), owner=owner, readonly=readonly, stream=stream)


def _check_export_request(view: TensorView, dl_device, copy) -> None:
    if copy:
        raise BufferError("rtattn tensors export without copies only (copy=True requested)")
    if dl_device is not None and tuple(dl_device) != view.__dlpack_device__():
        raise BufferError(f"cannot export to device {tuple(dl_device)}: the tensor is on {view.__dlpack_device__()}")


def _stream_handshake(producer, consumer, device_type: str, device_id: int = 0) -> None:
    """Order the consumer stream after the producer stream (DLPack semantics); both are streams
    of the tensor's device."""
    if producer is None or consumer is None or consumer == -1 or device_type != "cuda":
        return
    from .stream import Event, as_stream
    prod = as_stream(producer).handle
    cons = {1: 0}.get(consumer, consumer)  # 1 = legacy default; 2 = per-thread (a valid handle)
    if prod != cons:
        Event(timing=False, device=device_id).link(prod, cons)


_live_lock = threading.Lock()
_LIVE: dict[int, tuple] = {}  # struct address -> (struct, shape, strides, view) until the deleter runs


@_DELETER
def _deleter(ptr):
    with _live_lock:
        _LIVE.pop(ptr, None)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(cap):
    # Unconsumed capsule (consumers rename it to used_*): free it ourselves.
    for name in (_N_VERS, _N_LEGACY):
        if _raw_is_valid(cap, name):
            p = _raw_get_pointer(cap, name)
            if p:
                _deleter(p)
            return


def _new_capsule(view: TensorView, max_version):
    ndim = len(view.shape)
    shape = (c_int64 * max(ndim, 1))(*view.shape)
    strides = (c_int64 * max(ndim, 1))(*view.strides)
    versioned = max_version is not None and tuple(max_version)[0] >= 1
    if versioned:
        m = _DLManagedTensorVersioned()
        m.version.major = 1
        m.version.minor = min(DLPACK_VERSION[1], tuple(max_version)[1]) if tuple(max_version)[0] == 1 \
            else DLPACK_VERSION[1]
        m.flags = _FLAG_READ_ONLY if view.readonly else 0
    else:
        m = _DLManagedTensor()
    t = m.dl_tensor
    t.data = view.ptr or None
    t.device.device_type, t.device.device_id = view.__dlpack_device__()
    t.ndim = ndim
    t.dtype.code, t.dtype.bits = DTYPES[view.dtype]
    t.dtype.lanes = 1
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    t.strides = ctypes.cast(strides, POINTER(c_int64))
    t.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _deleter
    addr = ctypes.addressof(m)
    with _live_lock:
        _LIVE[addr] = (m, shape, strides, view)  # view -> owner: memory stays alive
    return _api.PyCapsule_New(addr, _N_VERS if versioned else _N_LEGACY, _capsule_destructor)


def live_exports() -> int:
    """Exported capsules whose consumers have not released them (for tests)."""
    return len(_LIVE)
