// Split-KV merge kernel, launched right after the decode kernel (PDL lets it start while the
// decode kernel drains) when the wrapper does not fuse the merge into the decode kernel. One
// warp per (merge row, query head, 32 columns), a column per lane, so rows with few partials
// still occupy many warps; the partials are folded in the plan's fixed order (StateFold), KU at
// a time so their loads are in flight together. The grid is fixed (a persistent loop over
// jobs), so it is captured once and replayed for any plan.
#pragma once
#include "ptx.cuh"
#include "state_fold.cuh"

namespace rtattn {

template <class Variant, class P, int NUM_WARPS>
__device__ __forceinline__ void merge_persistent(const P& p) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  constexpr int SLICES = D / 32;  // a job is (merge row, head, 32 columns): one per lane
  // Partials whose loads are in flight together: one round trip for fan-ins up to 32 (a single
  // long request split over every CTA of its head: 16 took 3 dependent rounds at 1x32K, 2 now).
  constexpr int KU = 32;
  // The plan is a host-to-device copy's output (complete before the previous kernel ran): its
  // fields are read before wait_for_previous_grid(); the partials only after it.
  allow_next_grid();  // a dependent kernel waits for this grid's completion anyway: launch it now
  const int num_rows = p.plan.plan_info[RTATTN_PLAN_INFO_NUM_MERGE_ROWS];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = p.num_qo_heads;
  Variant var;  // output transforms see only (params, value, head, d)
  for (int job = warp;; job += gridDim.x * NUM_WARPS) {
    const int r = job / (H * SLICES), head = job / SLICES % H, d = job % SLICES * 32 + lane;
    // The entry's fields are read before the row count arrives (one round trip, not two); the
    // index is clamped to the plan's capacity so the early read stays inside the plan.
    const int rc = min(r, p.merge_row_capacity - 1);
    const int first = p.plan.merge_indptr[rc], last = p.plan.merge_indptr[rc + 1];
    const int start = p.plan.merge_partial_start[rc], step = p.plan.merge_partial_stride[rc];
    const int q_row = p.plan.merge_qo_row[rc];
    if (r >= num_rows) break;
    wait_for_previous_grid();  // returns at once after the first time
    const int n = last - first;
    StateFold<Variant::use_softmax, 1> fold;
    for (int k0 = 0; k0 < n; k0 += KU) {
      float l[KU], v[KU][1];
#pragma unroll
      for (int kk = 0; kk < KU; ++kk) {
        const bool ok = k0 + kk < n;
        const int64_t prow = ok ? int64_t(start + (k0 + kk) * step) * H + head : 0;
        l[kk] = ok ? p.partial_lse[prow] : -INFINITY;
        v[kk][0] = ok ? p.partial_o[prow * D + d] : 0.f;
      }
      fold.round(l, v);
    }
    if constexpr (Variant::has_sink) fold.add_sink(var.SinkLogit(p, head));  // once per row: here
    float x = fold.out(0);
    if constexpr (Variant::has_output_transform) x = var.OutputTransform(p, x, head, d);
    p.o[int64_t(q_row) * p.o_stride_tok + int64_t(head) * p.o_stride_head + d] = from_float<T>(x);
    if (p.lse != nullptr && d == 0) p.lse[int64_t(q_row) * H + head] = fold.lse();
  }
}

}  // namespace rtattn
