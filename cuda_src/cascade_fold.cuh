// The cascade fold: each query row's attention states over every level (float32 state rows the
// levels' work items wrote, listed by the plan set in level order, KV order within a level) are
// combined with the state operator (StateFold, as the merge kernel) into the output and LSE.
// One warp per (query row, head, 32 columns), a column per lane; a persistent loop over the
// jobs, whose count it reads from the plan set, so the grid is fixed and a captured graph
// replays for any plan.
#pragma once
#include "ptx.cuh"
#include "state_fold.cuh"

namespace rtattn {

template <typename T, bool SOFTMAX, int D, int NUM_WARPS, class P>
__device__ __forceinline__ void cascade_fold(const P& p) {
  constexpr int SLICES = D / 32;
  constexpr int KU = 8;  // states whose loads are in flight together (a few levels, a few chunks)
  allow_next_grid();
  const int rows = p.fold_info[0];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = p.num_qo_heads;
  for (int job = warp; job < rows * H * SLICES; job += gridDim.x * NUM_WARPS) {
    const int r = job / (H * SLICES), head = job / SLICES % H, d = job % SLICES * 32 + lane;
    const int first = p.fold_indptr[r], n = p.fold_indptr[r + 1] - first;
    wait_for_previous_grid();  // the states are the previous kernel's; returns at once after the first time
    StateFold<SOFTMAX, 1> fold;
    for (int k0 = 0; k0 < n; k0 += KU) {
      float l[KU], v[KU][1];
#pragma unroll
      for (int k = 0; k < KU; ++k) {
        const bool ok = k0 + k < n;
        const int64_t srow = ok ? int64_t(p.fold_rows[first + k0 + k]) * H + head : 0;
        l[k] = ok ? __ldcg(p.state_lse + srow) : -INFINITY;
        v[k][0] = ok ? __ldcg(p.state_o + srow * D + d) : 0.f;
      }
      fold.round(l, v);
    }
    p.o[int64_t(r) * p.o_stride_tok + int64_t(head) * p.o_stride_head + d] = from_float<T>(fold.out(0));
    if (p.lse != nullptr && d == 0) p.lse[int64_t(r) * H + head] = fold.lse();
  }
}

}  // namespace rtattn
