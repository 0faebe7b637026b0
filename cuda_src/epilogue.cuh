// Writing one thread's rows of an mma m16n8 O accumulator: final O (through the variant's
// OutputTransform) and LSE for writethrough work, or float32 partial rows (O, LSE) that the
// merge kernel folds in the plan's order. Row r of a tile is (token r / heads, head r % heads).
#pragma once
#include "ptx.cuh"

namespace rtattn {

template <class Variant, class P, int DT>
__device__ __forceinline__ void store_row(const P& p, const Variant& var, const float (&o)[DT][4], int h,
                                          float l_total, float lse, int q_row, int qo_head, int partial_row,
                                          int lane) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  const int c = (lane % 4) * 2;
  if (partial_row < 0) {
    const float inv = (Variant::use_softmax && l_total > 0.f) ? 1.f / l_total : 1.f;
    T* op = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(qo_head) * p.o_stride_head + c;
#pragma unroll
    for (int dn = 0; dn < DT; ++dn) {
      float x0 = o[dn][2 * h] * inv, x1 = o[dn][2 * h + 1] * inv;
      if constexpr (Variant::has_output_transform) {
        x0 = var.OutputTransform(p, x0, qo_head, dn * 8 + c);
        x1 = var.OutputTransform(p, x1, qo_head, dn * 8 + c + 1);
      }
      *reinterpret_cast<uint32_t*>(op + dn * 8) = pack2<T>(x0, x1);
    }
    if (p.lse != nullptr && c == 0) p.lse[int64_t(q_row) * p.num_qo_heads + qo_head] = lse;
  } else {
    const float inv = (Variant::use_softmax && l_total > 0.f) ? 1.f / l_total : 1.f;
    const int64_t prow = int64_t(partial_row) * p.num_qo_heads + qo_head;
    float* pp = p.partial_o + prow * D + c;
#pragma unroll
    for (int dn = 0; dn < DT; ++dn)
      *reinterpret_cast<float2*>(pp + dn * 8) = make_float2(o[dn][2 * h] * inv, o[dn][2 * h + 1] * inv);
    if (c == 0) p.partial_lse[prow] = lse;
  }
}

}  // namespace rtattn
