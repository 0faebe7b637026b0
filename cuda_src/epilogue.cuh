// Writing one thread's rows of an mma m16n8 O accumulator: final O (through the variant's
// OutputTransform) and LSE for writethrough work, or float32 partial rows (O, LSE) that the
// merge kernel folds in the plan's order. Row r of a tile is (token r / heads, head r % heads).
#pragma once
#include "ptx.cuh"

namespace rtattn {

// `norm` multiplies O (1 / total weight for softmax rows, 1 for sigmoid sums; the caller folds a
// sink's rescale into it).
template <class Variant, class P, int DT>
__device__ __forceinline__ void store_row(const P& p, const Variant& var, const float (&o)[DT][4], int h,
                                          float norm, float lse, int q_row, int qo_head, int partial_row,
                                          int lane) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  const int c = (lane % 4) * 2;
  if (partial_row < 0) {
    T* op = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(qo_head) * p.o_stride_head + c;
#pragma unroll
    for (int dn = 0; dn < DT; ++dn) {
      float x0 = o[dn][2 * h] * norm, x1 = o[dn][2 * h + 1] * norm;
      if constexpr (Variant::has_output_transform) {
        x0 = var.OutputTransform(p, x0, qo_head, dn * 8 + c);
        x1 = var.OutputTransform(p, x1, qo_head, dn * 8 + c + 1);
      }
      *reinterpret_cast<uint32_t*>(op + dn * 8) = pack2<T>(x0, x1);
    }
    if (p.lse != nullptr && c == 0) p.lse[int64_t(q_row) * p.num_qo_heads + qo_head] = lse;
  } else {
    const int64_t prow = int64_t(partial_row) * p.num_qo_heads + qo_head;
    float* pp = p.partial_o + prow * D + c;
#pragma unroll
    for (int dn = 0; dn < DT; ++dn)
      *reinterpret_cast<float2*>(pp + dn * 8) = make_float2(o[dn][2 * h] * norm, o[dn][2 * h + 1] * norm);
    if (c == 0) p.partial_lse[prow] = lse;
  }
}

}  // namespace rtattn
