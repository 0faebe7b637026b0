"""Framework-free device arrays for the demos: numpy on the host, rtattn DeviceBuffers on the GPU.

numpy has no bfloat16, so bf16 travels as its uint16 bit pattern (round to nearest even on
the way in, exact on the way out); float16 and float32 travel as themselves.
"""
from __future__ import annotations

import numpy as np

from rtattn.runtime import DeviceBuffer, ITEMSIZE, export
from rtattn.runtime.dlpack import contiguous_strides


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(b) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_device_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Host array of the bytes a `dtype` tensor holds for values `x`."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return np.ascontiguousarray(x, dtype=np.dtype(dtype))


def from_device_bits(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits_to_f32(raw.view(np.uint16))
    return raw.view(np.dtype(dtype))


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` as the GPU will see it after conversion to `dtype`, in float64 (for references)."""
    return from_device_bits(to_device_bits(x, dtype), dtype).astype(np.float64)


class DeviceArray:
    """A C-contiguous device array of `shape` and `dtype` backed by one DeviceBuffer."""

    def __init__(self, shape, dtype: str, device=None):
        self.shape, self.dtype = tuple(int(n) for n in shape), dtype
        self.itemsize = ITEMSIZE[dtype]
        self.buffer = DeviceBuffer(max(int(np.prod(self.shape)), 1) * self.itemsize, device)

    @classmethod
    def from_host(cls, x: np.ndarray, dtype: str, device=None, stream=None) -> "DeviceArray":
        a = cls(x.shape, dtype, device)
        a.upload(x, stream)
        return a

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    def upload(self, x: np.ndarray, stream=None) -> None:
        """Copy host values `x` (synchronous without `stream`)."""
        self.buffer.copy_from_host(to_device_bits(x, self.dtype), stream)

    def fill_nan(self, stream=None) -> None:
        """Poison: 0xFF bytes are NaN for every float dtype."""
        self.buffer.memset(0xFF, stream)

    def view(self, lead: int | None = None, offset: int = 0):
        """A DLPack tensor over rows [offset, offset + lead) of the leading axis (no copy)."""
        n = self.shape[0] - offset if lead is None else int(lead)
        if offset < 0 or n < 0 or offset + n > self.shape[0]:
            raise ValueError(f"rows [{offset}, {offset + n}) outside the array's {self.shape[0]}")
        shape = (n,) + self.shape[1:]
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.itemsize
        return export(self.ptr + offset * row, shape, self.dtype, self.buffer.device.ordinal,
                      contiguous_strides(shape), owner=self)

    def download(self, lead: int | None = None, offset: int = 0, stream=None) -> np.ndarray:
        """Rows [offset, offset + lead) as float64 (synchronous; syncs `stream` first)."""
        n = self.shape[0] - offset if lead is None else int(lead)
        row_elems = int(np.prod(self.shape[1:], dtype=np.int64))
        raw = np.empty(n * row_elems * self.itemsize, np.uint8)
        if stream is not None:   # the copy below is synchronous only w.r.t. the legacy stream
            sync = getattr(stream, "synchronize", None)
            if sync is None:
                from rtattn.runtime import as_stream
                sync = as_stream(stream).synchronize
            sync()
        self.buffer.copy_to_host(raw, offset=offset * row_elems * self.itemsize)
        return from_device_bits(raw, self.dtype).astype(np.float64).reshape((n,) + self.shape[1:])
