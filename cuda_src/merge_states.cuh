// Public state merge: n attention states (O, LSE) per (row, head) -> one, with the merge
// operator, in index order (deterministic). LSE is natural-log, -inf marks an empty state.
//   O = sum_i e^{lse_i - lse} O_i,   lse = log sum_i e^{lse_i}
// One warp per (row, head); lanes stride head_dim. Strides are in elements.
#pragma once
#include "ptx.cuh"

namespace rtattn {

// P: the generated MergeStatesParams (rtattn/merge.py declares its members once).
template <typename T, class P>
__device__ __forceinline__ void merge_states_kernel(const P& p) {
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.v_out);
  for (int job = blockIdx.x * warps_per_block + threadIdx.x / 32; job < p.rows * p.heads;
       job += gridDim.x * warps_per_block) {
    const int r = job / p.heads, h = job % p.heads;
    const float* s = p.s + r * p.s_stride_row + h * p.s_stride_head;
    float m = -INFINITY;
    for (int i = 0; i < p.num_states; ++i) m = fmaxf(m, s[i * p.s_stride_state]);
    const float base = m == -INFINITY ? 0.f : m;
    float total = 0.f;
    for (int i = 0; i < p.num_states; ++i) total += __expf(s[i * p.s_stride_state] - base);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int d = lane; d < p.head_dim; d += 32) {
      float acc = 0.f;
      for (int i = 0; i < p.num_states; ++i) {
        const float w = __expf(s[i * p.s_stride_state] - base);
        acc += w * to_float(v[r * p.v_stride_row + i * p.v_stride_state + h * p.v_stride_head + d]);
      }
      out[r * p.o_stride_row + h * p.o_stride_head + d] = from_float<T>(acc * inv);
    }
    if (p.s_out != nullptr && lane == 0) p.s_out[int64_t(r) * p.heads + h] = total > 0.f ? base + __logf(total) : -INFINITY;
  }
}

}  // namespace rtattn
