// Folding attention states in a fixed order. StateFold (natural-log LSE, normalized O): what the
// merge kernel and the decode kernel's fused merge do to a split row's partials in auto mode. Each
// round takes KU states whose loads the caller issued together (one round trip per round), then
// folds them with the round's max, independent weights and sums in index order: the same plan
// gives the same bits. Batch-invariant mode folds unnormalized states (fold_weights, below).
#pragma once
#include "ptx.cuh"
#include "types.cuh"

namespace rtattn {

// *p, or with CG through L2 only (__ldcg: nothing stale from L1 where another CTA or kernel wrote it).
template <bool CG, class T>
__device__ __forceinline__ T load_global(const T* p) {
  if constexpr (CG) return __ldcg(p);
  else return *p;
}

// W consecutive floats of a state row at p (W = 1, 2, 4 or 8; p aligned to min(W, 4) floats), in
// the widest loads they allow: the columns a fold round takes of one state.
template <int W, bool CG = false>
__device__ __forceinline__ void load_cols(float (&v)[W], const float* p) {
  if constexpr (W == 1) {
    v[0] = load_global<CG>(p);
  } else if constexpr (W == 2) {
    const float2 x = load_global<CG>(reinterpret_cast<const float2*>(p));
    v[0] = x.x, v[1] = x.y;
  } else {
#pragma unroll
    for (int j = 0; j < W; j += 4) {
      const float4 x = load_global<CG>(reinterpret_cast<const float4*>(p + j));
      v[j] = x.x, v[j + 1] = x.y, v[j + 2] = x.z, v[j + 3] = x.w;
    }
  }
}

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

// Batch-invariant states are unnormalized: (m, l, o) = the reference max (log2 units; 0 for
// sigmoid), the weight sum and the weighted value sums against 2^m. A row's chunk states fold left
// to right -- in the decode kernel (a writethrough item's chunks) and in the merge (a split row's
// partial rows) -- through these functions only, every operation an explicitly rounded intrinsic,
// so the bits agree wherever they are inlined: per state, a max, two exp2 and one FMA per value.
// The maxima and weights do not depend on the sums: only the FMA chains are serial.
struct FoldWeights { float m, a, b; };  // the new max; the running state's factor, the new state's
__device__ __forceinline__ FoldWeights fold_weights(float m_run, float m) {
  const float m_new = fmaxf(m_run, m);
  const float base = m_new == -INFINITY ? 0.f : m_new;  // both empty: weights 0, no NaN
  return {m_new, fast_exp2(__fsub_rn(m_run, base)), fast_exp2(__fsub_rn(m, base))};
}
// run * a + x * b (sigmoid: m = 0 everywhere, a = b = 1: a plain sum)
__device__ __forceinline__ float fold_acc(float run, float x, const FoldWeights& w) {
  return __fmaf_rn(run, w.a, __fmul_rn(x, w.b));
}

// A row's final state (m, l): the factor its o takes and its natural-log LSE; an attention sink
// of natural-log weight `sink` (-inf: none) joins here, once. Softmax O = o / l, sigmoid O = o.
struct FinalState { float scale, lse; };
template <bool SOFTMAX>
__device__ __forceinline__ FinalState finish_state(float m, float l, float sink) {
  if constexpr (SOFTMAX) {
    const float sink2 = __fmul_rn(sink, 1.4426950408889634f);
    const float top_raw = fmaxf(l > 0.f ? m : -INFINITY, sink2);
    const float top = top_raw == -INFINITY ? 0.f : top_raw;   // nothing visible: no NaN
    const float s = l > 0.f ? fast_exp2(__fsub_rn(m, top)) : 0.f;
    const float total = __fmaf_rn(l, s, fast_exp2(__fsub_rn(sink2, top)));
    if (!(total > 0.f)) return {0.f, -INFINITY};
    return {__fmul_rn(s, __frcp_rn(total)), __fmul_rn(__fadd_rn(top, __log2f(total)), 0.6931471805599453f)};
  } else {
    return {1.f, l > 0.f ? __fmul_rn(__log2f(l), 0.6931471805599453f) : -INFINITY};
  }
}

}  // namespace rtattn
