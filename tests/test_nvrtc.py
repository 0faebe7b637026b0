"""NVRTC compile, the CUBIN cache (hits, misses, corruption, concurrency), and
on a GPU: load -> launch end to end."""
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rtattn.runtime import (CompiledModule, CompileError, DeviceBuffer, Module, Stream, cache_stats, clear_memo,
                            compile_to_cubin, cuda_src_dir, nvrtc_version)
from rtattn.runtime import cubin_cache

# A warp-level bf16 tensor-core product C(16x8) = A(16x16) @ B(16x8), loading
# A and B^T into shared memory with cp.async: the instructions rtattn's
# prefill kernels live on.
MMA_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void mma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* bt, float* c) {
    __shared__ alignas(16) __nv_bfloat16 sa[16 * 16];
    __shared__ alignas(16) __nv_bfloat16 sbt[8 * 16];
    const int lane = threadIdx.x;
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(sa + lane * 8));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(a + lane * 8));
    if (lane < 16) {
        dst = static_cast<unsigned>(__cvta_generic_to_shared(sbt + lane * 8));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(bt + lane * 8));
    }
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncwarp();
    const int g = lane >> 2, t = lane & 3;
    auto u32 = [](const __nv_bfloat16* p) { return *reinterpret_cast<const unsigned*>(p); };
    unsigned a0 = u32(sa + g * 16 + t * 2), a1 = u32(sa + (g + 8) * 16 + t * 2);
    unsigned a2 = u32(sa + g * 16 + t * 2 + 8), a3 = u32(sa + (g + 8) * 16 + t * 2 + 8);
    unsigned b0 = u32(sbt + g * 16 + t * 2), b1 = u32(sbt + g * 16 + t * 2 + 8);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    c[g * 8 + t * 2] = d0; c[g * 8 + t * 2 + 1] = d1;
    c[(g + 8) * 8 + t * 2] = d2; c[(g + 8) * 8 + t * 2 + 1] = d3;
}

extern "C" __global__ void axpy_half(__half* y, const __half* x, float alpha, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(alpha * __half2float(x[i]) + __half2float(y[i]));
}

struct ScaleParams { float* out; const float* in; float scale; int n; };

extern "C" __global__ void scale_params(const __grid_constant__ ScaleParams p) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.out[i] = p.scale * p.in[i];
}

template <int N> __global__ void fill_n(int* out) { out[threadIdx.x] = N; }
"""

SIMPLE_SRC = 'extern "C" __global__ void k(int* x) { x[threadIdx.x] = %d; }\n'


def _entries(cache):
    return sorted((cache / "cubin").glob("*.bin"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_compile_fp16_bf16_cp_async_mma(isolated_cache, arch):
    mod = compile_to_cubin(MMA_SRC, name="mma_test", arch=arch, name_expressions=("fill_n<7>",), quiet=True)
    assert isinstance(mod, CompiledModule) and isinstance(mod, bytes)
    assert mod[:4] == b"\x7fELF" and mod.cubin[:4] == b"\x7fELF"
    assert mod.lowered == {"fill_n<7>": "_Z6fill_nILi7EEvPi"}
    assert b"mma_bf16" in mod and b"scale_params" in mod


def test_nvrtc_version_matches_driver_family():
    major, minor = nvrtc_version()
    assert major == 13  # CUBINs must load on the H200 machine's CUDA 13.0 driver


def test_memo_then_disk_hit_then_miss(isolated_cache):
    a = compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", quiet=True)
    assert cache_stats()["compiles"] == 1 and cache_stats()["misses"] == 1
    b = compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", quiet=True)
    assert b == a and cache_stats()["memo_hits"] == 1 and cache_stats()["compiles"] == 1
    clear_memo()
    c = compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", quiet=True)
    assert c == a and cache_stats()["disk_hits"] == 1 and cache_stats()["compiles"] == 1
    # anything in the key changes -> a fresh compile
    compile_to_cubin(SIMPLE_SRC % 2, name="k", arch="sm_90", quiet=True)
    compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_80", quiet=True)
    compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", options=("-lineinfo",), quiet=True)
    assert cache_stats()["compiles"] == 4 and len(_entries(isolated_cache)) == 4


def test_header_edit_invalidates(isolated_cache, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "val.cuh").write_text("#define VAL 1\n")
    src = '#include "val.cuh"\nextern "C" __global__ void k(int* x) { *x = VAL; }\n'
    compile_to_cubin(src, name="k", arch="sm_90", include_dirs=(str(inc),), quiet=True)
    compile_to_cubin(src, name="k", arch="sm_90", include_dirs=(str(inc),), quiet=True)
    assert cache_stats()["compiles"] == 1
    (inc / "val.cuh").write_text("#define VAL 2\n")
    compile_to_cubin(src, name="k", arch="sm_90", include_dirs=(str(inc),), quiet=True)
    assert cache_stats()["compiles"] == 2


def test_cuda_src_is_on_the_include_path(isolated_cache):
    hdrs = sorted(p.name for p in cuda_src_dir().glob("*.cuh"))
    if not hdrs:
        pytest.skip("no cuda_src headers yet")
    # every shipped header must at least be found by NVRTC
    src = "".join(f'#include "{h}"\n' for h in hdrs[:1]) + 'extern "C" __global__ void k() {}\n'
    assert compile_to_cubin(src, name="inc", arch="sm_90", quiet=True)[:4] == b"\x7fELF"


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_entry_is_rebuilt(isolated_cache, damage):
    good = compile_to_cubin(SIMPLE_SRC % 3, name="k", arch="sm_90", quiet=True)
    (entry,) = _entries(isolated_cache)
    blob = bytearray(entry.read_bytes())
    if damage == "flip":
        blob[-10] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob = bytearray(b"not a cache entry")
    entry.write_bytes(bytes(blob))
    clear_memo()
    again = compile_to_cubin(SIMPLE_SRC % 3, name="k", arch="sm_90", quiet=True)
    assert again == good
    s = cache_stats()
    assert s["corrupt"] == 1 and s["compiles"] == 2
    clear_memo()
    compile_to_cubin(SIMPLE_SRC % 3, name="k", arch="sm_90", quiet=True)
    assert cache_stats()["disk_hits"] == 1  # the rebuilt entry is valid


@pytest.mark.parametrize("meta", [{}, {"log": ""}, {"lowered": {}, "log": ""}, {"lowered": {"k": 1}, "log": ""},
                                  [], {"lowered": {"k": "k"}}])
def test_entry_with_a_valid_checksum_but_incomplete_metadata_is_rebuilt(isolated_cache, meta):
    """e.g. written by another rtattn version: a miss and a rebuild, never a KeyError."""
    from rtattn.runtime import cubin_cache
    good = compile_to_cubin(SIMPLE_SRC % 4, name="k", arch="sm_90", name_expressions=("k",), quiet=True)
    (entry,) = _entries(isolated_cache)
    cubin_cache.store(entry.stem, bytes(good), meta)   # well-formed, checksummed, incomplete
    clear_memo()
    cache_stats(reset=True)
    again = compile_to_cubin(SIMPLE_SRC % 4, name="k", arch="sm_90", name_expressions=("k",), quiet=True)
    assert again == good and again.lowered == good.lowered
    s = cache_stats()
    assert s["corrupt"] == 1 and s["compiles"] == 1


def _compile_in_child(cache_dir, seed):
    os.environ["RTATTN_CACHE_DIR"] = cache_dir
    from rtattn.runtime import cache_stats, compile_to_cubin
    cubin = compile_to_cubin(MMA_SRC, name="mma_test", arch="sm_90", quiet=True)
    return hashlib.sha256(cubin).hexdigest(), cache_stats()


def test_concurrent_writers(isolated_cache):
    ctx = mp.get_context("spawn")
    with ctx.Pool(6) as pool:
        results = pool.starmap(_compile_in_child, [(str(isolated_cache), i) for i in range(12)])
    assert len({h for h, _ in results}) == 1
    (entry,) = _entries(isolated_cache)
    assert not list((isolated_cache / "cubin").glob("*.tmp"))  # no temp files left behind
    clear_memo()
    cubin = compile_to_cubin(MMA_SRC, name="mma_test", arch="sm_90", quiet=True)
    assert hashlib.sha256(cubin).hexdigest() == results[0][0] and cache_stats()["disk_hits"] == 1


def _stats_of_a_fresh_process(code: str, cache, timeout: int) -> dict:
    """Run `code` (it prints cache_stats() as JSON last) in a new interpreter on the cache `cache`."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "RTATTN_CACHE_DIR": str(cache)}, cwd=cache.parent)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_disk_cache(isolated_cache):
    compile_to_cubin(MMA_SRC, name="mma_test", arch="sm_90", quiet=True)
    code = textwrap.dedent("""
        import json
        from rtattn.runtime import cache_stats, compile_to_cubin
        compile_to_cubin(%r, name="mma_test", arch="sm_90", quiet=True)
        print(json.dumps(cache_stats()))
    """ % MMA_SRC)
    stats = _stats_of_a_fresh_process(code, isolated_cache, timeout=120)
    assert stats["disk_hits"] == 1 and stats["compiles"] == 0


def test_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("RTATTN_CACHE_DIR", str(blocker))  # a file, not a directory
    clear_memo()
    cache_stats(reset=True)
    assert compile_to_cubin(SIMPLE_SRC % 9, name="k", arch="sm_90", quiet=True)[:4] == b"\x7fELF"
    assert cache_stats()["write_errors"] == 1


def test_compile_error_has_log_and_saved_source(isolated_cache):
    src = 'extern "C" __global__ void broken(int* x) { *x = undefined_thing; }\n'
    with pytest.raises(CompileError) as ei:
        compile_to_cubin(src, name="broken_kernel", arch="sm_90", quiet=True)
    e = ei.value
    assert "undefined_thing" in e.log and "undefined_thing" in str(e)
    assert e.source_path in str(e) and e.source_path.startswith(str(isolated_cache / "failed"))
    assert open(e.source_path).read() == src
    assert e.result_name == "NVRTC_ERROR_COMPILATION" and e.call == "nvrtcCompileProgram"
    assert "broken_kernel" in str(e) and "sm_90" in str(e)


def test_bad_option_is_a_compile_error(isolated_cache):
    with pytest.raises(CompileError, match="NVRTC_ERROR_INVALID_OPTION"):
        compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", options=("--no-such-flag",), quiet=True)


def test_argument_validation():
    with pytest.raises(ValueError, match="arch must look like"):
        compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="compute_90")
    with pytest.raises(TypeError, match="not a string"):
        compile_to_cubin(SIMPLE_SRC % 1, name="k", arch="sm_90", options="-lineinfo")


def test_quiet_when_not_a_tty(isolated_cache, capfd):
    compile_to_cubin(SIMPLE_SRC % 5, name="k", arch="sm_90")
    assert capfd.readouterr().err == ""


def test_module_load_refuses_non_cubin():
    from rtattn.runtime import has_device
    if has_device():
        pytest.skip("GPU present: covered by the GPU tier")
    with pytest.raises(Exception):
        Module.load(b"\x7fELFnot really")


# ------------------------------------------------------------------ GPU tier
def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture
def mma_module(device, isolated_cache):
    return Module.load(compile_to_cubin(MMA_SRC, name="mma_test", arch=device.arch,
                                        name_expressions=("fill_n<7>",), quiet=True))


@pytest.mark.gpu
def test_mma_bf16_end_to_end(mma_module):
    rng = np.random.default_rng(1)
    a = rng.integers(-8, 8, (16, 16)).astype(np.float32) / 4  # exact in bf16
    b = rng.integers(-8, 8, (16, 8)).astype(np.float32) / 4
    da, dbt, dc = DeviceBuffer(512), DeviceBuffer(256), DeviceBuffer(16 * 8 * 4)
    da.copy_from_host(_bf16_bits(a))
    dbt.copy_from_host(np.ascontiguousarray(_bf16_bits(b).T))
    k = mma_module.function("mma_bf16")
    k.launch((1,), (32,), [(da.ptr, ctypes.c_void_p), (dbt.ptr, ctypes.c_void_p), (dc.ptr, ctypes.c_void_p)])
    c = dc.copy_to_host(np.empty((16, 8), np.float32))
    np.testing.assert_array_equal(c, a @ b)


@pytest.mark.gpu
def test_typed_args_half_kernel_on_stream(mma_module):
    n = 1000
    x = np.linspace(-1, 1, n).astype(np.float16)
    y = np.ones(n, np.float16)
    dx, dy = DeviceBuffer(2 * n), DeviceBuffer(2 * n)
    dx.copy_from_host(x)
    dy.copy_from_host(y)
    s = Stream()
    mma_module.function("axpy_half").launch(
        ((n + 255) // 256,), (256,),
        [(dy.ptr, ctypes.c_void_p), (dx.ptr, ctypes.c_void_p), (2.0, ctypes.c_float), (n, ctypes.c_int)],
        stream=s)
    s.synchronize()
    out = dy.copy_to_host(np.empty(n, np.float16))
    np.testing.assert_allclose(out, (2 * x.astype(np.float32) + 1).astype(np.float16), rtol=1e-3)


@pytest.mark.gpu
def test_params_struct_launch(mma_module):
    n = 4097
    src = np.arange(n, dtype=np.float32)
    din, dout = DeviceBuffer(4 * n), DeviceBuffer(4 * n)
    din.copy_from_host(src)
    params = struct.pack("<QQfi", dout.ptr, din.ptr, 0.5, n)  # matches ScaleParams
    k = mma_module.function("scale_params")
    k.launch(((n + 127) // 128,), (128,), params)
    np.testing.assert_array_equal(dout.copy_to_host(np.empty(n, np.float32)), 0.5 * src)
    args = k.launch_args((1,), (128,), params)
    assert args["kernel_params"] and args["grid"] == (1, 1, 1) and args["block"] == (128, 1, 1)


@pytest.mark.gpu
def test_name_expression_lookup(mma_module):
    out = DeviceBuffer(32 * 4)
    mma_module.function("fill_n<7>").launch((1,), (32,), [(out.ptr, ctypes.c_void_p)])
    assert (out.copy_to_host(np.empty(32, np.int32)) == 7).all()


@pytest.mark.gpu
def test_attributes_occupancy_and_smem_optin(mma_module, device):
    k = mma_module.function("scale_params")
    attrs = k.attributes()
    assert attrs["num_regs"] > 0 and attrs["max_threads"] >= 128 and attrs["static_smem"] == 0
    assert mma_module.function("mma_bf16").attributes()["static_smem"] == 512 + 256
    assert k.occupancy(128, 0) >= 1
    big = device.props.smem_per_block_optin
    with pytest.raises(ValueError, match="set_max_dynamic_smem"):
        k.launch((1,), (32,), struct.pack("<QQfi", 0, 0, 1.0, 0), smem=100 * 1024)
    k.set_max_dynamic_smem(big)
    assert k.occupancy(128, big) == 1
    k.launch((1,), (32,), struct.pack("<QQfi", 0, 0, 1.0, 0), smem=big)
    device.synchronize()
    with pytest.raises(ValueError, match="opt-in limit"):
        k.set_max_dynamic_smem(big + 1)


@pytest.mark.gpu
def test_missing_kernel_name_is_named(mma_module):
    from rtattn.runtime import CudaError
    with pytest.raises(CudaError, match=r"cuModuleGetFunction\(nope\) failed: CUDA_ERROR_NOT_FOUND"):
        mma_module.function("nope")


@pytest.mark.gpu
def test_cache_reuse_across_processes_and_launch(device, isolated_cache):
    compile_to_cubin(MMA_SRC, name="mma_test", arch=device.arch, quiet=True)
    code = textwrap.dedent("""
        import ctypes, json, numpy as np
        from rtattn.runtime import DeviceBuffer, Device, Module, cache_stats, compile_to_cubin
        m = Module.load(compile_to_cubin(%r, name="mma_test", arch=Device().arch, quiet=True))
        out = DeviceBuffer(4 * 64); inp = DeviceBuffer(4 * 64)
        inp.copy_from_host(np.ones(64, np.float32))
        import struct
        m.function("scale_params").launch((1,), (64,), struct.pack("<QQfi", out.ptr, inp.ptr, 3.0, 64))
        assert (out.copy_to_host(np.empty(64, np.float32)) == 3.0).all()
        print(json.dumps(cache_stats()))
    """ % MMA_SRC)
    stats = _stats_of_a_fresh_process(code, isolated_cache, timeout=300)
    assert stats["disk_hits"] == 1 and stats["compiles"] == 0


def test_pack_params_struct_bytes():
    from rtattn.runtime import pack_params
    raw = struct.pack("<QQfi", 0x1111, 0x2222, 0.5, 7)
    addr, keep = pack_params(raw)
    arg0 = ctypes.c_void_p.from_address(addr).value
    assert ctypes.string_at(arg0, len(raw)) == raw


def test_pack_params_typed_values():
    from rtattn.runtime import pack_params

    class Buf:
        ptr = 0xABCDEF

    addr, keep = pack_params([(Buf(), ctypes.c_void_p), (np.int64(0x10), ctypes.c_void_p),
                              (np.float32(2.5), ctypes.c_float), (-3, ctypes.c_int), (ctypes.c_uint8(9), None)])
    ptrs = (ctypes.c_void_p * 5).from_address(addr)
    assert ctypes.c_void_p.from_address(ptrs[0]).value == 0xABCDEF
    assert ctypes.c_void_p.from_address(ptrs[1]).value == 0x10
    assert ctypes.c_float.from_address(ptrs[2]).value == 2.5
    assert ctypes.c_int.from_address(ptrs[3]).value == -3
    assert ctypes.c_uint8.from_address(ptrs[4]).value == 9
    with pytest.raises(TypeError, match="pair"):
        pack_params([5])
    with pytest.raises(ValueError, match="empty"):
        pack_params(b"")


def test_nvrtc_writes_only_into_buffers_of_its_own(isolated_cache, monkeypatch):
    """NVRTC writes the log and the CUBIN into the buffers it is given: they must be fresh mutable
    buffers, never `bytes` (an empty log is one NUL byte, and `b" " * 1` is the constant b" "
    itself: once the shared one-byte b" " read b"\\x00", torch's import failed in the same process)."""
    from rtattn.runtime import nvrtc as R
    given = []
    for call in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
        real = getattr(R.nvrtc, call)
        monkeypatch.setattr(R.nvrtc, call, lambda prog, buf, real=real: (given.append(buf), real(prog, buf))[1])
    compiled = compile_to_cubin('extern "C" __global__ void quiet() {}', name="quiet", arch="sm_80", quiet=True,
                                use_cache=False)
    assert compiled.log == "" and compiled[:4] == b"\x7fELF" and type(compiled) is not bytearray
    assert len(given) == 2 and all(type(b) is bytearray for b in given), [type(b) for b in given]
