"""Checks of DLPack tensors against what a kernel will read, before any launch."""
from __future__ import annotations

from rtattn.runtime import as_tensor


def cuda_tensor(name: str, obj, stream=None, *, dtype: str | None = None, ndim: int | None = None):
    """View `obj` as CUDA memory, refusing wrong memory, dtype or rank with the tensor's name."""
    try:
        t = as_tensor(obj, stream, require="cuda")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
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
