"""Streams and events.

A :class:`Stream` is either owned (created here, destroyed on close) or a
borrowed handle (a raw int, a CUstream, or a foreign stream object such as
torch's or cupy's). Handle 0 is the legacy default stream.
"""
from __future__ import annotations

import weakref

from cuda.bindings import driver as cu

from . import libcuda
from .driver import Device, check, current_device, stream_device

__all__ = ["Stream", "Event", "as_stream", "stream_handle"]


def _destroy_stream(handle: int, device: Device) -> None:
    try:
        with device.active():
            cu.cuStreamDestroy(handle)
    except Exception:  # interpreter shutdown: nothing sensible to do
        pass


def _foreign_handle(obj) -> int:
    """The raw CUstream address of a foreign stream-like object."""
    if hasattr(obj, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        proto = obj.__cuda_stream__
        proto = proto() if callable(proto) else proto
        return int(proto[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, misc
        h = getattr(obj, attr, None)
        if h is not None and not callable(h):
            return int(h)
    if isinstance(obj, cu.CUstream):
        return int(obj)
    raise TypeError(f"cannot use {type(obj).__name__} as a CUDA stream: expected None, an int handle, "
                    f"a CUstream, a Stream, or an object with __cuda_stream__/.cuda_stream/.ptr")


class Stream:
    """A CUDA stream. ``Stream()`` creates an owned non-blocking stream on ``device`` (default:
    the calling thread's current device, else 0)."""

    def __init__(self, device=None, *, _handle: int | None = None, _owner=None):
        if _handle is not None:  # borrowed: we never destroy it
            self._handle = int(_handle)
            self._owner = _owner
            self._device = None if device is None else Device(device)
            self._finalizer = None
            return
        dev = current_device(device)
        with dev.active():
            h = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._handle = int(h)
        self._owner = None
        self._device = dev
        self._finalizer = weakref.finalize(self, _destroy_stream, self._handle, dev)

    @classmethod
    def wrap(cls, obj) -> "Stream":
        """Borrow a foreign stream (int, CUstream, ``__cuda_stream__``, torch, cupy);
        the foreign object is kept alive, not destroyed by us."""
        if isinstance(obj, Stream):
            return obj
        if isinstance(obj, int):
            return cls(_handle=obj)
        return cls(_handle=_foreign_handle(obj), _owner=obj)

    @classmethod
    def default(cls) -> "Stream":
        """The legacy default stream (handle 0)."""
        return cls(_handle=0)

    @property
    def handle(self) -> int:
        return self._handle

    @property
    def owned(self) -> bool:
        return self._finalizer is not None

    def __cuda_stream__(self):
        return (0, self._handle)

    def __int__(self) -> int:
        return self._handle

    @property
    def device(self) -> Device:
        """The device this stream runs on: an owned stream's, a borrowed one's from the driver
        (cuStreamGetCtx); for the legacy/per-thread default streams, the current device."""
        if self._device is None:
            dev = stream_device(self._handle)
            if dev is None:
                return current_device()
            self._device = dev
        return self._device

    def synchronize(self) -> None:
        with self.device.active():
            check(cu.cuStreamSynchronize(self._handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Make later work on this stream wait for ``event`` (which may be another device's)."""
        with self.device.active():
            check(cu.cuStreamWaitEvent(self._handle, event.handle, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __eq__(self, other):
        return isinstance(other, Stream) and other._handle == self._handle

    def __hash__(self):
        return hash(self._handle)

    def __repr__(self) -> str:
        kind = "owned" if self.owned else "borrowed"
        return f"Stream(0x{self._handle:x}, {kind})"


def as_stream(x) -> Stream:
    """None -> legacy default stream; a Stream; an int handle; or a foreign stream."""
    if x is None:
        return Stream.default()
    return Stream.wrap(x)


_last_foreign = (None, 0)   # (foreign stream object, its handle): callers pass the same one every call


def stream_handle(stream) -> int:
    """A raw CUstream handle from None (legacy default, 0), an int, an rtattn Stream or a foreign stream.
    A foreign stream object (torch's, cupy's) names one stream for its life: the last one seen is
    remembered (held, like DecodeGraphs' stream), so a caller passing it every layer converts it once."""
    global _last_foreign
    if stream is None:
        return 0
    if type(stream) is int:
        return stream
    last = _last_foreign
    if stream is last[0]:
        return last[1]
    h = getattr(stream, "_handle", None)   # rtattn Stream: no conversion
    if type(h) is int:
        return h
    h = as_stream(stream).handle
    _last_foreign = (stream, h)
    return h


def _destroy_event(handle, device: Device) -> None:
    try:
        with device.active():
            cu.cuEventDestroy(handle)
    except Exception:
        pass


class Event:
    """A CUDA event on ``device`` (default: the calling thread's current device, else 0); it
    is recorded on that device's streams only. ``timing=False`` makes a cheaper sync-only event."""

    def __init__(self, timing: bool = True, device=None):
        dev = current_device(device)
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with dev.active():
            self._ev = check(cu.cuEventCreate(flags), "cuEventCreate")
        self._device = dev
        self.timing = timing
        self._finalizer = weakref.finalize(self, _destroy_event, self._ev, dev)

    @property
    def handle(self):
        return self._ev

    @property
    def device(self) -> Device:
        return self._device

    def record(self, stream=None) -> "Event":
        if isinstance(stream, Stream):
            s = stream._device
            if s is not None and s is not self._device:   # known without a driver query
                raise ValueError(f"stream: {stream!r} runs on cuda:{s.ordinal}, this event belongs to "
                                 f"cuda:{self._device.ordinal} (record an event of the stream's device)")
        h = stream_handle(stream)
        with self._device.active():
            libcuda.record_event(self._ev, h)
        return self

    def link(self, producer: int, consumer: int) -> None:
        """Record on stream `producer` and make stream `consumer` wait for it (raw handles, both
        of this event's device), in one context entry: consumer's later work follows producer's
        work queued so far."""
        with self._device.active():
            libcuda.record_event(self._ev, producer)
            check(cu.cuStreamWaitEvent(consumer, self._ev, 0), "cuStreamWaitEvent")

    def synchronize(self) -> None:
        with self._device.active():
            libcuda.wait_event(self._ev)

    def query(self) -> bool:
        """True if the recorded work has completed."""
        with self._device.active():
            res = cu.cuEventQuery(self._ev)[0]
        if res == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((res,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both recorded and completed)."""
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs two events created with timing=True")
        with self._device.active():
            return float(check(cu.cuEventElapsedTime(self._ev, end._ev), "cuEventElapsedTime"))

    def close(self) -> None:
        self._finalizer()
