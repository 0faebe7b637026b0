// The QueryTransform hook over one 16-byte chunk pair of a query row, as the decode and prefill
// kernels stage q into shared memory: the 8 elements at columns c..c+7 and their partners at
// c + D/2 (the pair a RoPE-style transform rotates together).
#pragma once
#include "ptx.cuh"

namespace rtattn {

template <class T, class Variant, class P>
__device__ __forceinline__ void transform_query_chunks(Variant& var, const P& p, uint4& lo, uint4& hi, int c,
                                                       int qo_idx, int qo_head) {
  T* l = reinterpret_cast<T*>(&lo);
  T* h = reinterpret_cast<T*>(&hi);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float x = to_float(l[j]), y = to_float(h[j]);
    var.QueryTransform(p, x, y, c + j, qo_idx, qo_head);
    l[j] = from_float<T>(x);
    h[j] = from_float<T>(y);
  }
}

}  // namespace rtattn
