"""cuda_src/wgmma.cuh on its own: one warpgroup's m64nNk16 products from 128-byte-swizzled
shared tiles (Sw128Tile) against numpy. S = A B^T with both operands by descriptor (B K-major,
as K in QK^T) and O = P V with P from registers (B N-major, as V in PV), for every N the
prefill kernel uses. CPU tier: the kernels compile for sm_90a; GPU tier: the products."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from rtattn.runtime import DeviceBuffer, Module, compile_to_cubin

# One CTA of 128 threads: A (64 x K) and B (N x K, or K x N for the N-major case) copied into
# the swizzled layout, then K/16 wgmma k-steps. rs_* takes A in the m16n8k16 A fragment layout,
# built from the swizzled A tile with ldmatrix-free plain loads (row lane/4 (+8), cols 2(lane%4)).
SOURCE = r"""
#include "wgmma.cuh"
#include "swizzle.cuh"
using namespace rtattn;

template <int ROWS, int K, typename T>
__device__ void fill(T* dst, const T* src) {  // src row-major [ROWS][K] -> Sw128Tile
  using Tile = Sw128Tile<K, ROWS>;
  for (int i = threadIdx.x; i < ROWS * K / 8; i += 128) {
    const int r = i / (K / 8), c = i % (K / 8);
    *reinterpret_cast<uint4*>(dst + Tile::at(r, c)) = *reinterpret_cast<const uint4*>(src + r * K + c * 8);
  }
}

template <int N, int K, typename T>
__device__ void store(float* out, float (&d)[N / 8][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int c = 0; c < N / 8; ++c)
    for (int e = 0; e < 4; ++e)
      out[(warp * 16 + lane / 4 + 8 * (e / 2)) * N + c * 8 + (lane % 4) * 2 + (e & 1)] = d[c][e];
}

// C[64][N] = A[64][K] . B[N][K]^T
template <int N, int K, typename T>
__device__ void ss(const T* a, const T* b, float* c) {
  extern __shared__ __align__(1024) char smem[];
  T* sa = reinterpret_cast<T*>(smem);
  T* sb = reinterpret_cast<T*>(smem + 64 * K * sizeof(T));
  fill<64, K>(sa, a);
  fill<N, K>(sb, b);
  fence_proxy_async();
  __syncthreads();
  float d[N / 8][4];
  wgmma_fence();
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t ka = (kk / 4) * 64 * 128 + (kk % 4) * 32, kb = (kk / 4) * N * 128 + (kk % 4) * 32;
    WgmmaSS<T, N>::run(d, sw128_desc(smem_addr(sa) + ka, 16, 1024), sw128_desc(smem_addr(sb) + kb, 16, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(d);
  store<N, K, T>(c, d);
}

// C[64][N] = A[64][K] . B[K][N], A from registers, B N-major with the given leading / stride
// byte offsets (the kernel's: lbo = K * 128 between 64-column slabs, sbo = 1024 per 8 k-rows).
template <int N, int K, typename T>
__device__ void rs(const T* a, const T* b, float* c, uint32_t lbo, uint32_t sbo) {
  extern __shared__ __align__(1024) char smem[];
  T* sb = reinterpret_cast<T*>(smem);
  fill<K, N>(sb, b);
  fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = warp * 16 + lane / 4, col = (lane % 4) * 2;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
  float d[N / 8][4];
  for (int i = 0; i < N / 8; ++i)
    for (int e = 0; e < 4; ++e) d[i][e] = 0.f;
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t f[4];
    f[0] = a32[(r * K + kk * 16 + col) / 2];
    f[1] = a32[((r + 8) * K + kk * 16 + col) / 2];
    f[2] = a32[(r * K + kk * 16 + 8 + col) / 2];
    f[3] = a32[((r + 8) * K + kk * 16 + 8 + col) / 2];
    fence_accumulators(d);
    wgmma_fence();
    WgmmaRS<T, N>::run(d, f, sw128_desc(smem_addr(sb) + kk * 2048, lbo, sbo));
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(d);
  }
  store<N, K, T>(c, d);
}

#define SS(N, K, T, NAME) extern "C" __global__ void __launch_bounds__(128) ss_##NAME##_##N##_##K(const T* a, const T* b, float* c) { ss<N, K, T>(a, b, c); }
#define RS(N, K, T, NAME) extern "C" __global__ void __launch_bounds__(128) rs_##NAME##_##N##_##K(const T* a, const T* b, float* c, uint32_t lbo, uint32_t sbo) { rs<N, K, T>(a, b, c, lbo, sbo); }
SS(32, 256, __nv_bfloat16, bf16) SS(64, 128, __nv_bfloat16, bf16) SS(128, 64, __nv_bfloat16, bf16) SS(64, 128, __half, f16)
RS(64, 128, __nv_bfloat16, bf16) RS(128, 64, __nv_bfloat16, bf16) RS(256, 32, __nv_bfloat16, bf16) RS(128, 64, __half, f16)
"""
SS_CASES = [(32, 256, "bf16"), (64, 128, "bf16"), (128, 64, "bf16"), (64, 128, "f16")]
RS_CASES = [(64, 128, "bf16"), (128, 64, "bf16"), (256, 32, "bf16"), (128, 64, "f16")]


def _cubin():
    return compile_to_cubin(SOURCE, name="wgmma_check", arch="sm_90a", quiet=True)


def test_wgmma_products_compile_for_sm90a(isolated_cache):
    assert len(_cubin()) > 0


def _bits(x: np.ndarray, dt: str) -> np.ndarray:
    if dt == "f16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)   # exact: small integers


def _run(kernel, arrays, out_shape, extra=()):
    bufs = [DeviceBuffer(a.nbytes) for a in arrays]
    for b, a in zip(bufs, arrays):
        b.copy_from_host(a)
    out = DeviceBuffer(int(np.prod(out_shape)) * 4)
    out.copy_from_host(np.full(out_shape, np.nan, np.float32))   # poisoned
    smem = sum(a.nbytes for a in arrays)
    kernel.set_max_dynamic_smem(smem)
    kernel.launch((1,), (128,), [(b.ptr, ctypes.c_void_p) for b in bufs] + [(out.ptr, ctypes.c_void_p)] +
                  [(x, ctypes.c_uint32) for x in extra], smem=smem)
    return out.copy_to_host(np.empty(out_shape, np.float32))


@pytest.fixture
def module(device):
    return Module.load(_cubin(), device)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,dt", SS_CASES)
def test_ss_product_b_k_major(module, n, k, dt):
    rng = np.random.default_rng(n + k)
    a = rng.integers(-4, 5, (64, k)).astype(np.float32)   # exact in 16 bits, sums exact in fp32
    b = rng.integers(-4, 5, (n, k)).astype(np.float32)
    got = _run(module.function(f"ss_{dt}_{n}_{k}"), [_bits(a, dt), _bits(b, dt)], (64, n))
    np.testing.assert_array_equal(got, a @ b.T)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,dt", RS_CASES)
def test_rs_product_a_registers_b_n_major(module, n, k, dt):
    rng = np.random.default_rng(3 * n + k)
    a = rng.integers(-4, 5, (64, k)).astype(np.float32)
    b = rng.integers(-4, 5, (k, n)).astype(np.float32)
    got = _run(module.function(f"rs_{dt}_{n}_{k}"), [_bits(a, dt), _bits(b, dt)], (64, n), extra=(k * 128, 1024))
    np.testing.assert_array_equal(got, a @ b)
