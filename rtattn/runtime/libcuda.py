"""Direct ctypes entries into libcuda for the few calls made per layer (kernel launch, graph
launch, kernel-node argument update) or per plan (the plan's async copy, its event record and
wait), and the C structs they take.

cuda.bindings converts every argument object on every call (a CUlaunchConfig wrapper, the
CUfunction, the stream, the kernelParams helper); the same call through ctypes with prepared
structs and plain integer addresses costs a fraction of that (docs/perf-log.md, host path).
Both entries stay usable: `ENTRY` picks the one launch.py and graphs/ use ("ctypes" when libcuda
exports the symbols, else "bindings"), so benchmarks can time one against the other.

Results are checked through the one error funnel (driver.check) with the CUresult's name.
Nothing here loads libcuda until a launch needs it (importing rtattn never needs a GPU).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, Union, c_char, c_int, c_uint, c_void_p

from cuda.bindings import driver as cu

from .driver import check

__all__ = ["LaunchConfig", "LaunchAttribute", "KernelNodeParams", "entry", "set_entry", "fail",
           "PDL_ATTRIBUTE", "copy_htod", "record_event", "wait_event"]

# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h); read from the bindings' enum.
PDL_ATTRIBUTE = int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)


class _AttrValue(Union):
    # CUlaunchAttributeValue: a 64-byte union; PDL uses its first int.
    _fields_ = [("pad", c_char * 64), ("programmaticStreamSerializationAllowed", c_int)]


class LaunchAttribute(Structure):
    # CUlaunchAttribute: id, 4 bytes of padding (cuda.h spells them), the value union
    _fields_ = [("id", c_int), ("_pad", c_char * 4), ("value", _AttrValue)]


class LaunchConfig(Structure):
    # CUlaunchConfig (cuda.h)
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", POINTER(LaunchAttribute)), ("numAttrs", c_uint)]


class KernelNodeParams(Structure):
    # CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)
    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("kernelParams", c_void_p), ("extra", c_void_p),
                ("kern", c_void_p), ("ctx", c_void_p)]


class _Entries:
    """libcuda's functions, resolved on first use; None where the library or a symbol is absent."""

    def __init__(self):
        self.loaded = False
        self.launch_kernel_ex = self.graph_launch = self.node_set_params = None
        # plan() per step: its copy, the copy's event and the wait on the copy of two plans ago
        self.memcpy_htod_async = self.event_record = self.event_synchronize = None

    def load(self) -> "_Entries":
        if self.loaded:
            return self
        self.loaded = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return self
        self.launch_kernel_ex = _fn(lib, "cuLaunchKernelEx", 4)
        self.graph_launch = _fn(lib, "cuGraphLaunch", 2)
        self.node_set_params = _fn(lib, "cuGraphExecKernelNodeSetParams_v2", 3)
        self.memcpy_htod_async = _fn(lib, "cuMemcpyHtoDAsync_v2", 4)
        self.event_record = _fn(lib, "cuEventRecord", 2)
        self.event_synchronize = _fn(lib, "cuEventSynchronize", 1)
        return self

    @property
    def complete(self) -> bool:
        """Every entry resolved: the ctypes path can serve launches, replays, node updates and plan copies."""
        return bool(self.launch_kernel_ex and self.graph_launch and self.node_set_params and self.memcpy_htod_async
                    and self.event_record and self.event_synchronize)


def _fn(lib, name: str, nargs: int):
    f = getattr(lib, name, None)
    if f is not None:
        f.argtypes, f.restype = [c_void_p] * nargs, c_int
    return f


_ENTRIES = _Entries()
ENTRY = None   # "ctypes" or "bindings"; None until first use (then ctypes when libcuda has the symbols)


def entry():
    """The loaded entries when the ctypes path is in use, else None (use cuda.bindings)."""
    global ENTRY
    if ENTRY is None:
        ENTRY = "ctypes" if _ENTRIES.load().complete else "bindings"
    return _ENTRIES if ENTRY == "ctypes" else None


def set_entry(name: str) -> None:
    """Choose the driver entry: "ctypes" (needs libcuda's symbols) or "bindings"."""
    global ENTRY
    if name not in ("ctypes", "bindings"):
        raise ValueError(f"driver entry must be 'ctypes' or 'bindings', got {name!r}")
    if name == "ctypes":
        if not _ENTRIES.load().complete:
            raise RuntimeError("the ctypes driver entry needs libcuda.so.1 with cuLaunchKernelEx, cuGraphLaunch, "
                               "cuGraphExecKernelNodeSetParams_v2, cuMemcpyHtoDAsync_v2, cuEventRecord and "
                               "cuEventSynchronize")
    ENTRY = name


def fail(result: int, call: str):
    """Raise the funnel's CudaError for a nonzero CUresult from a ctypes call."""
    try:
        res = cu.CUresult(result)
    except ValueError:   # a code the bindings do not know
        res = cu.CUresult.CUDA_ERROR_UNKNOWN
    check((res,), call)
    raise AssertionError("unreachable: check() raises for every nonzero result")


# The plan's driver calls, in the context the caller made current (one Device.enter per plan,
# not one per call): the direct entry when in use, else cuda.bindings. Streams are raw handles;
# events CUevent handles.
def copy_htod(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cuMemcpyHtoDAsync: `nbytes` from host address `src` (pinned: truly async) to device `dst`."""
    e = entry()
    if e is None:
        check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")
        return
    res = e.memcpy_htod_async(dst, src, nbytes, stream)
    if res:
        fail(res, "cuMemcpyHtoDAsync")


def record_event(event, stream: int) -> None:
    """cuEventRecord of `event` on `stream`."""
    e = entry()
    if e is None:
        check(cu.cuEventRecord(event, stream), "cuEventRecord")
        return
    res = e.event_record(int(event), stream)
    if res:
        fail(res, "cuEventRecord")


def wait_event(event) -> None:
    """cuEventSynchronize: the host waits until the work before `event` is done."""
    e = entry()
    if e is None:
        check(cu.cuEventSynchronize(event), "cuEventSynchronize")
        return
    res = e.event_synchronize(int(event))
    if res:
        fail(res, "cuEventSynchronize")
