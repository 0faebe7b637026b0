"""Loaded CUBIN modules and their kernels: attributes, occupancy, launch.

A kernel is launched either with typed arguments (``[(value, ctypes_type),
...]``) or, the rtattn convention, with ONE params struct passed by value
(``const __grid_constant__ Params p``): then ``params`` is the struct's bytes.
"""
from __future__ import annotations

import ctypes
import weakref

from cuda.bindings import driver as cu

from .driver import Device, check, current_device
from .stream import as_stream

__all__ = ["Module", "Kernel", "pack_params"]


def _unload(mod, device: Device) -> None:
    try:
        with device.active():
            cu.cuModuleUnload(mod)
    except Exception:
        pass


class Module:
    """A CUBIN loaded into a device's primary context (cuModuleLoadData): its kernels run on
    that device only (load it once per device)."""

    def __init__(self, handle, device: Device, cubin: bytes):
        self.handle = handle
        self.device = device
        self.lowered = dict(getattr(cubin, "lowered", {}) or {})
        self._kernels: dict[str, Kernel] = {}
        self._finalizer = weakref.finalize(self, _unload, handle, device)

    @classmethod
    def load(cls, cubin: bytes, device=None) -> "Module":
        dev = current_device(device)
        data = bytes(cubin)
        if not data.startswith(b"\x7fELF"):
            raise ValueError("not a CUBIN (no ELF header); compile with compile_to_cubin")
        with dev.active():
            handle = check(cu.cuModuleLoadData(data), "cuModuleLoadData")
        return cls(handle, dev, cubin)

    def function(self, name: str) -> "Kernel":
        """The kernel called ``name``: an ``extern "C"`` name, a lowered (mangled)
        name, or a name expression given at compile time."""
        name = self.lowered.get(name, name)
        k = self._kernels.get(name)
        if k is None:
            with self.device.active():
                f = check(cu.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            k = self._kernels[name] = Kernel(f, name, self)
        return k

    def unload(self) -> None:
        self._finalizer()


def pack_params(params):
    """``(kernelParams address, keepalive)`` for cuLaunchKernel or a graph kernel
    node. ``params``: struct bytes (one by-value argument) or [(value, ctype)]."""
    if isinstance(params, (bytes, bytearray, memoryview)):
        raw = bytes(params)
        if not raw:
            raise ValueError("empty params struct")
        buf = ctypes.create_string_buffer(raw, len(raw))
        args = [buf]
    else:
        args = []
        for item in params:
            try:
                value, ctype = item
            except (TypeError, ValueError):
                raise TypeError(f"kernel argument {item!r} must be a (value, ctypes type) pair") from None
            if isinstance(value, (ctypes._SimpleCData, ctypes.Structure)):
                args.append(value)
            elif ctype is ctypes.c_void_p:  # pointers: ints, numpy ints, or buffers (.ptr)
                args.append(ctype(int(getattr(value, "ptr", value))))
            else:
                args.append(ctype(value))
    ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
    return ctypes.addressof(ptrs), (ptrs, args)


_FA = cu.CUfunction_attribute


class Kernel:
    """A CUfunction with the launch helpers rtattn needs."""

    def __init__(self, handle, name: str, module: Module):
        self.handle = handle
        self.name = name
        self.module = module  # keeps the module loaded
        self.max_dynamic_smem = 0

    def _attr(self, attr) -> int:
        with self.module.device.active():
            return int(check(cu.cuFuncGetAttribute(attr, self.handle), f"cuFuncGetAttribute({attr.name})"))

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to more than 48 KiB of dynamic shared memory."""
        limit = self.module.device.props.smem_per_block_optin - self._attr(_FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        if nbytes > limit:
            raise ValueError(f"{self.name}: {nbytes} bytes of dynamic shared memory exceed the device's "
                             f"opt-in limit of {limit} (after static shared memory)")
        with self.module.device.active():
            check(cu.cuFuncSetAttribute(self.handle, _FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        int(nbytes)), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        self.max_dynamic_smem = int(nbytes)

    def attributes(self) -> dict:
        return {
            "num_regs": self._attr(_FA.CU_FUNC_ATTRIBUTE_NUM_REGS),
            "max_threads": self._attr(_FA.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            "static_smem": self._attr(_FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            "local_bytes": self._attr(_FA.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            "const_bytes": self._attr(_FA.CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES),
            "max_dynamic_smem": self._attr(_FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
        }

    def occupancy(self, block_threads: int, dyn_smem: int = 0) -> int:
        """Resident blocks per SM for this block size and dynamic shared memory."""
        with self.module.device.active():
            return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.handle, int(block_threads),
                                                                           int(dyn_smem)),
                             "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def _check_launch(self, grid, block, smem):
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        if smem > 48 * 1024 and smem > self.max_dynamic_smem:
            raise ValueError(f"{self.name}: {smem} bytes of dynamic shared memory need "
                             f"set_max_dynamic_smem({smem}) first")
        return grid, block

    def launch(self, grid, block, params, smem: int = 0, stream=None) -> None:
        """Launch on ``stream`` (None: legacy default). ``params``: struct bytes (through the one
        launch path, rtattn.runtime.launch) or [(value, ctype)] (cuLaunchKernel)."""
        if isinstance(params, (bytes, bytearray, memoryview)):
            from .launch import KernelCall, Params, enqueue
            enqueue((KernelCall(self, grid, block, smem, Params(params)),), stream, self.module.device)
            return
        grid, block = self._check_launch(grid, block, smem)
        addr, keep = pack_params(params)
        from .launch import check_stream
        dev = self.module.device
        h = as_stream(stream).handle
        check_stream(h, dev)
        with dev.active():
            check(cu.cuLaunchKernel(self.handle, *grid, *block, int(smem), h, addr, 0),
                  f"cuLaunchKernel({self.name})")
        del keep  # the driver copied the arguments at launch

    def launch_args(self, grid, block, params, smem: int = 0) -> dict:
        """Everything a graph kernel node needs (CUDA_KERNEL_NODE_PARAMS fields);
        keep ``keepalive`` referenced until the node params are set."""
        grid, block = self._check_launch(grid, block, smem)
        addr, keep = pack_params(params)
        return {"func": self.handle, "grid": grid, "block": block, "smem": int(smem),
                "kernel_params": addr, "keepalive": keep}

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


def _dim3(d, what: str) -> tuple[int, int, int]:
    d = (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(d) <= 3 or any(x < 1 for x in d):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {d}")
    return d + (1,) * (3 - len(d))
