// fp8 KV cache elements (e4m3fn, e5m2) and their widening to fp16 in registers.
//
// An fp8 cache is multiplied on tensor cores in fp16 whatever q's type: every fp8 value is exact
// in fp16 (e5m2 is fp16's top byte; e4m3's 4-bit exponent fits fp16's 5), while bf16 would need
// a multiply per pair to rebias the exponent; q (bf16) is converted once per work item. The
// conversions take 4 fp8 bytes (two pairs) per call: sm_89+ has one instruction per pair; sm_80
// rebuilds the fp16 bits with a byte permute, a shift and a mask (and, for e4m3, a multiply by
// 2^8 that moves the exponent bias from 7 to 15: exact, subnormals included). Non-finite codes
// are not supported in a KV cache: e4m3's NaN decodes as +-480 on sm_80. -DRTATTN_FP8_SOFTWARE
// (RTATTN_DEV_DEFINES) takes the sm_80 path on any GPU, so the GPU tier checks it on an H200.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "types.cuh"

namespace rtattn {

struct Fp8E4M3 { uint8_t bits; };  // 1-byte storage tags: the kernel never does arithmetic on them
struct Fp8E5M2 { uint8_t bits; };

template <class KV> struct IsFp8 { static constexpr bool value = false; };
template <> struct IsFp8<Fp8E4M3> { static constexpr bool value = true; };
template <> struct IsFp8<Fp8E5M2> { static constexpr bool value = true; };

template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };

// The tensor-core operand type: q's type, or fp16 for an fp8 cache.
template <class Q, class KV> struct MmaType { using type = Q; };
template <class Q> struct MmaType<Q, Fp8E4M3> { using type = __half; };
template <class Q> struct MmaType<Q, Fp8E5M2> { using type = __half; };

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The sm_89+ conversion of two byte pairs. Each pair goes in as its own 16-bit value (the high
// one shifted down), as FlashInfer and cuda_fp8.h do; -DRTATTN_FP8_CVT_H1 (a probe) lets ptxas
// read the high pair as a half-register operand instead.
template <bool E4M3>
__device__ __forceinline__ void cvt_pairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
#ifdef RTATTN_FP8_CVT_H1
  if constexpr (E4M3)
    asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(x));
  else
    asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e5m2x2 %0, l;\n cvt.rn.f16x2.e5m2x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(x));
#else
  const unsigned short l = static_cast<unsigned short>(x & 0xffffu), h = static_cast<unsigned short>(x >> 16);
  if constexpr (E4M3) {
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(l));
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(h));
  } else {
    asm volatile("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(lo) : "h"(l));
    asm volatile("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(hi) : "h"(h));
  }
#endif
}

// Bytes 0,1 of x -> fp16x2 `lo` (byte 0 in the low half), bytes 2,3 -> `hi`.
template <class KV> __device__ __forceinline__ void fp8x4_to_half(uint32_t x, uint32_t& lo, uint32_t& hi);

template <> __device__ __forceinline__ void fp8x4_to_half<Fp8E5M2>(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if __CUDA_ARCH__ >= 890 && !defined(RTATTN_FP8_SOFTWARE)
  cvt_pairs<false>(x, lo, hi);
#else
  lo = prmt(x, 0u, 0x1404);  // [0, b0, 0, b1]: each byte is the top byte of its fp16
  hi = prmt(x, 0u, 0x3424);
#endif
}

template <> __device__ __forceinline__ void fp8x4_to_half<Fp8E4M3>(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if __CUDA_ARCH__ >= 890 && !defined(RTATTN_FP8_SOFTWARE)
  cvt_pairs<true>(x, lo, hi);
#else
  // [b0, sign(b0), b1, sign(b1)] << 7 puts exponent and mantissa at fp16 bits 13..7 and the
  // sign at bit 15; the mask clears the sign copies in between. Then 2^8 rebiases (7 -> 15).
  const __half2 rebias = __floats2half2_rn(256.f, 256.f);
  uint32_t a = (prmt(x, 0u, 0x9180) << 7) & 0xbf80bf80u;
  uint32_t b = (prmt(x, 0u, 0xB3A2) << 7) & 0xbf80bf80u;
  __half2 ha = __hmul2(*reinterpret_cast<__half2*>(&a), rebias);
  __half2 hb = __hmul2(*reinterpret_cast<__half2*>(&b), rebias);
  lo = *reinterpret_cast<uint32_t*>(&ha);
  hi = *reinterpret_cast<uint32_t*>(&hb);
#endif
}

template <class KV> __device__ __forceinline__ float fp8_to_float(KV x) {
  uint32_t lo, hi;
  fp8x4_to_half<KV>(uint32_t(x.bits), lo, hi);
  return __low2float(*reinterpret_cast<__half2*>(&lo));
}

// A q register pair (bf16x2 or fp16x2) as the fp16x2 operand of an fp8-cache product. bf16
// values convert exactly within fp16's range; beyond +-65504 they saturate (no inf, no NaN).
template <class Q> __device__ __forceinline__ uint32_t to_half2(uint32_t x);
template <> __device__ __forceinline__ uint32_t to_half2<__half>(uint32_t x) { return x; }
template <> __device__ __forceinline__ uint32_t to_half2<__nv_bfloat16>(uint32_t x) {
  const __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&x);
  const float lo = fminf(fmaxf(__low2float(b), -65504.f), 65504.f);
  const float hi = fminf(fmaxf(__high2float(b), -65504.f), 65504.f);
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace rtattn
