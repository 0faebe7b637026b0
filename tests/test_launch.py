"""rtattn.runtime.launch and libcuda on the CPU: argument buffers, prepared calls (the ctypes
structs the driver reads), launch keys, stream handles, the error funnel of the ctypes entry.
The calls themselves go to a stub libcuda in tests/test_graph.py (cuda.h layouts checked there)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from rtattn.runtime import CudaError, Stream, libcuda
from rtattn.runtime.launch import KernelCall, Launch, Params, stream_handle

K = SimpleNamespace(handle=0xF00, name="k", max_dynamic_smem=0)


def test_params_buffer_has_a_fixed_address_and_checks_its_size():
    p = Params(b"abcd")
    addr = ctypes.addressof(p.buffer)
    assert bytes(p) == b"abcd" and len(p) == 4
    assert ctypes.c_void_p.from_address(p.argv).value == addr     # kernelParams[0] -> the struct
    p.write(b"wxyz")
    assert bytes(p) == b"wxyz" and ctypes.addressof(p.buffer) == addr
    with pytest.raises(ValueError, match="4 bytes"):
        p.write(b"toolong")
    with pytest.raises(ValueError, match="empty"):
        Params(b"")
    assert bytes(Params(3)) == bytes(3)


def test_a_call_prepares_its_config_pdl_attribute_and_node_params_once():
    p = Params(16)
    c = KernelCall(K, (33, 8), 128, 4096, p, pdl=True)
    cfg = c.config
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.sharedMemBytes) == (33, 8, 1, 128, 4096)
    assert cfg.numAttrs == 1 and cfg.attrs[0].id == libcuda.PDL_ATTRIBUTE
    assert cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert KernelCall(K, 1, 32, 0, p).config.numAttrs == 0
    node = libcuda.KernelNodeParams.from_address(c.node_params())
    assert (node.func, node.gridDimY, node.kernelParams) == (0xF00, 8, p.argv) and c.node_params() == c.node_addr
    assert ctypes.sizeof(libcuda.LaunchAttribute) == 72          # id, 4 pad bytes, 64-byte union
    with pytest.raises(ValueError, match="grid"):
        KernelCall(K, (0, 1), 128, 0, p)
    with pytest.raises(ValueError, match="set_max_dynamic_smem"):
        KernelCall(K, 1, 128, 64 * 1024, p)
    with pytest.raises(TypeError, match="Params"):
        KernelCall(K, 1, 128, 0, b"raw")


def test_launch_keys_name_shapes_and_distinct_argument_buffers():
    shared, other = Params(b"AA"), Params(b"BB")
    a = Launch([KernelCall(K, 4, 32, 0, shared, pdl=True), KernelCall(K, 2, 64, 0, shared)])
    b = Launch([KernelCall(K, 4, 32, 0, Params(b"CC"), pdl=True), KernelCall(K, 2, 64, 0, other)])
    assert a.config_key == b.config_key and a.params_key() == b"AA" and b.params_key() == b"CCBB"
    assert Launch([KernelCall(K, 5, 32, 0, shared)]).config_key != a.config_key
    with pytest.raises(ValueError, match="at least one"):
        Launch([])


def test_stream_handles_from_every_spelling():
    class TorchLike:
        cuda_stream = 0x7000
    assert stream_handle(None) == 0 and stream_handle(0x5000) == 0x5000
    assert stream_handle(Stream.wrap(0x6000)) == 0x6000 and stream_handle(TorchLike()) == 0x7000


def test_a_foreign_stream_object_is_converted_once_while_it_keeps_coming_back():
    class Counting:   # torch's Stream: the handle behind a property
        reads = 0

        def __init__(self, h):
            self.h = h

        @property
        def cuda_stream(self):
            Counting.reads += 1
            return self.h
    a, b = Counting(0x7100), Counting(0x7200)
    assert [stream_handle(a) for _ in range(3)] == [0x7100] * 3 and Counting.reads == 1
    assert stream_handle(b) == 0x7200 and stream_handle(0x5000) == 0x5000 and stream_handle(b) == 0x7200
    assert Counting.reads == 2 and stream_handle(a) == 0x7100 and Counting.reads == 3   # one remembered


def test_a_failed_ctypes_call_raises_through_the_funnel():
    with pytest.raises(CudaError, match="cuLaunchKernelEx.k. failed: CUDA_ERROR_INVALID_VALUE") as e:
        libcuda.fail(1, "cuLaunchKernelEx(k)")
    assert e.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(CudaError, match="CUDA_ERROR_UNKNOWN"):
        libcuda.fail(123456, "cuGraphLaunch")
    with pytest.raises(ValueError, match="ctypes' or 'bindings"):
        libcuda.set_entry("cython")
