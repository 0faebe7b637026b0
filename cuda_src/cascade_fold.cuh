// The cascade fold: each query row's attention states over every level (float32 state rows the
// levels' work items wrote, listed by the plan set in level order, KV order within a level) are
// combined with the state operator (StateFold, as the merge kernel) into the output and LSE.
// A persistent loop over the jobs, whose count it reads from the plan set, so the grid is fixed
// and a captured graph replays for any plan. The loads are latency-bound (a shared level split
// over the prefill grid gives a row 16-35 states), so the jobs are shaped as the merge kernel's:
// few rows, a job per (row, head, 32 columns) and a column per lane, 32 states in flight; more
// such jobs than warps, a job per (row, head), D/32 columns per lane (16-byte loads at D 128),
// 64/(D/32) states in flight -- each warp folds its rows in fewer dependent rounds; many rows of
// few states each (a short prefix over many requests: 2-5), 2 or 4 such jobs per warp at once.
#pragma once
#include "ptx.cuh"
#include "state_fold.cuh"

namespace rtattn {

// Every job of `rows` query rows with W columns per lane (32 W per job), J jobs per warp at a time
// and KU states of each per round trip: J > 1 where rows have few states, so that the loads of
// J jobs share one round trip instead of taking one each.
template <typename T, bool SOFTMAX, int D, int W, int J, int KU, class P>
__device__ __forceinline__ void fold_jobs(const P& p, int rows, int warp, int num_warps, int lane) {
  constexpr int JOBS = D / (32 * W);  // jobs per (row, head)
  static_assert(JOBS >= 1 && D % (32 * W) == 0, "a job covers whole 32-lane column groups");
  const int H = p.num_qo_heads, total = rows * H * JOBS;
  for (int job0 = warp * J; job0 < total; job0 += num_warps * J) {
    int head[J], col[J], first[J], n[J], n_max = 0;  // col: the job's first column in a state row of H heads
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int job = min(job0 + j, total - 1), r = job / (H * JOBS);  // (a past-the-end job repeats the last, unwritten)
      head[j] = job / JOBS % H, col[j] = head[j] * D + job % JOBS * 32 * W + lane * W;
      first[j] = p.fold_indptr[r], n[j] = p.fold_indptr[r + 1] - first[j];
      n_max = max(n_max, n[j]);
    }
    wait_for_previous_grid();  // the states are the previous kernel's; returns at once after the first time
    StateFold<SOFTMAX, W> fold[J];
    for (int k0 = 0; k0 < n_max; k0 += KU) {
      float l[J][KU], v[J][KU][W];
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int k = 0; k < KU; ++k) {
          const bool ok = k0 + k < n[j];
          const int64_t srow = ok ? int64_t(p.fold_rows[first[j] + k0 + k]) * H : 0;
          l[j][k] = ok ? __ldcg(p.state_lse + srow + head[j]) : -INFINITY;
          if (ok) {
            load_cols<W, true>(v[j][k], p.state_o + srow * D + col[j]);  // (another kernel's writes)
          } else {
#pragma unroll
            for (int c = 0; c < W; ++c) v[j][k][c] = 0.f;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < J; ++j) fold[j].round(l[j], v[j]);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (job0 + j >= total) break;
      const int r = (job0 + j) / (H * JOBS), d = col[j] - head[j] * D;
      T* op = p.o + int64_t(r) * p.o_stride_tok + int64_t(head[j]) * p.o_stride_head + d;
#pragma unroll
      for (int c = 0; c < W; ++c) op[c] = from_float<T>(fold[j].out(c));
      if (p.lse != nullptr && d == 0) p.lse[int64_t(r) * H + head[j]] = fold[j].lse();
    }
  }
}

// Few jobs (at most a warp each): a job per (row, head, 32 columns), 32 states per round. More:
// a job per (row, head) with W = D/32 columns per lane and KU = 64/W states per round (KU (W + 1)
// floats of loads); where the rows' states (the plan's mean, rounded up) fit fewer slots and there
// are jobs enough, J = 2 or 4 jobs per warp in the same registers (J fold states of W + 2 floats).
// RTATTN_DEV_FOLD_MAX_J: an A/B (1 = one job per warp).
#ifndef RTATTN_DEV_FOLD_MAX_J
#define RTATTN_DEV_FOLD_MAX_J 4
#endif
template <int W, int J>
__host__ __device__ constexpr int fold_slots() {  // states per job and round at J jobs a warp
  return (64 / W * (W + 1) - (J - 1) * (W + 2)) / (J * (W + 1));
}

template <typename T, bool SOFTMAX, int D, int NUM_WARPS, class P>
__device__ __forceinline__ void cascade_fold(const P& p) {
  constexpr int W = D / 32, KU = fold_slots<W, 1>(), KU2 = fold_slots<W, 2>(), KU4 = fold_slots<W, 4>();
  allow_next_grid();
  const int rows = p.fold_info[0], state_rows = p.fold_info[1];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * NUM_WARPS;
  const int jobs = rows * p.num_qo_heads, states = rows ? (state_rows + rows - 1) / rows : 0;
  if (jobs * W <= num_warps) {
    fold_jobs<T, SOFTMAX, D, 1, 1, 32>(p, rows, warp, num_warps, lane);
  } else if (RTATTN_DEV_FOLD_MAX_J >= 4 && KU4 >= 2 && jobs > 3 * num_warps && states <= KU4) {
    fold_jobs<T, SOFTMAX, D, W, 4, KU4>(p, rows, warp, num_warps, lane);
  } else if (RTATTN_DEV_FOLD_MAX_J >= 2 && KU2 >= 2 && jobs > num_warps && states <= KU2) {
    fold_jobs<T, SOFTMAX, D, W, 2, KU2>(p, rows, warp, num_warps, lane);
  } else {
    fold_jobs<T, SOFTMAX, D, W, 1, KU>(p, rows, warp, num_warps, lane);
  }
}

}  // namespace rtattn
