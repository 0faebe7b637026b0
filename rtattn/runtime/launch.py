"""The one launch path: a kernel call is (function, grid, block, smem, params, pdl); a launch is
a list of calls enqueued in order on one stream.

Every family (decode, prefill, cascade) ends in a Launch; graphs capture and update Launches.
What a call needs is prepared once, when it is built: the launch configuration with its PDL
attribute, the argument pointer array, the node-parameter struct graphs update with. Enqueuing
then sets the stream and makes one driver call per kernel (libcuda.py: a direct ctypes call by
default, cuda.bindings as the alternative entry).

Arguments live in `Params`: a buffer at a fixed address that the call's pointer array names.
The driver copies the arguments when the call is enqueued (and when a graph node takes them),
so a Params may be rewritten right after: the eager path reuses one per wrapper.
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver as cu

from . import libcuda
from .driver import Device, check, current_device, stream_device
from .stream import stream_handle

__all__ = ["Params", "KernelCall", "Launch", "enqueue", "stream_handle", "check_stream", "enter_stream"]


class Params:
    """A kernel's argument struct (one by-value `__grid_constant__` struct) in a fixed buffer."""

    __slots__ = ("buffer", "nbytes", "_argv", "argv")

    def __init__(self, data):
        """`data`: the struct's bytes, or a size (zero-filled)."""
        n = data if isinstance(data, int) else len(data)
        if n < 1:
            raise ValueError("empty params struct")
        self.nbytes = n
        self.buffer = ctypes.create_string_buffer(n)
        if not isinstance(data, int):
            ctypes.memmove(self.buffer, bytes(data), n)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.argv = ctypes.addressof(self._argv)   # kernelParams: void*[1] -> the struct

    def write(self, data) -> None:
        if len(data) != self.nbytes:
            raise ValueError(f"params struct is {self.nbytes} bytes, got {len(data)}")
        ctypes.memmove(self.buffer, bytes(data), self.nbytes)

    def __bytes__(self) -> bytes:
        return self.buffer.raw

    def __len__(self) -> int:
        return self.nbytes


def _dim3(d, what: str) -> tuple[int, int, int]:
    d = (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(d) <= 3 or any(x < 1 for x in d):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {d}")
    return d + (1,) * (3 - len(d))


class KernelCall:
    """One kernel with its launch shape and argument buffer, prepared for repeated enqueues.

    `function`: an rtattn Kernel (or anything with `.handle` and `.name`); `params`: a Params
    (calls of one launch may share one, e.g. a kernel and the merge kernel reading the same struct).
    """

    __slots__ = ("function", "grid", "block", "smem", "params", "pdl", "func", "config",
                 "config_addr", "_attr", "_bcfg", "_node", "node_addr", "name")

    def __init__(self, function, grid, block, smem: int, params: Params, pdl: bool = False):
        if not isinstance(params, Params):
            raise TypeError(f"params must be a Params buffer, got {type(params).__name__}")
        self.function, self.params, self.pdl = function, params, bool(pdl)
        self.grid, self.block, self.smem = _dim3(grid, "grid"), _dim3(block, "block"), int(smem)
        limit = getattr(function, "max_dynamic_smem", None)
        if limit is not None and self.smem > 48 * 1024 and self.smem > limit:
            raise ValueError(f"{function.name}: {self.smem} bytes of dynamic shared memory need "
                             f"set_max_dynamic_smem({self.smem}) first")
        self.name = getattr(function, "name", "kernel")
        self.func = int(function.handle)
        cfg = libcuda.LaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        self._attr = (libcuda.LaunchAttribute * 1)()
        if self.pdl:
            self._attr[0].id = libcuda.PDL_ATTRIBUTE
            self._attr[0].value.programmaticStreamSerializationAllowed = 1
            cfg.attrs, cfg.numAttrs = self._attr, 1
        self.config, self.config_addr = cfg, ctypes.addressof(cfg)
        self._bcfg = None      # the cuda.bindings twin, built on first use of that entry
        self._node = None      # graph kernel-node params, built on first update
        self.node_addr = 0

    def bindings_config(self):
        if self._bcfg is None:
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
            cfg.sharedMemBytes = self.smem
            if self.pdl:
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                cfg.attrs, cfg.numAttrs = [attr], 1
            self._bcfg = cfg
        return self._bcfg

    def node_params(self) -> int:
        """Address of this call's CUDA_KERNEL_NODE_PARAMS_v2 (prepared once; it names the
        call's Params, so a node update passes whatever the buffer holds at that moment)."""
        if self._node is None:
            p = libcuda.KernelNodeParams()
            p.func = self.func
            p.gridDimX, p.gridDimY, p.gridDimZ = self.grid
            p.blockDimX, p.blockDimY, p.blockDimZ = self.block
            p.sharedMemBytes = self.smem
            p.kernelParams = self.params.argv
            self._node, self.node_addr = p, ctypes.addressof(p)
        return self.node_addr

    @property
    def shape_key(self) -> tuple:
        """What a graph node fixes besides the arguments."""
        return (self.func, self.grid, self.block, self.smem, self.pdl)

    def __repr__(self) -> str:
        return f"KernelCall({self.name}, grid={self.grid}, block={self.block}, smem={self.smem}, pdl={self.pdl})"


def check_stream(handle: int, device: Device) -> None:
    """Refuse a stream of another device than `device` (whose kernels or graph would run on it),
    before anything is enqueued. A stream is asked for its device once per device: the handles
    that passed are remembered (the default streams always pass: they are the current context's,
    and launches make `device`'s current)."""
    ok = device.streams_checked
    if handle in ok or handle in (0, 1, 2):
        return
    other = stream_device(handle)
    if other is not None and other is not device:
        raise ValueError(f"stream 0x{handle:x} belongs to cuda:{other.ordinal}, but this launch runs on "
                         f"cuda:{device.ordinal}: pass a stream of cuda:{device.ordinal}")
    if len(ok) > 1024:
        ok.clear()
    ok.add(handle)


def enter_stream(stream, device):
    """Before work on `stream` for `device`: (stream handle, what Device.leave() restores), the
    stream checked to be the device's and the device's context current."""
    h = stream_handle(stream)
    if h not in device.streams_checked:
        check_stream(h, device)
    return h, device.enter()


def enqueue(calls, stream, device=None) -> None:
    """Enqueue `calls` in order on `stream` (one driver call each) in `device`'s context (an
    rtattn Device; None: the device the kernels were loaded on, else the calling thread's current
    device). The stream must be that device's; the caller's current context is current again
    afterwards."""
    if device is None:
        device = kernels_device(calls) or current_device()
    h, prev = enter_stream(stream, device)
    try:
        e = libcuda.entry()
        if e is not None:
            launch = e.launch_kernel_ex
            for c in calls:
                c.config.hStream = h
                res = launch(c.config_addr, c.func, c.params.argv, None)
                if res:
                    libcuda.fail(res, f"cuLaunchKernelEx({c.name})")
            return
        for c in calls:
            cfg = c.bindings_config()
            cfg.hStream = h
            check(cu.cuLaunchKernelEx(cfg, c.function.handle, c.params.argv, 0), f"cuLaunchKernelEx({c.name})")
    finally:
        if prev is not None:
            Device.leave(prev)


def kernels_device(calls):
    """The device whose context loaded the calls' kernels (rtattn Kernels know their module's);
    None when the functions do not say. Kernels of two devices cannot share a launch."""
    devs = {id(d): d for d in (getattr(getattr(c.function, "module", None), "device", None) for c in calls)
            if d is not None}
    if len(devs) > 1:
        names = ", ".join(f"cuda:{d.ordinal}" for d in devs.values())
        raise ValueError(f"calls: kernels loaded on {names} in one launch (a launch runs on one device)")
    return next(iter(devs.values()), None)


class Launch:
    """Kernel calls enqueued in order on one stream: `launch(stream)`.

    `stream`: the default stream for calls without one. `device`: whose context enqueues them
    (default: the device the kernels were loaded on, else the caller's current device).
    """

    def __init__(self, calls, stream=None, device=None):
        self.calls = tuple(calls)
        if not self.calls:
            raise ValueError("a launch needs at least one kernel call")
        self.stream, self.device = stream, device if device is not None else kernels_device(self.calls)
        self.config_key = tuple(c.shape_key for c in self.calls)
        seen, self.param_buffers = set(), []
        for c in self.calls:   # distinct argument buffers, in call order (graph keys)
            if id(c.params) not in seen:
                seen.add(id(c.params))
                self.param_buffers.append(c.params)

    def __call__(self, stream=None) -> None:
        enqueue(self.calls, self.stream if stream is None else stream, self.device)

    def params_key(self) -> bytes:
        """The arguments of every call as one bytes value (graph executables are keyed by it)."""
        b = self.param_buffers
        return b[0].buffer.raw if len(b) == 1 else b"".join(p.buffer.raw for p in b)

    def __repr__(self) -> str:
        return f"Launch({', '.join(c.name for c in self.calls)})"
