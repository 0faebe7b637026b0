// Split-KV merge kernel, launched right after the decode kernel (PDL lets it start while the
// decode kernel drains) when the wrapper does not fuse the merge into the decode kernel. A job
// is one warp's share of a (merge row, query head): W columns per lane, so rows with few
// partials still occupy many warps; the partials are folded in the plan's fixed order
// (StateFold), KU at a time so their loads are in flight together. The grid is fixed (a
// persistent loop over jobs), so it is captured once and replayed for any plan.
#pragma once
#include "ptx.cuh"
#include "state_fold.cuh"

namespace rtattn {

// Batch-invariant: KU unnormalized partial states k0 .. k0 + KU - 1 of a merge entry (its rows
// start + j * step): (m, l) as a float2 per row at partial_lse, W columns of o at `col` of query
// head `head`; states past n are not read. CG: through L2 (the decode kernel's fused merge reads
// partials other CTAs just wrote).
template <int W, int KU, bool CG, class P>
__device__ __forceinline__ void load_states(const P& p, int start, int step, int n, int head, int col, int k0,
                                            float2 (&ml)[KU], float (&v)[KU][W]) {
  constexpr int D = P::head_dim;
  const int H = p.num_qo_heads;
  const float2* pml = reinterpret_cast<const float2*>(p.partial_lse);
#pragma unroll
  for (int kk = 0; kk < KU; ++kk) {
    const bool ok = k0 + kk < n;
    const int64_t prow = ok ? int64_t(start + (k0 + kk) * step) * H + head : 0;
    if constexpr (CG) {
      ml[kk] = ok ? __ldcg(pml + prow) : make_float2(-INFINITY, 0.f);
#pragma unroll
      for (int j = 0; j < W; ++j) v[kk][j] = ok ? __ldcg(p.partial_o + prow * D + col + j) : 0.f;
    } else {
      ml[kk] = ok ? pml[prow] : make_float2(-INFINITY, 0.f);
      if (ok) {
        load_cols<W>(v[kk], p.partial_o + prow * D + col);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) v[kk][j] = 0.f;
      }
    }
  }
}

// The batch-invariant merge of W columns at `col` of one (merge entry, head): the entry's n
// unnormalized partial states folded one at a time in plan (chunk) order (fold_weights, fold_acc)
// -- the sequence and the functions of the decode kernel's fold of an unsplit row's chunks, so a
// row's bits do not depend on where the plan split it. KU partials' loads in flight together;
// only the FMA chains are serial (the maxima and weights are computed ahead of them).
template <int W, int KU, bool CG, class P>
__device__ __forceinline__ void fold_partials(const P& p, int start, int step, int n, int head, int col,
                                              float (&o)[W], float& m, float& l) {
  m = -INFINITY, l = 0.f;
#pragma unroll
  for (int j = 0; j < W; ++j) o[j] = 0.f;
  for (int k0 = 0; k0 < n; k0 += KU) {
    float2 ml[KU];
    float v[KU][W];
    load_states<W, KU, CG>(p, start, step, n, head, col, k0, ml, v);
#pragma unroll
    for (int k = 0; k < KU; ++k) {  // branch-free (fold_partials_warp says why)
      // the first state as it is (as the kernel takes its first chunk's); states past n leave it
      const bool first = k == 0 && k0 == 0, live = k0 + k < n;
      const FoldWeights w = fold_weights(m, ml[k].x);
      const float l_fold = fold_acc(l, ml[k].y, w);
      m = first ? ml[k].x : live ? w.m : m;
      l = first ? ml[k].y : live ? l_fold : l;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float o_fold = fold_acc(o[j], v[k][j], w);
        o[j] = first ? v[k][j] : live ? o_fold : o[j];
      }
    }
  }
}

// The batch-invariant merge of one column (`col`, lane's own) of a (merge entry, head) by a whole
// warp (every lane the same entry): fold_partials' fold, one state at a time in plan order, with
// its loads spread: lane k loads state k0 + k's (m, l) and the round's (m, l) go to every lane by
// shuffles issued ahead of the fold (one float2 per lane a round, not KU), and the next round's KU
// states are loaded before this round is folded. The fold steps are branch-free (a state past n,
// or the first, selects): with a branch per step, each step's shuffles waited for the previous
// step's reconvergence (~90 cycles a state, by the SASS); b16-heavy-kv8's merge (its 40-state row)
// took 6.2 us to auto's 3.3 (H200, docs/perf-log.md "Batch-invariant v6"). The same operations per
// state, so the bits are fold_partials' (and the decode kernel's).
template <class P>
__device__ __forceinline__ void fold_partials_warp(const P& p, int start, int step, int n, int head, int col,
                                                   int lane, float& o, float& m, float& l) {
  constexpr int D = P::head_dim, KU = 16;  // (32: the shuffled (m, l) of a round spill at 128 registers)
  const int H = p.num_qo_heads;
  const float2* pml = reinterpret_cast<const float2*>(p.partial_lse);
  float2 ml_next;
  float v_next[KU];
  auto load_round = [&](int k0) {
    const int64_t own = lane < KU && k0 + lane < n ? int64_t(start + (k0 + lane) * step) * H + head : -1;
    ml_next = own >= 0 ? pml[own] : make_float2(-INFINITY, 0.f);
#pragma unroll
    for (int k = 0; k < KU; ++k)
      v_next[k] = k0 + k < n ? p.partial_o[(int64_t(start + (k0 + k) * step) * H + head) * D + col] : 0.f;
  };
  m = -INFINITY, l = 0.f, o = 0.f;
  if (n > 0) load_round(0);
  for (int k0 = 0; k0 < n; k0 += KU) {
    const float2 ml_cur = ml_next;
    float v[KU], mk[KU], lk[KU];
#pragma unroll
    for (int k = 0; k < KU; ++k) v[k] = v_next[k];
    if (k0 + KU < n) load_round(k0 + KU);  // in flight over this round's fold
#pragma unroll
    for (int k = 0; k < KU; ++k) {
      mk[k] = __shfl_sync(0xffffffff, ml_cur.x, k);
      lk[k] = __shfl_sync(0xffffffff, ml_cur.y, k);
    }
#pragma unroll
    for (int k = 0; k < KU; ++k) {
      // the first state as it is (as the kernel takes its first chunk's); states past n leave it
      const bool first = k == 0 && k0 == 0, live = k0 + k < n;
      const FoldWeights w = fold_weights(m, mk[k]);
      const float l_fold = fold_acc(l, lk[k], w), o_fold = fold_acc(o, v[k], w);
      m = first ? mk[k] : live ? w.m : m;
      l = first ? lk[k] : live ? l_fold : l;
      o = first ? v[k] : live ? o_fold : o;
    }
  }
}

// A merged batch-invariant row (m, l, o) -> W output columns at `col` of query row `q_row`, head
// `head` (and its LSE): the decode kernel's finish of a writethrough row, the same functions.
template <class Variant, class P, int W>
__device__ __forceinline__ void write_folded(const P& p, Variant& var, int q_row, int head, int col,
                                             const float (&o)[W], float m, float l) {
  using O = typename P::OType;
  const FinalState f = finish_state<Variant::use_softmax>(m, l, Variant::has_sink ? var.SinkLogit(p, head) : -INFINITY);
  O* op = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(head) * p.o_stride_head + col;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    float x = Variant::use_softmax ? __fmul_rn(o[j], f.scale) : o[j];
    if constexpr (Variant::has_output_transform) x = var.OutputTransform(p, x, head, col + j);
    op[j] = from_float<O>(x);
  }
  if (p.lse != nullptr && col == 0) p.lse[int64_t(q_row) * p.num_qo_heads + head] = f.lse;
}

// Every job of the plan's merge rows with W columns per lane (32 W per job), KU partials per
// round trip.
template <class Variant, class P, int W, int KU, bool INVARIANT>
__device__ __forceinline__ void merge_jobs(const P& p, int num_rows, int warp, int num_warps, int lane) {
  using O = typename P::OType;
  constexpr int D = P::head_dim, JOBS = D / (32 * W);  // jobs per (row, head)
  constexpr int KU_FEW = 16;  // batch-invariant, one column per lane: 32 spilled (v3)
  static_assert(JOBS >= 1 && D % (32 * W) == 0, "a job covers whole 32-lane column groups");
  const int H = p.num_qo_heads;
  Variant var;  // output transforms and sinks see only (params, head[, column])
  for (int job = warp; job < num_rows * H * JOBS; job += num_warps) {
    const int r = job / (H * JOBS), head = job / JOBS % H, d = job % JOBS * 32 * W + lane * W;
    const int first = p.plan.merge_indptr[r], n = p.plan.merge_indptr[r + 1] - first;
    const int start = p.plan.merge_partial_start[r], step = p.plan.merge_partial_stride[r];
    const int q_row = p.plan.merge_qo_row[r];
    wait_for_previous_grid();  // returns at once after the first time
    if constexpr (INVARIANT) {
      float o[W], m, l;
      // One column per lane: rows of up to 16 states as v3 (every lane loads them all, one round
      // trip), longer ones spread over the lanes with the next round in flight (fold_partials_warp).
      // The fold is the same sequence either way, so the bits are too.
      if constexpr (W == 1) {
        if (n > KU_FEW) fold_partials_warp(p, start, step, n, head, d, lane, o[0], m, l);
        else fold_partials<1, KU_FEW, false>(p, start, step, n, head, d, o, m, l);
      } else {
        fold_partials<W, KU, false>(p, start, step, n, head, d, o, m, l);
      }
      write_folded<Variant, P, W>(p, var, q_row, head, d, o, m, l);
      continue;
    }
    StateFold<Variant::use_softmax, W> fold;
    for (int k0 = 0; k0 < n; k0 += KU) {
      float l[KU], v[KU][W];
#pragma unroll
      for (int kk = 0; kk < KU; ++kk) {
        const bool ok = k0 + kk < n;
        const int64_t prow = ok ? int64_t(start + (k0 + kk) * step) * H + head : 0;
        l[kk] = ok ? p.partial_lse[prow] : -INFINITY;
        if (ok) {
          load_cols<W>(v[kk], p.partial_o + prow * D + d);
        } else {
#pragma unroll
          for (int j = 0; j < W; ++j) v[kk][j] = 0.f;
        }
      }
      fold.round(l, v);
    }
    if constexpr (Variant::has_sink) fold.add_sink(var.SinkLogit(p, head));  // once per row: here
    O* op = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(head) * p.o_stride_head + d;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      float x = fold.out(j);
      if constexpr (Variant::has_output_transform) x = var.OutputTransform(p, x, head, d + j);
      op[j] = from_float<O>(x);
    }
    if (p.lse != nullptr && d == 0) p.lse[int64_t(q_row) * H + head] = fold.lse();
  }
}

template <class Variant, class P, int NUM_WARPS, bool INVARIANT = false>  // INVARIANT: fold_partials
__device__ __forceinline__ void merge_persistent(const P& p) {
  constexpr int SLICES = P::head_dim / 32;
  // The plan is a host-to-device copy's output (complete before the previous kernel ran): its
  // fields are read before wait_for_previous_grid(); the partials only after it.
  allow_next_grid();  // a dependent kernel waits for this grid's completion anyway: launch it now
  const int num_rows = p.plan.plan_info[RTATTN_PLAN_INFO_NUM_MERGE_ROWS];
  const int warp = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * NUM_WARPS;
  // Few rows (long fan-ins, e.g. one 32K request): a job per 32 columns, one column per lane,
  // 32 partials in flight (1x32K: 33 partials in 2 round trips). More 32-column jobs than
  // warps: a job per (row, head), D/32 columns per lane, 32/(D/32) partials in flight, so each
  // warp folds its rows in fewer dependent rounds (64 x 2048 at g=16: 4 rounds -> 1).
  if (num_rows * p.num_qo_heads * SLICES <= num_warps) {
    // (batch-invariant: up to 16 states as v3, more through fold_partials_warp: 16 a round)
    merge_jobs<Variant, P, 1, 32, INVARIANT>(p, num_rows, warp, num_warps, lane);
  } else {
    merge_jobs<Variant, P, SLICES, 32 / SLICES, INVARIANT>(p, num_rows, warp, num_warps, lane);
  }
}

}  // namespace rtattn
