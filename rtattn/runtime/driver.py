"""The driver layer: one error funnel, device discovery, primary contexts.

Every cuda.bindings driver/NVRTC call in rtattn goes through :func:`check`, so
an error always names the call and the CUresult/nvrtcResult. "No GPU" is an
ordinary state: :func:`has_device` answers quickly and never raises, and
:class:`Device` raises :class:`NoDeviceError` at once instead of letting a lazy
driver path hang (see shared/DESIGN.md).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

__all__ = [
    "CudaError", "NoDeviceError", "check", "has_device", "device_count",
    "no_device_reason", "DeviceProps", "Device", "current_device", "stream_device",
]


class CudaError(RuntimeError):
    """A failed driver or NVRTC call; ``call`` and ``result_name`` say which and why."""

    def __init__(self, message: str, call: str = "", result_name: str = ""):
        super().__init__(message)
        self.call = call
        self.result_name = result_name

    def __reduce__(self):  # picklable across processes (multiprocessing pools)
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls, args, state):
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class NoDeviceError(CudaError):
    """No usable CUDA device (no driver library, no GPU, or driver init failed)."""


def _result_text(res) -> tuple[str, str]:
    """(name, description) for a CUresult or nvrtcResult, without raising."""
    name = getattr(res, "name", str(res))
    desc = ""
    try:
        if isinstance(res, cu.CUresult):
            err, s = cu.cuGetErrorString(res)
            if err == cu.CUresult.CUDA_SUCCESS and s:
                desc = s.decode(errors="replace")
        elif isinstance(res, nvrtc.nvrtcResult):
            err, s = nvrtc.nvrtcGetErrorString(res)
            if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and s:
                desc = s.decode(errors="replace")
    except Exception:  # the driver library may be absent; the name is enough
        pass
    return name, desc


_OK = (cu.CUresult.CUDA_SUCCESS, nvrtc.nvrtcResult.NVRTC_SUCCESS)


def check(ret, call: str):
    """Check a cuda.bindings return value ``(result, *values)``.

    Raises :class:`CudaError` ("<call> failed: CUDA_ERROR_XXX (description)") on
    failure; returns None, the single value, or the tuple of values.
    """
    if isinstance(ret, tuple):
        res, values = ret[0], ret[1:]
    else:
        res, values = ret, ()
    if res not in _OK:
        name, desc = _result_text(res)
        msg = f"{call} failed: {name}" + (f" ({desc})" if desc else "")
        cls = NoDeviceError if name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NOT_INITIALIZED") else CudaError
        raise cls(msg, call=call, result_name=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------- discovery

_probe_lock = threading.Lock()
_probe: tuple[int, str] | None = None  # (device count, reason when 0)


def _probe_driver() -> tuple[int, str]:
    """Load libcuda ourselves first: if that fails, never call into cuda.bindings'
    lazy loader (which can misbehave after a failed load)."""
    global _probe
    with _probe_lock:
        if _probe is not None:
            return _probe
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _probe = (0, f"no NVIDIA driver (libcuda.so.1 not loadable: {e})")
            return _probe
        try:
            check(cu.cuInit(0), "cuInit")
            n = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
            _probe = (int(n), "" if n else "the driver reports 0 CUDA devices")
        except Exception as e:  # CudaError, or RuntimeError from the bindings' loader
            _probe = (0, f"CUDA driver unusable: {e}")
        return _probe


def has_device() -> bool:
    """True if at least one CUDA device is usable. Never raises, never hangs."""
    return _probe_driver()[0] > 0


def device_count() -> int:
    return _probe_driver()[0]


def no_device_reason() -> str:
    """Why :func:`has_device` is False ("" when a device is present)."""
    return _probe_driver()[1]


# ------------------------------------------------------------------- device

@dataclass(frozen=True)
class DeviceProps:
    """The limits the tile chooser and launchers need, read once per device."""
    name: str
    sm_count: int
    smem_per_sm: int
    smem_per_block: int
    smem_per_block_optin: int
    regs_per_sm: int
    regs_per_block: int
    max_threads_per_sm: int
    l2_bytes: int
    cc: tuple[int, int]


_A = cu.CUdevice_attribute
_PROP_ATTRS = {
    "sm_count": _A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    "smem_per_sm": _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    "smem_per_block": _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
    "smem_per_block_optin": _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    "regs_per_sm": _A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
    "regs_per_block": _A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK,
    "max_threads_per_sm": _A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
    "l2_bytes": _A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
}

_devices: dict[int, "Device"] = {}
_devices_lock = threading.Lock()


# ------------------------------------------------------- the current context
# The driver keeps one current context per thread, and torch/cupy read theirs from it
# (cudaGetDevice is the current context's device). So rtattn never trusts a cache of it (a
# framework may have switched it since) and never leaves it changed: every driver call that
# needs a context runs between Device.enter() and Device.leave(), which read the thread's
# current context, switch only when it is not this device's, and restore it after.

class _CtxCalls:
    """cuCtxGetCurrent / cuCtxSetCurrent through ctypes when libcuda exports them, else through the
    bindings. get() is on every launch's path: the driver writes into a per-thread buffer given by
    address (~0.4 us a call; byref and cuda.bindings cost 3-4x that)."""

    def __init__(self):
        self.get = self.set = None

    def load(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            get = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(("cuCtxGetCurrent", lib))
            put = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(("cuCtxSetCurrent", lib))
        except (OSError, AttributeError):
            self.get, self.set = _bindings_get_current, _bindings_set_current
            return self
        tls = threading.local()

        def get_current() -> int:
            try:
                buf, addr = tls.out
            except AttributeError:
                buf = ctypes.c_void_p()
                buf, addr = tls.out = (buf, ctypes.addressof(buf))
            res = get(addr)
            if res:
                check((cu.CUresult(res),), "cuCtxGetCurrent")
            return buf.value or 0

        def set_current(handle: int) -> None:
            res = put(handle or None)
            if res:
                check((cu.CUresult(res),), "cuCtxSetCurrent")
        self.get, self.set = get_current, set_current
        return self


def _bindings_get_current() -> int:
    return int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0)


def _bindings_set_current(handle: int) -> None:
    check(cu.cuCtxSetCurrent(cu.CUcontext(handle)), "cuCtxSetCurrent")


_ctx_calls = _CtxCalls()


def get_current_context() -> int:
    """The calling thread's current context as an int (0: none)."""
    if _ctx_calls.get is None:
        _ctx_calls.load()
    return _ctx_calls.get()


def set_current_context(handle: int) -> None:
    """Make context `handle` (an int, 0: none) current on the calling thread."""
    if _ctx_calls.set is None:
        _ctx_calls.load()
    _ctx_calls.set(handle)


class _Active:
    """`with device.active():` -- the device's context current inside, the caller's after."""
    __slots__ = ("device", "prev")

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.prev = self.device.enter()
        return self.device

    def __exit__(self, *exc):
        Device.leave(self.prev)


class Device:
    """A CUDA device and its primary context (cached per ordinal).

    ``Device()`` raises :class:`NoDeviceError` at once on a GPU-less machine.
    The primary context is shared with torch/cupy, so memory and streams
    interoperate without copies.
    """

    def __new__(cls, ordinal: int = 0):
        if isinstance(ordinal, Device):
            return ordinal
        ordinal = int(ordinal)
        with _devices_lock:
            dev = _devices.get(ordinal)
            if dev is not None:
                return dev
            n, reason = _probe_driver()
            if n == 0:
                raise NoDeviceError(f"no CUDA device: {reason}", call="cuDeviceGet",
                                    result_name="CUDA_ERROR_NO_DEVICE")
            if not 0 <= ordinal < n:
                raise ValueError(f"device ordinal {ordinal} out of range: {n} device(s) present")
            dev = super().__new__(cls)
            dev._init(ordinal)
            _devices[ordinal] = dev
            return dev

    def _init(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self._ctx = None
        self.context_handle = 0   # int(self.context) once retained
        self.streams_checked: set = set()   # stream handles seen to be this device's (launch.check_stream)
        self._ctx_lock = threading.Lock()
        raw = check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        self.name = raw.split(b"\0", 1)[0].decode(errors="replace")
        vals = {k: int(check(cu.cuDeviceGetAttribute(a, self.handle), f"cuDeviceGetAttribute({a.name})"))
                for k, a in _PROP_ATTRS.items()}
        major = check(cu.cuDeviceGetAttribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle),
                      "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)")
        minor = check(cu.cuDeviceGetAttribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle),
                      "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)")
        self.props = DeviceProps(name=self.name, cc=(int(major), int(minor)), **vals)

    @property
    def arch(self) -> str:
        """NVRTC arch for this device, e.g. "sm_90" (append "a" yourself for wgmma)."""
        major, minor = self.props.cc
        return f"sm_{major}{minor}"

    @property
    def context(self):
        """The retained primary context (retained once, released never: it lives
        as long as the process, like torch's)."""
        if self._ctx is None:
            with self._ctx_lock:
                if self._ctx is None:
                    ctx = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
                    self.context_handle = int(ctx)
                    self._ctx = ctx
        return self._ctx

    def enter(self):
        """Make this device's primary context current on the calling thread; returns what
        leave() restores (None when it already was current: nothing to undo)."""
        mine = self.context_handle or int(self.context)
        prev = (_ctx_calls.get or _ctx_calls.load().get)()
        if prev == mine:
            return None
        set_current_context(mine)
        return prev

    @staticmethod
    def leave(prev) -> None:
        """Undo enter(): the caller's context (or none) current again."""
        if prev is not None:
            set_current_context(prev)

    def active(self) -> _Active:
        """`with device.active():` runs driver calls in this device's context and leaves the
        thread's current context as it found it."""
        return _Active(self)

    def set_current(self) -> "Device":
        """Make this device's primary context current on the calling thread, and leave it so
        (what torch.cuda.set_device does); rtattn itself uses active() instead."""
        set_current_context(self.context_handle or int(self.context))
        return self

    def synchronize(self) -> None:
        with self.active():
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes on this device."""
        with self.active():
            free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def __repr__(self) -> str:
        return f"Device({self.ordinal}, {self.name!r}, {self.arch})"


def current_device(device=None) -> Device:
    """The Device to use: ``device`` (an ordinal or a Device) if given, else the device whose
    primary context is current on the calling thread (what torch.cuda.set_device or cupy's
    Device.use chose), else device 0. The thread's current context is left as it is."""
    if device is not None:
        return Device(device)
    if has_device():
        ctx = get_current_context()
        if ctx:
            dev = _retained_device(ctx)
            if dev is not None:
                return dev
            res, ordinal = cu.cuCtxGetDevice()
            if res == cu.CUresult.CUDA_SUCCESS:
                return Device(int(ordinal))
    return Device(0)


def _retained_device(ctx: int) -> Device | None:
    """The Device whose retained primary context is `ctx`, if rtattn has retained it."""
    for dev in list(_devices.values()):
        if dev.context_handle == ctx:
            return dev
    return None


def stream_device(handle: int) -> Device | None:
    """The device of stream `handle`: None for the legacy and per-thread default streams (0, 1,
    2: they mean the current context's), else the device whose primary context owns it."""
    if handle in (0, 1, 2):
        return None
    ctx = int(check(cu.cuStreamGetCtx(cu.CUstream(handle)), "cuStreamGetCtx"))
    dev = _retained_device(ctx)
    if dev is not None:
        return dev
    prev = get_current_context()
    set_current_context(ctx)   # cuCtxGetDevice answers for the current context
    try:
        return Device(int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice")))
    finally:
        set_current_context(prev)
