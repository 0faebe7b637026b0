// Merge of split-KV partial states, in the plan's fixed order (deterministic).
// One warp per (merge row, query head); lanes split head_dim. The grid is fixed (a persistent
// loop over rows), so it can be captured once and replayed for any plan.
//   softmax: O = sum_i e^{lse_i - lse} O_i,  lse = log sum_i e^{lse_i}
//   sigmoid: O = sum_i O_i (partials are unnormalized sums), same lse (log of total weight)
#pragma once
#include "ptx.cuh"

namespace rtattn {

template <class Variant, class P, int NUM_WARPS>
__device__ __forceinline__ void merge_persistent(const P& p) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  constexpr int PER_LANE = D / 32;
  const int num_rows = p.plan.plan_info[RTATTN_PLAN_INFO_NUM_MERGE_ROWS];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * NUM_WARPS;
  const int H = p.num_qo_heads;

  for (int job = warp; job < num_rows * H; job += num_warps) {
    const int r = job / H, head = job % H;
    const int first = p.plan.merge_indptr[r], last = p.plan.merge_indptr[r + 1];
    float m = -INFINITY;
    for (int i = first; i < last; ++i)
      m = fmaxf(m, p.partial_lse[int64_t(p.plan.merge_partial[i]) * H + head]);
    const float base = m == -INFINITY ? 0.f : m;
    float acc[PER_LANE], w_sum = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = 0.f;
    for (int i = first; i < last; ++i) {
      const int64_t prow = int64_t(p.plan.merge_partial[i]) * H + head;
      const float w = __expf(p.partial_lse[prow] - base);
      const float f = Variant::use_softmax ? w : 1.f;
      w_sum += w;
      const float* src = p.partial_o + prow * D;
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) acc[j] += f * src[lane + 32 * j];
    }
    const float inv = (Variant::use_softmax && w_sum > 0.f) ? 1.f / w_sum : 1.f;
    const int q_row = p.plan.merge_qo_row[r];
    T* dst = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(head) * p.o_stride_head;
    Variant var;  // output transforms see only (params, value, head, d)
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      float x = acc[j] * inv;
      if constexpr (Variant::has_output_transform) x = var.OutputTransform(p, x, head, lane + 32 * j);
      dst[lane + 32 * j] = from_float<T>(x);
    }
    if (p.lse != nullptr && lane == 0)
      p.lse[int64_t(q_row) * H + head] = w_sum > 0.f ? base + __logf(w_sum) : -INFINITY;
  }
}

}  // namespace rtattn
