// Folding attention states (natural-log LSE, O) in a fixed order: what the merge kernel and the
// decode kernel's fused merge both do to a split row's partials. Each round takes KU states whose
// loads the caller issued together (one round trip per round), then folds them with the round's
// max, independent weights and sums in index order: the same plan gives the same bits.
#pragma once
#include "ptx.cuh"
#include "types.cuh"

namespace rtattn {

template <bool SOFTMAX, int W>  // W columns per state
struct StateFold {
  float m = -INFINITY, w_sum = 0.f, acc[W] = {};

  template <int KU>
  __device__ __forceinline__ void round(const float (&l)[KU], const float (&v)[KU][W]) {
    float m_new = m;
#pragma unroll
    for (int k = 0; k < KU; ++k) m_new = fmaxf(m_new, l[k]);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float scale = __expf(m - base);
    float w_round = 0.f, o_round[W] = {};
#pragma unroll
    for (int k = 0; k < KU; ++k) {
      const float w = __expf(l[k] - base);  // 0 for padding states (l = -inf)
      w_round += w;
#pragma unroll
      for (int j = 0; j < W; ++j) o_round[j] += SOFTMAX ? w * v[k][j] : v[k][j];
    }
    w_sum = w_sum * scale + w_round;
#pragma unroll
    for (int j = 0; j < W; ++j) acc[j] = SOFTMAX ? acc[j] * scale + o_round[j] : acc[j] + o_round[j];
    m = m_new;
  }
  // Folds in the state of the lane `mask` away (a butterfly step: every lane of the group ends
  // with the group's fold; the order is fixed, so the bits are too).
  __device__ __forceinline__ void fold_lanes(int mask) {
    const float m_o = __shfl_xor_sync(0xffffffff, m, mask), w_o = __shfl_xor_sync(0xffffffff, w_sum, mask);
    const float m_new = fmaxf(m, m_o), base = m_new == -INFINITY ? 0.f : m_new;
    const float s = __expf(m - base), s_o = __expf(m_o - base);
    w_sum = w_sum * s + w_o * s_o;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float a_o = __shfl_xor_sync(0xffffffff, acc[j], mask);
      acc[j] = SOFTMAX ? acc[j] * s + a_o * s_o : acc[j] + a_o;
    }
    m = m_new;
  }
  // Folds in a state of log-weight `lse_sink` and no value: an attention sink (softmax only).
  __device__ __forceinline__ void add_sink(float lse_sink) {
    const float m_new = fmaxf(m, lse_sink), base = m_new == -INFINITY ? 0.f : m_new;
    const float s = __expf(m - base);
    w_sum = w_sum * s + __expf(lse_sink - base);
#pragma unroll
    for (int j = 0; j < W; ++j) acc[j] *= s;
    m = m_new;
  }
  // Softmax O is normalized by the total weight; sigmoid O is a plain sum.
  __device__ __forceinline__ float out(int j) const {
    return acc[j] * ((SOFTMAX && w_sum > 0.f) ? 1.f / w_sum : 1.f);
  }
  __device__ __forceinline__ float lse() const {
    return w_sum > 0.f ? (m == -INFINITY ? 0.f : m) + __logf(w_sum) : -INFINITY;
  }
};

// The batch-invariant ⊕ of two normalized states (O, natural-log LSE; sigmoid: plain sums):
// (o, lse) <- (o, lse) ⊕ (o_b, lse_b). Every operation is an explicitly rounded intrinsic, so
// the decode kernel's in-item fold of chunk states and the merge's fold of the same states
// (partial rows) give the same bits wherever they are inlined: no contraction differs.
template <bool SOFTMAX, int W>
__device__ __forceinline__ void fold_state(float (&o)[W], float& lse, const float (&o_b)[W], float lse_b) {
  const float m = fmaxf(lse, lse_b);
  if (m == -INFINITY) return;  // both empty: (0, -inf) stays
  const float wa = fast_exp2(__fmul_rn(__fsub_rn(lse, m), 1.4426950408889634f));  // 0 for lse = -inf
  const float wb = fast_exp2(__fmul_rn(__fsub_rn(lse_b, m), 1.4426950408889634f));
  const float den = __fadd_rn(wa, wb);
  if constexpr (SOFTMAX) {
    const float inv = __frcp_rn(den);
#pragma unroll
    for (int j = 0; j < W; ++j) o[j] = __fmul_rn(__fadd_rn(__fmul_rn(wa, o[j]), __fmul_rn(wb, o_b[j])), inv);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) o[j] = __fadd_rn(o[j], o_b[j]);
  }
  lse = __fadd_rn(m, __fmul_rn(__log2f(den), 0.6931471805599453f));
}

// A sink of log-weight `sink` (natural log) and no value joins a final state: ⊕ with (0, sink).
template <int W>
__device__ __forceinline__ void fold_sink(float (&o)[W], float& lse, float sink) {
  float zero[W];
#pragma unroll
  for (int j = 0; j < W; ++j) zero[j] = 0.f;
  fold_state<true, W>(o, lse, zero, sink);
}

}  // namespace rtattn
