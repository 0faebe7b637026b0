"""Checks of DLPack tensors against what a kernel will read, before any launch, and the imports
remembered per tensor object that let a layer's tensors skip both on later calls."""
from __future__ import annotations

import sys
import weakref

from rtattn.runtime import TensorView, as_tensor


def cuda_tensor(name: str, obj, stream=None, *, dtype: str | None = None, ndim: int | None = None,
                keep_producer: bool = True, device_id: int | None = None):
    """View `obj` as CUDA memory, refusing wrong memory, dtype or rank with the tensor's name.
    `device_id`: the device it must be on, checked from `__dlpack_device__` before the import
    (whose stream handshake would otherwise order a stream of one device after another's)."""
    if device_id is not None and not isinstance(obj, TensorView) and hasattr(obj, "__dlpack_device__"):
        code, dev = obj.__dlpack_device__()
        if int(code) == 2 and int(dev) != device_id:   # kDLCUDA
            raise ValueError(f"{name} is on cuda:{int(dev)}, the wrapper runs on cuda:{device_id}")
    try:
        t = as_tensor(obj, stream, require="cuda", keep_producer=keep_producer)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    return expect_typed(name, t, dtype, ndim)


def expect_typed(name: str, t, dtype: str | None, ndim: int | None):
    """t, if it has `dtype` and `ndim` dimensions (None: any)."""
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} has shape {t.shape}, expected {ndim} dimensions")
    return t


def expect_shape(name: str, t, shape: tuple) -> None:
    """`shape` entries of None are free."""
    if len(t.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {want}")


def expect_inner_contiguous(name: str, t) -> None:
    if t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.strides}")


def expect_vector_aligned(name: str, t, nbytes: int = 16) -> None:
    """The q and KV loads are 16-byte vector copies: the base and every outer stride must be aligned."""
    if t.ptr % nbytes or any((s * t.itemsize) % nbytes for s in t.strides[:-1]):
        raise ValueError(f"{name}: base pointer and strides must be {nbytes}-byte aligned for vector loads "
                         f"(ptr=0x{t.ptr:x}, strides={t.strides} elements of {t.itemsize} bytes)")


def same_device(tensors: dict, device_id: int) -> None:
    for name, t in tensors.items():
        if t is not None and t.device_id != device_id:
            raise ValueError(f"{name} is on cuda:{t.device_id}, the wrapper runs on cuda:{device_id}")


# ------------------------------------------------------------------ imports remembered per object
class _Producer:
    """What a framework's tensor object tells without a DLPack round trip: a fingerprint of the
    memory it describes (pointer, shape, strides, dtype: every one can change under the same
    object, e.g. torch's set_/resize_/.data=), and the stream the framework enqueues on."""

    def __init__(self, name: str, fingerprint, current_stream=None):
        self.name, self.fingerprint, self.current_stream = name, fingerprint, current_stream


def _torch_stream(device_id: int) -> int:
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device_id)) if raw is not None else int(torch.cuda.current_stream(device_id).cuda_stream)


def _cupy_stream(device_id: int) -> int:
    return int(sys.modules["cupy"].cuda.get_current_stream().ptr)


_TORCH = _Producer("torch", lambda t: (t.data_ptr(), t.shape, t.stride(), t.dtype), _torch_stream)
_CUPY = _Producer("cupy", lambda a: (a.data.ptr, a.shape, a.strides, a.dtype), _cupy_stream)
_VIEW = _Producer("rtattn", lambda v: (v.ptr, v.shape, v.strides, v.dtype))
_PRODUCERS: dict = {}   # type -> _Producer, or None (not remembered: imported on every call)


def _producer_of(tp):
    p = _PRODUCERS.get(tp, False)
    if p is False:
        p = None
        for k in tp.__mro__:
            top = (getattr(k, "__module__", "") or "").split(".")[0]
            if k is TensorView:
                p = _VIEW
            elif top == "torch" and k.__name__ == "Tensor":
                p = _TORCH
            elif top == "cupy" and k.__name__ == "ndarray":
                p = _CUPY
            if p is not None:
                break
        _PRODUCERS[tp] = p
    return p


class TensorImports:
    """DLPack imports remembered per tensor object, so a layer's tensors coming back every step
    cost a dictionary lookup and a fingerprint instead of an import and a full validation.

    get(name, obj, stream, derive) returns derive(name, view) for obj's CUDA view, computed once
    per (object, name) while the object still describes the same memory (same pointer, shape,
    strides, dtype); a changed fingerprint re-imports. `derive` checks what depends on the view
    alone (dtype, rank, strides, alignment, device) and returns what the caller packs: plain
    numbers, never the view (an entry must not keep its own object alive).

    Remembered: torch tensors, cupy arrays and rtattn views (weakly: an entry goes when its
    object dies). Other producers are imported on every call. A reused torch/cupy tensor skips
    the producer's DLPack stream handshake, so `order(stream)` does it once per call instead:
    `stream` waits for the framework's current stream when the two differ.
    """

    def __init__(self, device_id: int = 0, capacity: int = 4096):
        self.device_id, self.capacity = device_id, capacity
        self._entries: dict = {}   # id(obj) -> [weakref, fingerprint, view, producer, {name: derived}]
        self._reused: set = set()  # producers whose tensors were reused since the last order()
        self._event = None
        self.imports = self.reuses = 0   # counters (tests, benchmarks)

    def get(self, name: str, obj, stream, derive):
        e = self._entries.get(id(obj))
        if e is not None and e[0]() is obj and e[3].fingerprint(obj) == e[1]:
            self.reuses += 1
            if e[3].current_stream is not None:
                self._reused.add(e[3])
            got = e[4].get(name)
            if got is None:
                got = e[4][name] = derive(name, obj if e[2] is None else e[2])
            return got
        return self._import(name, obj, stream, derive)

    def _import(self, name, obj, stream, derive):
        self.imports += 1
        prod = _producer_of(type(obj))
        ref = None
        if prod is not None:
            entries, key = self._entries, id(obj)

            def forget(r, entries=entries, key=key):
                e = entries.get(key)
                if e is not None and e[0] is r:
                    del entries[key]
            try:
                ref = weakref.ref(obj, forget)
            except TypeError:   # no weak references: imported every call
                prod = None
        view = cuda_tensor(name, obj, stream, keep_producer=prod is None, device_id=self.device_id)
        got = derive(name, view)
        if prod is not None:
            if len(self._entries) >= self.capacity:
                del self._entries[next(iter(self._entries))]
            # an rtattn view is its own import: holding it here would keep it alive
            held = None if view is obj else view
            self._entries[id(obj)] = [ref, prod.fingerprint(obj), held, prod, {name: got}]
        return got

    def order(self, stream_handle: int) -> None:
        """Make `stream_handle` wait for the current stream of every framework whose tensors were
        reused since the last call, where the two differ (what their DLPack export would do)."""
        if not self._reused:
            return
        for prod in self._reused:
            theirs = prod.current_stream(self.device_id)
            if theirs != stream_handle:
                if self._event is None:
                    from rtattn.runtime import Event
                    self._event = Event(timing=False, device=self.device_id)
                self._event.link(theirs, stream_handle)
        self._reused.clear()

    def __len__(self) -> int:
        return len(self._entries)
