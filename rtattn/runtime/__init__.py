"""rtattn.runtime: the driver-API layer everything else stands on.

driver (error funnel, devices, primary contexts), stream (streams, events),
memory (device + pinned buffers), dlpack (import/export), nvrtc (compile +
CUBIN cache), module (load, kernels, launch). Importing it never needs a GPU.
"""
from .driver import (CudaError, Device, DeviceProps, NoDeviceError, check, current_device, device_count,
                     has_device, no_device_reason)
from .stream import Event, Stream, as_stream
from .memory import DeviceBuffer, PinnedBuffer, memcpy_dtod_async, memcpy_dtoh_async, memcpy_htod_async, memset_d32
from .dlpack import DTYPES, ITEMSIZE, DLPackTensor, TensorView, as_tensor, export, normalize_dtype
from .nvrtc import (CompiledModule, CompileError, cache_dir, cache_stats, clear_memo, compile_to_cubin,
                    cuda_include_dir, cuda_src_dir, nvrtc_version)
from .module import Kernel, Module, pack_params

__all__ = [
    "CudaError", "NoDeviceError", "check", "has_device", "device_count", "no_device_reason",
    "Device", "DeviceProps", "current_device",
    "Stream", "Event", "as_stream",
    "DeviceBuffer", "PinnedBuffer", "memcpy_htod_async", "memcpy_dtoh_async", "memcpy_dtod_async", "memset_d32",
    "DTYPES", "ITEMSIZE", "TensorView", "DLPackTensor", "as_tensor", "export", "normalize_dtype",
    "CompiledModule", "CompileError", "compile_to_cubin", "nvrtc_version", "cuda_src_dir",
    "cuda_include_dir", "cache_dir", "cache_stats", "clear_memo",
    "Module", "Kernel", "pack_params",
]
