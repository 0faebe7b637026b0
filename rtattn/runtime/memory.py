"""Device buffers, pinned host buffers and checked async copies.

Lifetimes are deterministic: ``free()`` (or leaving a ``with`` block) releases
at once; a finalizer covers forgotten buffers. Both are idempotent.
"""
from __future__ import annotations

import weakref

import numpy as np
from cuda.bindings import driver as cu

from . import libcuda
from .driver import Device, check, current_device
from .stream import as_stream, stream_handle

__all__ = ["DeviceBuffer", "PinnedBuffer", "memcpy_htod_async", "memcpy_dtoh_async", "memcpy_dtod_async"]


# The copies run in `device`'s context (default: the calling thread's current device, else 0):
# the stream must be that device's. The caller's current context is left as it was.

def memcpy_htod_async(dst_ptr: int, src_ptr: int, nbytes: int, stream=None, device=None) -> None:
    """One async copy (the cascade's plan copy; the direct entry, the stream handle remembered)."""
    h = stream_handle(stream)
    with current_device(device).active():
        libcuda.copy_htod(int(dst_ptr), int(src_ptr), int(nbytes), h)


def memcpy_dtoh_async(dst_ptr: int, src_ptr: int, nbytes: int, stream=None, device=None) -> None:
    with current_device(device).active():
        check(cu.cuMemcpyDtoHAsync(int(dst_ptr), int(src_ptr), int(nbytes), as_stream(stream).handle),
              "cuMemcpyDtoHAsync")


def memcpy_dtod_async(dst_ptr: int, src_ptr: int, nbytes: int, stream=None, device=None) -> None:
    with current_device(device).active():
        check(cu.cuMemcpyDtoDAsync(int(dst_ptr), int(src_ptr), int(nbytes), as_stream(stream).handle),
              "cuMemcpyDtoDAsync")


def memset_d32(dst_ptr: int, value: int, count: int, device=None) -> None:
    """Fill `count` 32-bit words at an address of `device`, complete when this returns."""
    if count:
        with current_device(device).active():
            check(cu.cuMemsetD32(dst_ptr, int(value) & 0xFFFFFFFF, count), "cuMemsetD32")
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


def _host_array(a) -> np.ndarray:
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous")
    return a


def _free_device(ptr: int, device: Device) -> None:
    try:
        with device.active():
            cu.cuMemFree(ptr)
    except Exception:  # interpreter shutdown
        pass


class DeviceBuffer:
    """``nbytes`` of device memory (cuMemAlloc) on ``device`` (default: current/0)."""

    def __init__(self, nbytes: int, device=None):
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.device = current_device(device)
        self.nbytes = nbytes
        # cuMemAlloc refuses 0 bytes; keep a null pointer for empty buffers.
        self.ptr = 0
        if nbytes:
            with self.device.active():
                self.ptr = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
        self._finalizer = weakref.finalize(self, _free_device, self.ptr, self.device) if nbytes else None

    @property
    def freed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def _live(self) -> int:
        if self.freed:
            raise ValueError("DeviceBuffer used after free()")
        return self.ptr

    def _range(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) outside the buffer's {self.nbytes} bytes")

    def memset(self, byte_value: int = 0, stream=None) -> None:
        if self.nbytes:
            with self.device.active():
                if stream is None:
                    check(cu.cuMemsetD8(self._live(), int(byte_value) & 0xFF, self.nbytes), "cuMemsetD8")
                else:
                    check(cu.cuMemsetD8Async(self._live(), int(byte_value) & 0xFF, self.nbytes,
                                             as_stream(stream).handle), "cuMemsetD8Async")

    def copy_from_host(self, array, stream=None, offset: int = 0) -> None:
        """Copy a C-contiguous host array to ``ptr + offset``. With ``stream`` the
        copy is ordered on it (truly async only for pinned memory; the caller
        keeps ``array`` alive until the stream passes it); without, it is synchronous."""
        a = _host_array(array)
        self._range(offset, a.nbytes)
        if not a.nbytes:
            return
        if stream is None:
            with self.device.active():
                check(cu.cuMemcpyHtoD(self._live() + offset, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        else:
            memcpy_htod_async(self._live() + offset, a.ctypes.data, a.nbytes, stream, self.device)

    def copy_to_host(self, out=None, stream=None, offset: int = 0) -> np.ndarray:
        """Copy to ``out`` (default: a new uint8 array of the whole buffer). With
        ``stream``, synchronize the stream before reading ``out``."""
        if out is None:
            out = np.empty(self.nbytes - offset, dtype=np.uint8)
        a = _host_array(out)
        self._range(offset, a.nbytes)
        if a.nbytes:
            if stream is None:
                with self.device.active():
                    check(cu.cuMemcpyDtoH(a.ctypes.data, self._live() + offset, a.nbytes), "cuMemcpyDtoH")
            else:
                memcpy_dtoh_async(a.ctypes.data, self._live() + offset, a.nbytes, stream, self.device)
        return out

    def copy_from_device(self, src_ptr: int, nbytes: int, stream=None, offset: int = 0) -> None:
        self._range(offset, nbytes)
        if nbytes:
            if stream is None:
                with self.device.active():
                    check(cu.cuMemcpyDtoD(self._live() + offset, int(src_ptr), nbytes), "cuMemcpyDtoD")
            else:
                memcpy_dtod_async(self._live() + offset, src_ptr, nbytes, stream, self.device)

    def as_tensor(self, dtype: str, shape, strides=None, offset: int = 0, stream=None):
        """A DLPack-exportable view of this buffer (keeps the buffer alive).
        ``stream``: the stream that last wrote it, for the DLPack handshake."""
        from .dlpack import ITEMSIZE, export, numel_span
        span = numel_span(shape, strides) * ITEMSIZE[dtype]
        self._range(offset, span)
        return export(self._live() + offset, shape, dtype, self.device.ordinal,
                      strides=strides, owner=self, stream=stream)

    def free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self.ptr:x}"
        return f"DeviceBuffer({self.nbytes} bytes at {state}, device {self.device.ordinal})"


def _free_host(ptr: int, device: Device) -> None:
    try:
        with device.active():
            cu.cuMemFreeHost(ptr)
    except Exception:
        pass


class _HostMemory:
    """Exposes pinned memory to numpy; numpy arrays made from it keep the
    PinnedBuffer alive through ``base`` (so views never dangle before free())."""

    def __init__(self, owner: "PinnedBuffer", ptr: int, nbytes: int):
        self.owner = owner
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc, portable: every device's context may copy from
    it): the source of truly asynchronous host->device copies, e.g. the plan buffer."""

    def __init__(self, nbytes: int, device=None):
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.device = current_device(device)
        self.nbytes = nbytes
        with self.device.active():
            self.ptr = int(check(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        self._finalizer = weakref.finalize(self, _free_host, self.ptr, self.device)

    @property
    def array(self) -> np.ndarray:
        """A np.uint8 view of the whole buffer (it keeps the buffer alive)."""
        if self.freed:
            raise ValueError("PinnedBuffer used after free()")
        return np.asarray(_HostMemory(self, self.ptr, self.nbytes))

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def view(self, dtype, offset_bytes: int = 0, count: int | None = None) -> np.ndarray:
        """A numpy view of ``count`` elements of ``dtype`` at ``offset_bytes``."""
        dt = np.dtype(dtype)
        if offset_bytes % dt.alignment:
            raise ValueError(f"offset {offset_bytes} is not aligned for {dt}")
        if count is None:
            count = (self.nbytes - offset_bytes) // dt.itemsize
        end = offset_bytes + count * dt.itemsize
        if offset_bytes < 0 or count < 0 or end > self.nbytes:
            raise ValueError(f"view [{offset_bytes}, {end}) outside the pinned buffer's {self.nbytes} bytes")
        return self.array[offset_bytes:end].view(dt)

    def free(self) -> None:
        """Release now. Numpy views made earlier must not be used afterwards."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self) -> str:
        return f"PinnedBuffer({self.nbytes} bytes at 0x{self.ptr:x})"
