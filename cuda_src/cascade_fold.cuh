// The cascade fold: each query row's attention states over every level (float32 state rows the
// levels' work items wrote, listed by the plan set in level order, KV order within a level) are
// combined with the state operator (StateFold, as the merge kernel) into the output and LSE.
// A persistent loop over the jobs, whose count it reads from the plan set, so the grid is fixed
// and a captured graph replays for any plan. The loads are latency-bound (a shared level split
// over the prefill grid gives a row 16-35 states), so the jobs are shaped as the merge kernel's:
// few rows, a job per (row, head, 32 columns) and a column per lane, 32 states in flight; more
// such jobs than warps, a job per (row, head), D/32 columns per lane (16-byte loads at D 128),
// 64/(D/32) states in flight -- each warp folds its rows in fewer dependent rounds.
#pragma once
#include "ptx.cuh"
#include "state_fold.cuh"

namespace rtattn {

// Every job of `rows` query rows with W columns per lane (32 W per job), KU states per round trip.
template <typename T, bool SOFTMAX, int D, int W, int KU, class P>
__device__ __forceinline__ void fold_jobs(const P& p, int rows, int warp, int num_warps, int lane) {
  constexpr int JOBS = D / (32 * W);  // jobs per (row, head)
  static_assert(JOBS >= 1 && D % (32 * W) == 0, "a job covers whole 32-lane column groups");
  const int H = p.num_qo_heads;
  for (int job = warp; job < rows * H * JOBS; job += num_warps) {
    const int r = job / (H * JOBS), head = job / JOBS % H, d = job % JOBS * 32 * W + lane * W;
    const int first = p.fold_indptr[r], n = p.fold_indptr[r + 1] - first;
    wait_for_previous_grid();  // the states are the previous kernel's; returns at once after the first time
    StateFold<SOFTMAX, W> fold;
    for (int k0 = 0; k0 < n; k0 += KU) {
      float l[KU], v[KU][W];
#pragma unroll
      for (int k = 0; k < KU; ++k) {
        const bool ok = k0 + k < n;
        const int64_t srow = ok ? int64_t(p.fold_rows[first + k0 + k]) * H + head : 0;
        l[k] = ok ? __ldcg(p.state_lse + srow) : -INFINITY;
        if (ok) {
          load_cols<W, true>(v[k], p.state_o + srow * D + d);  // (another kernel's writes)
        } else {
#pragma unroll
          for (int j = 0; j < W; ++j) v[k][j] = 0.f;
        }
      }
      fold.round(l, v);
    }
    T* op = p.o + int64_t(r) * p.o_stride_tok + int64_t(head) * p.o_stride_head + d;
#pragma unroll
    for (int j = 0; j < W; ++j) op[j] = from_float<T>(fold.out(j));
    if (p.lse != nullptr && d == 0) p.lse[int64_t(r) * H + head] = fold.lse();
  }
}

template <typename T, bool SOFTMAX, int D, int NUM_WARPS, class P>
__device__ __forceinline__ void cascade_fold(const P& p) {
  constexpr int SLICES = D / 32;
  allow_next_grid();
  const int rows = p.fold_info[0];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * NUM_WARPS;
  if (rows * p.num_qo_heads * SLICES <= num_warps) {
    fold_jobs<T, SOFTMAX, D, 1, 32>(p, rows, warp, num_warps, lane);
  } else {
    fold_jobs<T, SOFTMAX, D, SLICES, 64 / SLICES>(p, rows, warp, num_warps, lane);
  }
}

}  // namespace rtattn
