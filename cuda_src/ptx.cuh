// Thin wrappers over the PTX instructions the kernels use: cp.async (16-byte global->shared
// copies that bypass registers), ldmatrix (8x8 tile loads in the mma fragment layout) and
// mma.sync m16n8k16 (the Ampere/Hopper warp-level tensor-core product).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "types.cuh"

namespace rtattn {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The KV cache is read once per step: its copies carry an L2 evict-first policy so they do not
// push out what is reused (the plan, q, partials, the next kernel's inputs). Measured on the
// H200: 0-2% faster on 13 of 14 benchmark rows than no hint; evict-normal was 6-16% slower
// (docs/perf-log.md v3, v4).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// Copies 16 bytes under an L2 cache policy; when `valid` is false nothing is read and the
// destination is zero-filled, so tokens past the end of a KV range contribute exact zeros.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid, uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(smem_dst)),
               "l"(gmem_src), "r"(src_bytes), "l"(policy));
}
// The same copy under L2's normal policy.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(valid ? 16 : 0));
}
// The policy copy with the shared address converted inside the asm from a 64-bit generic pointer.
// The 1-byte (fp8) KV tiles need it: with the 32-bit operand, ptxas (NVRTC 13.0) emitted their
// copies as LDGSTS [R+UR0], desc[UR1] with neither uniform register ever written, and every fp8
// kernel died with an illegal instruction on the H200 (tools/scan_sass.py finds the pattern).
// The 2-byte tiles keep cp_async_16: their SASS is correct and one address add cheaper.
__device__ __forceinline__ void cp_async_16_generic(void* smem_dst, const void* gmem_src, bool valid, uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile(
      "{ .reg .u64 s;\n cvta.to.shared.u64 s, %0;\n"
      " cp.async.cg.shared.global.L2::cache_hint [s], [%1], 16, %2, %3; }\n" ::"l"(smem_dst),
      "l"(gmem_src), "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 b16 matrices; lane l supplies the shared-memory address of row (l % 8) of matrix
// (l / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr));
}

template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaOp<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Two floats packed as one 32-bit register of the 16-bit element type.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// Programmatic dependent launch (sm_90+; no-ops before Hopper, where launches serialize anyway).
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Pins accumulator registers around an asynchronous product (wgmma): no access to them moves across.
template <int C>
__device__ __forceinline__ void fence_accumulators(float (&d)[C][4]) {
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[c][e])::"memory");
}

}  // namespace rtattn
