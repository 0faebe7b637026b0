"""Driver layer: the error funnel, no-GPU behaviour, device properties."""
import subprocess
import sys
import textwrap
import time

import pytest
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from rtattn.runtime import CudaError, Device, DeviceProps, NoDeviceError, check, device_count, has_device


def test_check_returns_values():
    assert check((cu.CUresult.CUDA_SUCCESS,), "cuX") is None
    assert check((cu.CUresult.CUDA_SUCCESS, 7), "cuX") == 7
    assert check((cu.CUresult.CUDA_SUCCESS, 1, 2), "cuX") == (1, 2)
    assert check((nvrtc.nvrtcResult.NVRTC_SUCCESS, 13, 0), "nvrtcVersion") == (13, 0)


def test_check_names_call_and_result():
    with pytest.raises(CudaError) as ei:
        check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    e = ei.value
    assert e.call == "cuMemAlloc" and e.result_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert str(e).startswith("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")


def test_check_nvrtc_errors():
    with pytest.raises(CudaError) as ei:
        check((nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION,), "nvrtcCompileProgram")
    assert "NVRTC_ERROR_INVALID_OPTION" in str(ei.value)
    assert ei.value.result_name == "NVRTC_ERROR_INVALID_OPTION"


def test_no_device_result_is_no_device_error():
    with pytest.raises(NoDeviceError):
        check((cu.CUresult.CUDA_ERROR_NO_DEVICE,), "cuInit")
    assert issubclass(NoDeviceError, CudaError) and issubclass(CudaError, RuntimeError)


def test_has_device_is_a_bool_and_consistent():
    assert isinstance(has_device(), bool)
    assert has_device() == (device_count() > 0)


@pytest.mark.skipif(has_device(), reason="checks the GPU-less path")
def test_no_gpu_fails_fast_in_a_fresh_process(tmp_path):
    # A fresh interpreter proves nothing was warmed up; the timeout proves no hang.
    code = textwrap.dedent("""
        import time
        t0 = time.perf_counter()
        import rtattn
        from rtattn.runtime import Device, NoDeviceError, has_device, DeviceBuffer, Stream
        assert has_device() is False
        for make in (Device, lambda: DeviceBuffer(16), Stream):
            try:
                make()
            except NoDeviceError as e:
                assert "no CUDA device" in str(e), e
            else:
                raise SystemExit("no NoDeviceError")
        print(time.perf_counter() - t0)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip().splitlines()[-1]) < 5.0  # import included; Device() itself is instant


@pytest.mark.skipif(has_device(), reason="checks the GPU-less path")
def test_no_gpu_device_raises_at_once():
    t0 = time.perf_counter()
    with pytest.raises(NoDeviceError, match="no CUDA device"):
        Device()
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.gpu
def test_device_props(device):
    p = device.props
    assert isinstance(p, DeviceProps)
    assert p.sm_count > 0 and p.cc[0] >= 7
    assert p.smem_per_block_optin >= p.smem_per_block >= 48 * 1024
    assert p.smem_per_sm >= p.smem_per_block_optin
    assert p.regs_per_sm >= p.regs_per_block > 0
    assert p.l2_bytes > 0 and p.max_threads_per_sm >= 1024
    assert device.arch == f"sm_{p.cc[0]}{p.cc[1]}"
    assert device.name == p.name and device.name
    with pytest.raises(Exception):
        p.sm_count = 1  # frozen


@pytest.mark.gpu
def test_device_cached_and_context(device):
    assert Device(0) is device and Device(device) is device
    device.set_current()
    ctx = cu.cuCtxGetCurrent()
    assert check(ctx, "cuCtxGetCurrent") is not None
    device.synchronize()
    free, total = device.mem_info()
    assert 0 < free <= total
    with pytest.raises(ValueError, match="out of range"):
        Device(device_count() + 3)


@pytest.mark.gpu
def test_real_driver_error_is_named(device):
    device.set_current()
    with pytest.raises(CudaError) as ei:
        check(cu.cuMemAlloc(1 << 62), "cuMemAlloc")
    assert ei.value.result_name == "CUDA_ERROR_OUT_OF_MEMORY"


@pytest.mark.gpu
def test_h200_props_if_h200(device):
    if "H200" not in device.name and "H100" not in device.name:
        pytest.skip("not a Hopper part")
    p = device.props
    assert p.cc == (9, 0) and p.sm_count >= 114
    assert p.smem_per_block_optin == 227 * 1024


def test_errors_pickle():
    import pickle
    from rtattn.runtime import CompileError
    e = pickle.loads(pickle.dumps(CudaError("cuX failed: E", call="cuX", result_name="E")))
    assert (str(e), e.call, e.result_name) == ("cuX failed: E", "cuX", "E")
    c = CompileError("boom", log="L", source_path="/p.cu", name="n", arch="sm_90", result_name="R")
    c2 = pickle.loads(pickle.dumps(c))
    assert type(c2) is CompileError and (c2.log, c2.source_path, c2.arch, str(c2)) == ("L", "/p.cu", "sm_90", "boom")
