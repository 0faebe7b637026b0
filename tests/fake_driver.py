"""A fake CUDA driver of several devices, under rtattn's real runtime (driver, streams, events,
memory, modules, launches, graphs), for CPU-tier tests of device binding.

It keeps what the real driver keeps: one current context per thread, and every resource
(device memory, stream, event, module, function, graph) owned by the context current when it
was made. It is stricter than the driver: any call that touches a resource while another
context is current fails with CUDA_ERROR_INVALID_CONTEXT, and a launch, copy or record that
mixes two contexts' resources with CUDA_ERROR_INVALID_HANDLE. Memory is host memory (copies
and memsets really move bytes), launches are recorded, not run.

    drv = fake_driver.install(monkeypatch, devices=2)   # Device(0), Device(1) are fake H200s
    # or, in a test module: from fake_driver import drv (a fixture: three fake devices)
"""
from __future__ import annotations

import ctypes
import gc
import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from cuda.bindings import driver as real_cu

R = real_cu.CUresult
OK = R.CUDA_SUCCESS
_A = real_cu.CUdevice_attribute
_ATTRS = {_A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
          _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 233472,
          _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: 49152,
          _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
          _A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: 65536,
          _A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: 65536,
          _A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: 2048,
          _A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 60 << 20,
          _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
          _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0}
_DEFAULT_STREAMS = (0, 1, 2)   # legacy, legacy (CU_STREAM_LEGACY), per-thread: the current context's


class DriverError(Exception):
    def __init__(self, result):
        self.result = result


def _api(fn):
    """A driver entry: returns (CUresult, *values) as cuda.bindings does; DriverError -> its result."""
    def call(self, *args):
        with self.lock:
            self.calls.append((fn.__name__, self.current()))
            try:
                got = fn(self, *args)
            except DriverError as e:
                self.errors.append((fn.__name__, e.result.name))
                return (e.result, None)
        if got is None:
            return (OK,)
        return (OK,) + (got if isinstance(got, tuple) else (got,))
    call.__name__ = fn.__name__
    return call


class FakeDriver:
    """The fake libcuda. `launches`: (device ordinal, kernel name, grid, stream, address of the
    argument struct, block, shared memory) per kernel run, eager or replayed."""

    def __init__(self, devices: int):
        self.num_devices = devices
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.ctx = {0xC000 + 0x100 * d: d for d in range(devices)}   # primary context -> ordinal
        self.owner: dict[int, int] = {}       # resource handle -> owning context
        self.memory: dict[int, tuple] = {}    # device pointer -> (context, host array)
        self.host: dict[int, np.ndarray] = {}
        self.functions: dict[int, str] = {}
        self.graphs: dict[int, list] = {}     # graph/exec handle -> captured launches
        self.capturing: dict[int, list] = {}  # stream -> launches being captured
        self.launches, self.copies, self.calls, self.errors = [], [], [], []
        self._ids = itertools.count(0x10_0000, 0x100)

    # ---------------------------------------------------------------- contexts
    def current(self) -> int:
        return getattr(self.tls, "ctx", 0)

    def get_current(self) -> int:
        return self.current()

    def set_current(self, handle: int) -> None:
        if handle and handle not in self.ctx:
            raise AssertionError(f"cuCtxSetCurrent of an unknown context 0x{handle:x}")
        self.tls.ctx = int(handle or 0)

    def ordinal_of(self, ctx: int) -> int:
        return self.ctx[ctx]

    def _need_ctx(self) -> int:
        c = self.current()
        if not c:
            raise DriverError(R.CUDA_ERROR_INVALID_CONTEXT)
        return c

    def _mine(self, handle: int) -> int:
        """The owning context of `handle`, which must be current."""
        c = self._need_ctx()
        own = self.owner.get(int(handle))
        if own is None:
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)
        if own != c:
            raise DriverError(R.CUDA_ERROR_INVALID_CONTEXT)
        return own

    def _stream(self, h) -> int:
        h = int(h)
        if h in _DEFAULT_STREAMS:
            return self._need_ctx()
        return self._mine(h)

    def _new(self, kind="") -> int:
        h = next(self._ids)
        self.owner[h] = self._need_ctx()
        return h

    def _device_memory(self, ptr: int, n: int) -> np.ndarray:
        """The bytes [ptr, ptr + n) of one allocation of the current context."""
        c = self._need_ctx()
        for base, (own, arr) in self.memory.items():
            if base <= ptr and ptr + n <= base + arr.nbytes:
                if own != c:
                    raise DriverError(R.CUDA_ERROR_INVALID_CONTEXT)
                return arr[ptr - base:ptr - base + n]
        raise DriverError(R.CUDA_ERROR_INVALID_VALUE)

    # ------------------------------------------------------------ the bindings
    def __getattr__(self, name):   # enums, types and constants: the real bindings'
        return getattr(real_cu, name)

    @_api
    def cuInit(self, flags):
        return None

    @_api
    def cuDeviceGetCount(self):
        return self.num_devices

    @_api
    def cuDeviceGet(self, ordinal):
        if not 0 <= ordinal < self.num_devices:
            raise DriverError(R.CUDA_ERROR_INVALID_DEVICE)
        return ordinal

    @_api
    def cuDeviceGetName(self, n, dev):
        return f"fake H200 #{dev}".encode() + b"\0"

    @_api
    def cuDeviceGetAttribute(self, attr, dev):
        return _ATTRS[attr]

    @_api
    def cuDevicePrimaryCtxRetain(self, dev):
        return 0xC000 + 0x100 * int(dev)

    @_api
    def cuCtxGetCurrent(self):
        return self.current()

    @_api
    def cuCtxSetCurrent(self, ctx):
        self.set_current(int(ctx))

    @_api
    def cuCtxGetDevice(self):
        return self.ctx[self._need_ctx()]

    @_api
    def cuCtxSynchronize(self):
        self._need_ctx()

    @_api
    def cuMemGetInfo(self):
        self._need_ctx()
        return (1 << 30, 1 << 31)

    @_api
    def cuMemAlloc(self, n):
        c = self._need_ctx()
        arr = np.zeros(int(n), np.uint8)
        ptr = arr.ctypes.data
        self.memory[ptr] = (c, arr)
        return ptr

    @_api
    def cuMemFree(self, ptr):
        self._device_memory(int(ptr), 0)
        self.memory.pop(int(ptr), None)

    @_api
    def cuMemHostAlloc(self, n, flags):
        self._need_ctx()
        if not flags & real_cu.CU_MEMHOSTALLOC_PORTABLE:
            raise AssertionError("pinned plan buffers must be portable: every device copies from them")
        arr = np.zeros(int(n), np.uint8)
        self.host[arr.ctypes.data] = arr
        return arr.ctypes.data

    @_api
    def cuMemFreeHost(self, ptr):
        self.host.pop(int(ptr), None)

    @_api
    def cuMemsetD32(self, ptr, value, count):
        self._device_memory(int(ptr), 4 * count).view(np.uint32)[:] = value

    @_api
    def cuMemsetD8(self, ptr, value, count):
        self._device_memory(int(ptr), count)[:] = value

    @_api
    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        c = self._stream(stream)
        dst_bytes = self._device_memory(int(dst), int(n))
        ctypes.memmove(dst_bytes.ctypes.data, int(src), int(n))
        self.copies.append((self.ctx[c], int(dst), int(src), int(n), int(stream)))

    @_api
    def cuMemcpyHtoD(self, dst, src, n):
        ctypes.memmove(self._device_memory(int(dst), int(n)).ctypes.data, int(src), int(n))

    @_api
    def cuMemcpyDtoH(self, dst, src, n):
        ctypes.memmove(int(dst), self._device_memory(int(src), int(n)).ctypes.data, int(n))

    @_api
    def cuStreamCreate(self, flags):
        return self._new()

    @_api
    def cuStreamGetCtx(self, h):
        own = self.owner.get(int(h))
        if own is None:
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)
        return own

    @_api
    def cuStreamSynchronize(self, h):
        self._stream(h)

    @_api
    def cuStreamWaitEvent(self, h, ev, flags):
        self._stream(h)
        if int(ev) not in self.owner:   # an event of any context may be waited on
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)

    @_api
    def cuEventCreate(self, flags):
        return self._new()

    @_api
    def cuEventRecord(self, ev, h):
        if self._mine(int(ev)) != self._stream(h):
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)

    @_api
    def cuEventElapsedTime(self, start, end):
        if self._mine(int(start)) != self._mine(int(end)):
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)
        return 0.5

    @_api
    def cuModuleLoadData(self, data):
        if not bytes(data).startswith(b"\x7fELF"):
            raise DriverError(R.CUDA_ERROR_INVALID_IMAGE)
        return self._new()

    @_api
    def cuModuleGetFunction(self, mod, name):
        self._mine(int(mod))
        f = self._new()
        self.functions[f] = name.decode()
        return f

    @_api
    def cuFuncGetAttribute(self, attr, f):
        self._mine(int(f))
        return 0 if attr != real_cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS else 128

    @_api
    def cuFuncSetAttribute(self, f, attr, value):
        self._mine(int(f))

    @_api
    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, f, threads, smem):
        self._mine(int(f))
        return 1

    @_api
    def cuLaunchKernelEx(self, cfg, f, argv, extra):
        h = int(cfg.hStream)
        if self._mine(int(f)) != self._stream(h):
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)
        args = ctypes.cast(int(argv), ctypes.POINTER(ctypes.c_void_p))[0]
        rec = (self.ctx[self.current()], self.functions[int(f)], (cfg.gridDimX, cfg.gridDimY), h, args,
               (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), cfg.sharedMemBytes)
        if h in self.capturing:
            self.capturing[h].append(rec)
        else:
            self.launches.append(rec)

    @_api
    def cuStreamBeginCapture(self, h, mode):
        self._stream(h)
        self.capturing[int(h)] = []

    @_api
    def cuStreamEndCapture(self, h):
        self._stream(h)
        g = self._new()
        self.graphs[g] = self.capturing.pop(int(h))
        return g

    @_api
    def cuGraphInstantiate(self, g, flags):
        self._need_ctx()   # an executable graph belongs to the context current at instantiation
        if self.owner[int(g)] != self.current():
            raise DriverError(R.CUDA_ERROR_INVALID_CONTEXT)
        ex = self._new()
        self.graphs[ex] = list(self.graphs[int(g)])
        return ex

    @_api
    def cuGraphLaunch(self, ex, h):
        if self._mine(int(ex)) != self._stream(h):
            raise DriverError(R.CUDA_ERROR_INVALID_HANDLE)
        self.launches += [rec[:3] + (int(h),) + rec[4:] for rec in self.graphs[int(ex)]]

    def _node(self, node) -> tuple[int, int]:
        """(graph, index) of a node handle: graph + 1 + index."""
        for g, launches in self.graphs.items():
            if g < int(node) <= g + len(launches):
                return g, int(node) - g - 1
        raise DriverError(R.CUDA_ERROR_INVALID_VALUE)

    @_api
    def cuGraphGetNodes(self, g, count):
        n = len(self.graphs[self._mine(int(g)) and int(g)])
        return ([int(g) + 1 + i for i in range(min(count, n))] if count else [], n)

    @_api
    def cuGraphNodeGetType(self, node):
        self._node(node)
        return real_cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

    @_api
    def cuGraphKernelNodeGetParams(self, node):
        g, i = self._node(node)
        self._mine(g)
        _, name, grid, _, _, block, smem = self.graphs[g][i]
        func = next(f for f, n in self.functions.items() if n == name and self.owner[f] == self.owner[g])
        return SimpleNamespace(func=func, gridDimX=grid[0], gridDimY=grid[1], gridDimZ=1, blockDimX=block[0],
                               blockDimY=block[1], blockDimZ=block[2], sharedMemBytes=smem)

    @_api
    def cuGraphExecKernelNodeSetParams(self, ex, node, p):
        self._mine(int(ex))
        _, i = self._node(node)
        rec = self.graphs[int(ex)][i]
        args = ctypes.cast(int(p.kernelParams), ctypes.POINTER(ctypes.c_void_p))[0]
        self.graphs[int(ex)][i] = rec[:4] + (args,) + rec[5:]


def _owned(name):
    """An entry that only needs its one handle's context current (destroy, synchronize, query)."""
    def entry(self, handle):
        self._mine(int(handle))
    entry.__name__ = name
    return _api(entry)


for _name in ("cuStreamDestroy", "cuEventSynchronize", "cuEventQuery", "cuEventDestroy", "cuModuleUnload",
              "cuGraphDestroy", "cuGraphExecDestroy"):
    setattr(FakeDriver, _name, _owned(_name))


def install(monkeypatch, devices: int = 2) -> FakeDriver:
    """rtattn's runtime over a FakeDriver of `devices` devices: the bindings every runtime module
    calls, the context entries, the device probe, and no cached Device or loaded kernels."""
    from rtattn import kernels, merge
    from rtattn.graphs import graph
    from rtattn.runtime import driver, launch, libcuda, memory, module, stream

    drv = FakeDriver(devices)
    for mod in (driver, stream, memory, module, launch, libcuda, graph):
        monkeypatch.setattr(mod, "cu", drv)
    monkeypatch.setattr(driver, "_probe", (devices, ""))
    monkeypatch.setattr(driver, "_devices", {})
    monkeypatch.setattr(driver, "_ctx_calls", SimpleNamespace(get=drv.get_current, set=drv.set_current))
    monkeypatch.setattr(libcuda, "ENTRY", "bindings")
    import rtattn.runtime
    fake_cubin = lambda *a, **k: b"\x7fELF fake"   # noqa: E731 - sources are rendered, not compiled
    for mod in (kernels, merge, rtattn.runtime):
        monkeypatch.setattr(mod, "compile_to_cubin", fake_cubin)
    clear_caches()
    return drv


def clear_caches() -> None:
    """Forget kernels loaded per device (they name the fake driver's modules)."""
    from rtattn import kernels, merge
    from rtattn.families import prefill
    for cached in (kernels.decode_kernels, prefill.prefill_kernels, merge._module):
        cached.cache_clear()


def uninstall() -> None:
    """Call at the end of a test, before monkeypatch restores the real driver: the test's objects
    (wrappers live in reference cycles) are released while the fake driver still owns their memory."""
    clear_caches()
    gc.collect()


@pytest.fixture
def drv(monkeypatch):
    """Three fake devices under the real runtime for one test."""
    d = install(monkeypatch, devices=3)
    yield d
    uninstall()
