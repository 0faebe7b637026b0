"""Explicit driver-API CUDA graphs: capture, instantiate, update, replay, destroy.

    g = capture(lambda: launch(stream), stream)     # cuStreamBeginCapture .. EndCapture
    ex = g.instantiate()                             # cuGraphInstantiate
    ex.launch(stream)                                # cuGraphLaunch (replay)
    ex.update(capture(other_fn, stream))             # cuGraphExecUpdate: same topology, new arguments
    ex.set_kernel_params(i, params_bytes)            # cuGraphExecKernelNodeSetParams: one node's struct
    ex.set_call_params(i, call)                      # the same from a prepared KernelCall (launch.py)

Every call goes through rtattn.runtime.driver.check. Graphs and executable graphs are
destroyed explicitly (`destroy()`, `with`) or by a finalizer, whichever comes first.

A graph belongs to the device of the stream it was captured on: every driver call on it runs in
that device's context (the caller's current context is restored after), and it replays only on
that device's streams.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

from cuda.bindings import driver as cu

from rtattn.runtime import (CudaError, Device, NoDeviceError, Stream, as_stream, check, has_device,
                            no_device_reason, pack_params)
from rtattn.runtime import libcuda
from rtattn.runtime.launch import check_stream, enter_stream

__all__ = ["capture", "Graph", "GraphExec", "KernelNode", "UpdateResult", "GraphCaptureError"]

# The legacy default stream cannot be captured (the driver says so only after the fact,
# and it serializes with every blocking stream); 1 is CU_STREAM_LEGACY spelled as a handle.
_LEGACY_HANDLES = (0, 1)
_KERNEL = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
_UPDATE_OK = cu.CUgraphExecUpdateResult.CU_GRAPH_EXEC_UPDATE_SUCCESS


class GraphCaptureError(CudaError):
    """Capture refused or invalidated (legacy stream, an unsafe call during capture, ...)."""


def _destroy(fn, handle, device) -> None:
    try:
        with device.active():
            fn(handle)
    except Exception:  # interpreter shutdown: nothing sensible to do
        pass


def capturable_stream(stream) -> Stream:
    """`stream` as a Stream, refusing the legacy default stream with a clear error."""
    s = as_stream(stream)
    if s.handle in _LEGACY_HANDLES:
        raise GraphCaptureError(
            "cannot capture a CUDA graph on the legacy default stream (stream=None/0): "
            "pass an rtattn Stream() or a framework stream (torch.cuda.Stream, cupy.cuda.Stream)",
            call="cuStreamBeginCapture", result_name="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    return s


def capture(fn, stream) -> "Graph":
    """Record everything `fn()` enqueues on `stream` (any number of kernels) into a Graph.

    Thread-local capture mode: unsafe calls (allocations, synchronous copies) made by this
    thread during the capture fail loudly instead of being silently left out of the graph.
    If `fn` raises, the capture is ended, the partial graph destroyed, and the error re-raised.
    Python's cyclic garbage collector is off meanwhile: a collection there runs the finalizers of
    unreachable buffers, modules and streams (cuMemFree, cuMemFreeHost, cuModuleUnload), unsafe
    calls of this thread that invalidate the capture (H200, bench_overhead: a wrapper left in a
    reference cycle, collected during the next wrapper's DecodeGraphs capture).
    """
    s = capturable_stream(stream)
    if not has_device():  # never call into the driver bindings without a device (DESIGN: no hangs)
        raise NoDeviceError(f"cannot capture a CUDA graph: {no_device_reason()}", call="cuStreamBeginCapture",
                            result_name="CUDA_ERROR_NO_DEVICE")
    # the stream's device: an owned stream knows it, a borrowed one (torch, cupy) asks the driver
    dev = s.device
    check_stream(s.handle, dev)   # asks the driver now, not during the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        with dev.active():
            check(cu.cuStreamBeginCapture(s.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                  "cuStreamBeginCapture")
            try:
                fn()
            except BaseException:
                res, g = cu.cuStreamEndCapture(s.handle)
                if res == cu.CUresult.CUDA_SUCCESS and int(g):
                    cu.cuGraphDestroy(g)
                raise
            res = cu.cuStreamEndCapture(s.handle)
    finally:
        if collecting:
            gc.enable()
    try:
        g = check(res, "cuStreamEndCapture")
    except CudaError as e:
        raise GraphCaptureError(f"{e} -- the capture was invalidated: something in the captured function "
                                f"made a call that stream capture forbids (an allocation, a synchronous copy "
                                f"or a synchronize) or used another stream without joining it back",
                                call=e.call, result_name=e.result_name) from None
    if not int(g):
        raise GraphCaptureError("cuStreamEndCapture returned no graph: the capture was invalidated",
                                call="cuStreamEndCapture", result_name="CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    return Graph(g, dev)


@dataclass
class KernelNode:
    """A kernel node of a Graph and the launch configuration it was captured with."""
    node: object          # CUgraphNode
    func: object          # CUfunction
    grid: tuple
    block: tuple
    smem: int


@dataclass
class UpdateResult:
    """What cuGraphExecUpdate said: `ok`, and when not, the driver's reason name."""
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Graph:
    """A captured CUgraph of `device` (owned: destroyed by destroy() or the finalizer)."""

    def __init__(self, handle, device: Device):
        self.handle, self.device = handle, device
        self._finalizer = weakref.finalize(self, _destroy, cu.cuGraphDestroy, handle, device)
        self._nodes = None

    def nodes(self) -> list:
        """All CUgraphNodes (cuGraphGetNodes: count first, then the nodes)."""
        if self._nodes is None:
            with self.device.active():
                count = _count(check(cu.cuGraphGetNodes(self._live(), 0), "cuGraphGetNodes"))
                got = check(cu.cuGraphGetNodes(self._live(), count), "cuGraphGetNodes") if count else []
            nodes = got[0] if isinstance(got, tuple) else got
            self._nodes = [cu.CUgraphNode(int(n)) for n in (nodes or []) if int(n)]
        return self._nodes

    def node_types(self) -> list:
        with self.device.active():
            return [check(cu.cuGraphNodeGetType(n), "cuGraphNodeGetType") for n in self.nodes()]

    def kernel_nodes(self) -> list[KernelNode]:
        """Kernel nodes in capture order (for a linear capture, the launch order)."""
        out = []
        for n, t in zip(self.nodes(), self.node_types()):
            if t != _KERNEL:
                continue
            with self.device.active():
                p = check(cu.cuGraphKernelNodeGetParams(n), "cuGraphKernelNodeGetParams")
            # copy the handle out: p.func aliases p's storage, which dies with p
            out.append(KernelNode(n, cu.CUfunction(int(p.func)), (int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)),
                                  (int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)), int(p.sharedMemBytes)))
        return out

    def instantiate(self) -> "GraphExec":
        with self.device.active():
            ex = check(cu.cuGraphInstantiate(self._live(), 0), "cuGraphInstantiate")
        return GraphExec(ex, self)

    def _live(self):
        if not self._finalizer.alive:
            raise ValueError("Graph used after destroy()")
        return self.handle

    @property
    def destroyed(self) -> bool:
        return not self._finalizer.alive

    def destroy(self) -> None:
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def _diagnose(old: Graph, new: Graph) -> str:
    """Why `new` cannot update an exec of `old`, from the graphs themselves."""
    a, b = old.node_types(), new.node_types()
    if len(a) != len(b):
        return f"CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED ({len(a)} -> {len(b)} nodes)"
    if a != b:
        return "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED"
    if [int(k.func) for k in old.kernel_nodes()] != [int(k.func) for k in new.kernel_nodes()]:
        return "CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED"
    return "CU_GRAPH_EXEC_UPDATE_ERROR (no detail from the driver)"


def _count(ret) -> int:
    """numNodes from cuGraphGetNodes(graph, 0), which returns (nodes, numNodes)."""
    return int(ret[-1] if isinstance(ret, tuple) else ret)


class GraphExec:
    """An executable graph. Keeps the Graph it was instantiated from: kernel-node
    parameter updates name that graph's nodes."""

    def __init__(self, handle, graph: Graph):
        self.handle = handle
        self.graph, self.device = graph, graph.device
        self._finalizer = weakref.finalize(self, _destroy, cu.cuGraphExecDestroy, handle, graph.device)
        self._kernels: list[KernelNode] | None = None
        self._addr = int(handle)
        self._node_addrs: list[int] | None = None
        self.launches = 0

    def _live(self):
        if not self._finalizer.alive:
            raise ValueError("GraphExec used after destroy()")
        return self.handle

    def launch(self, stream) -> None:
        """Replay on `stream` (ordered after earlier work there, e.g. the plan copy): a stream of
        the graph's device."""
        h, prev = enter_stream(stream, self.device)
        try:
            e = libcuda.entry()
            if e is not None:
                if not self._finalizer.alive:
                    raise ValueError("GraphExec used after destroy()")
                res = e.graph_launch(self._addr, h)
                if res:
                    libcuda.fail(res, "cuGraphLaunch")
            else:
                check(cu.cuGraphLaunch(self._live(), h), "cuGraphLaunch")
        finally:
            if prev is not None:
                Device.leave(prev)
        self.launches += 1

    def upload(self, stream) -> None:
        """Pre-upload the executable so the first launch pays no setup."""
        h = as_stream(stream).handle
        check_stream(h, self.device)
        with self.device.active():
            check(cu.cuGraphUpload(self._live(), h), "cuGraphUpload")

    def update(self, graph: Graph) -> UpdateResult:
        """Take `graph`'s node parameters if its topology matches (cuGraphExecUpdate).

        Returns UpdateResult(False, reason) when the driver refuses (topology, node type or
        function changed...): the caller then instantiates `graph` afresh. Other errors raise.
        """
        if graph.device is not self.device:
            raise ValueError(f"graph: captured on cuda:{graph.device.ordinal}, this executable graph is "
                             f"cuda:{self.device.ordinal}'s")
        with self.device.active():
            res, info = cu.cuGraphExecUpdate(self._live(), graph._live())
        if res == cu.CUresult.CUDA_SUCCESS:
            return UpdateResult(True)
        if res == cu.CUresult.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
            # cuda.bindings returns (err, None) on failure, dropping the driver's result info:
            # say what differs ourselves.
            name = getattr(getattr(info, "result", None), "name", "")
            return UpdateResult(False, name or _diagnose(self.graph, graph))
        check((res,), "cuGraphExecUpdate")
        raise AssertionError("unreachable")

    def kernel_nodes(self) -> list[KernelNode]:
        if self._kernels is None:
            self._kernels = self.graph.kernel_nodes()
        return self._kernels

    def set_kernel_params(self, index: int, params) -> None:
        """Replace the argument struct of kernel node `index` (capture order) in place.
        `params`: the struct's bytes (rtattn's one-struct convention) or [(value, ctype)].
        The driver copies the arguments, so nothing needs to outlive the call."""
        k = self.kernel_nodes()[index]
        addr, keep = pack_params(params)
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = k.func
        p.gridDimX, p.gridDimY, p.gridDimZ = k.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = k.block
        p.sharedMemBytes = k.smem
        p.kernelParams = addr
        with self.device.active():
            check(cu.cuGraphExecKernelNodeSetParams(self._live(), k.node, p), "cuGraphExecKernelNodeSetParams")
        del keep

    def matches(self, launch) -> bool:
        """True when this graph's kernel nodes are `launch`'s calls, in order, with the same
        kernels and launch shapes: then set_call_params(i, call) updates node i exactly."""
        nodes = self.kernel_nodes()
        return len(nodes) == len(launch.calls) and all(
            (int(n.func), n.grid, n.block, n.smem) == (c.func, c.grid, c.block, c.smem)
            for n, c in zip(nodes, launch.calls))

    def set_call_params(self, index: int, call) -> None:
        """Give kernel node `index` the arguments `call`'s Params hold now (one driver call, with
        the call's prepared node-parameter struct). The caller checked matches()."""
        e = libcuda.entry()
        if e is None:
            self.set_kernel_params(index, bytes(call.params))
            return
        if self._node_addrs is None:
            self._node_addrs = [int(n.node) for n in self.kernel_nodes()]
        prev = self.device.enter()
        try:
            res = e.node_set_params(self._addr, self._node_addrs[index], call.node_params())
        finally:
            Device.leave(prev)
        if res:
            libcuda.fail(res, f"cuGraphExecKernelNodeSetParams({call.name})")

    @property
    def destroyed(self) -> bool:
        return not self._finalizer.alive

    def destroy(self, graph_too: bool = False) -> None:
        self._finalizer()
        if graph_too:
            self.graph.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy(graph_too=True)
