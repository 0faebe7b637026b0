// Online softmax over one thread's rows of an mma.sync m16n8 accumulator tile (the prefill
// kernel's per-warp state; decode's per-warp loop is the same arithmetic and can adopt it).
// A thread holds rows lane/4 (h = 0) and lane/4 + 8 (h = 1) of a 16-row tile; the 4 lanes of a
// quad hold the row's columns. Logits arrive in log2 units with masked entries at -inf; the
// state keeps the running max m (log2) and the running weight sum l of this thread's columns
// (the quad's sums are added once, at the end). SOFTMAX = false (FlashSigmoid): weights are
// sigmoid(logit), nothing is rescaled, O and l are plain sums.
#pragma once
#include "ptx.cuh"

namespace rtattn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A row's final log2-unit state (max m, total weight l) joined with an attention sink of log2
// weight `sink` (a state with no value): the new max `top` (0 when nothing is visible), the factor
// `scale` the row's O takes, and the new total weight l.
struct SinkJoin { float top, scale, l; };
__device__ __forceinline__ SinkJoin join_sink(float m, float l, float sink) {
  float top = fmaxf(l > 0.f ? m : -INFINITY, sink);
  top = top == -INFINITY ? 0.f : top;
  const float scale = l > 0.f ? fast_exp2(m - top) : 0.f;
  return {top, scale, l * scale + fast_exp2(sink - top)};
}

// 2^x on the FMA and integer pipes, not the MUFU (which a soft-capped logit's tanh also takes):
// x = j + f by the 1.5 * 2^23 shifter's round to nearest, 2^f (f in [-1/2, 1/2]) by a degree-3
// polynomial (relative error 1.5e-4, under a 16-bit P's rounding), j added to its exponent; 0
// below -126 (masked logits, -inf). About 9 instructions where ex2 is one on a 16-lane pipe.
__device__ __forceinline__ float fma_exp2(float x) {
  constexpr float kShifter = 12582912.f;  // 1.5 * 2^23: x + it holds round(x) in its low mantissa
  const float t = __fadd_rn(x, kShifter);
  const float f = __fadd_rn(x, -__fadd_rn(t, -kShifter));
  const float p = fmaf(fmaf(fmaf(0.0551738553f, f, 0.242609471f), f, 0.693260431f), f, 0.999928176f);
  const float r = __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
  return x < -126.f ? 0.f : r;
}

// Opt-in builds of the prefill softmax, built and checked for spills but not yet measured on a
// GPU (tools/gpu_softmax_ab.sh A/Bs them; docs/perf-log.md "Session 17"): RTATTN_FIXED_SOFTMAX
// (BOUNDED below), RTATTN_TC_ROWSUM (TC_SUM, wgmma.cuh's kTcRowSum), RTATTN_TREE_SOFTMAX (kTreeRows).
#ifdef RTATTN_TREE_SOFTMAX
constexpr bool kTreeRows = true;
#else
constexpr bool kTreeRows = false;
#endif

// NT n-tiles of logits, DT n-tiles (8 columns) of O. FMA_EXP2: the weights of every other n-tile
// by fma_exp2, halving the MUFU's share of the softmax (an A/B path: PrefillTile.fma_exp2).
// BOUNDED: every scaled logit lies in [-bound, bound] (reset's argument: a soft cap's cap * log2 e)
// and the weights are bf16, whose exponent range is fp32's. Weighed against the fixed reference
// bound - kFixedHeadroom, every weight is a normal float in [2^(kFixedHeadroom - 2 bound),
// 2^kFixedHeadroom] while bound <= kMaxFixedBound, and sums stay far from overflow (2^81 at 128K
// tokens): no row max, no shuffles, no rescale of O -- the instructions a soft cap's tanh adds back.
// Larger bounds (and fp16 weights: 30 octaves) keep the running max.
// TC_SUM (the wgmma kernels): the rows' weight totals are the tensor cores' (wgmma_rowsum into
// lacc, beside PV), not this thread's sums: weigh() adds nothing, rescale() scales lacc with O.
template <bool SOFTMAX, int NT, int DT, bool FMA_EXP2 = false, bool BOUNDED = false, bool TC_SUM = false>
struct RowSoftmax {
  static constexpr float kFixedHeadroom = 64.f, kMaxFixedBound = (126.f + kFixedHeadroom) / 2.f;
  static constexpr bool tc_sum = TC_SUM && SOFTMAX;
  float m[2], l[2];
  float lacc[1][4];  // (tc_sum) rows lane/4 and lane/4 + 8: [0] / [1] and [2] / [3], all the row's total
  bool fixed;  // (BOUNDED) m is the fixed reference: weigh() skips the max and rescale() has nothing to do

  __device__ __forceinline__ void reset(float bound = INFINITY) {
#ifdef RTATTN_FIXED_SOFTMAX
    fixed = BOUNDED && bound <= kMaxFixedBound;
#else
    fixed = false;   // (the default build: the running max)
#endif
    m[0] = m[1] = fixed ? bound - kFixedHeadroom : -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) lacc[0][e] = 0.f;
  }
  // Logits s (times `scale`: they reach the exponent as one fused multiply-add) -> weights, in
  // place; O rows rescaled to the new max. scale > 0 (log2 units after scaling).
  // The max a row's weights are taken against moves only when the block's max exceeds it by more
  // than kRescaleSlack (log2 units): weights then stay below 2^kRescaleSlack (exact in fp32 sums,
  // bf16/fp16 P keeps its relative precision) and O is rescaled only when some row of the warp
  // moved -- after a row's first blocks, almost never. m is the reference max, not the true max;
  // l, O and the LSE (m + log2 l) are consistent with it.
  static constexpr float kRescaleSlack = 8.f;
  __device__ __forceinline__ void update(float (&s)[NT][4], float (&o)[DT][4], float scale) {
    float corr[2];
    weigh(s, scale, corr);
    rescale(o, corr);
  }
  // update() in two parts, for a kernel whose O is still being accumulated (an asynchronous
  // product in flight) while the next block's logits are weighed: weigh() leaves each row's
  // factor for O in corr, rescale() applies it once O may be touched.
  __device__ __forceinline__ void weigh(float (&s)[NT][4], float scale, float (&corr)[2]) {
    if constexpr (SOFTMAX) {
      if (BOUNDED && fixed) {
        corr[0] = corr[1] = 1.f;
        const float sum0 = exponentiate(s, scale, m[0], 0), sum1 = exponentiate(s, scale, m[1], 1);
        if constexpr (!tc_sum) {
          l[0] += sum0;
          l[1] += sum1;
        }
        return;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max(s, h);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_blk = mx * scale;
        const bool move = m_blk > m[h] + kRescaleSlack;  // false while both are -inf
        const float m_new = move ? m_blk : m[h];
        const float base = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: no NaN
        corr[h] = move ? fast_exp2(m[h] - base) : 1.f;
        m[h] = m_new;
        const float sum = exponentiate(s, scale, base, h);
        if constexpr (!tc_sum) l[h] = l[h] * corr[h] + sum;
      }
    } else {
      corr[0] = corr[1] = 1.f;
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[n][e] * scale;  // log2 units: sigmoid(x ln2) = 1 / (1 + 2^-x)
          s[n][e] = x == -INFINITY ? 0.f : 1.f / (1.f + fast_exp2(-x));
          l[e / 2] += s[n][e];
        }
    }
  }
  // Row h's max over this thread's columns; its logits -> weights 2^(s * scale - base), in place,
  // and their sum.
  __device__ __forceinline__ static float row_max(const float (&s)[NT][4], int h) {
    float t[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) t[n] = fmaxf(s[n][2 * h], s[n][2 * h + 1]);
    return fold(t, -INFINITY, [](float x, float y) { return fmaxf(x, y); });
  }
  __device__ __forceinline__ static float exponentiate(float (&s)[NT][4], float scale, float base, int h) {
    float t[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      if (FMA_EXP2 && n % 2 == 1) {
        s[n][2 * h] = fma_exp2(fmaf(s[n][2 * h], scale, -base));
        s[n][2 * h + 1] = fma_exp2(fmaf(s[n][2 * h + 1], scale, -base));
      } else {
        s[n][2 * h] = fast_exp2(fmaf(s[n][2 * h], scale, -base));
        s[n][2 * h + 1] = fast_exp2(fmaf(s[n][2 * h + 1], scale, -base));
      }
      t[n] = s[n][2 * h] + s[n][2 * h + 1];
    }
    return fold(t, 0.f, [](float x, float y) { return x + y; });
  }
  // x0 op t[0] op t[1] op ... in order (a chain of NT), or with kTreeRows as a tree (depth log2 NT:
  // the exponentials wait for the max).
  template <class Op>
  __device__ __forceinline__ static float fold(float (&t)[NT], float x0, Op op) {
    if constexpr (kTreeRows) {
#pragma unroll
      for (int w = NT / 2; w >= 1; w /= 2)
#pragma unroll
        for (int n = 0; n < w; ++n) t[n] = op(t[n], t[n + w]);
      return t[0];
    }
    float x = x0;
#pragma unroll
    for (int n = 0; n < NT; ++n) x = op(x, t[n]);
    return x;
  }
  __device__ __forceinline__ void rescale(float (&o)[DT][4], const float (&corr)[2]) {
    if (BOUNDED && fixed) return;
    // A warp-uniform branch: no row of the warp moved, no multiply.
    if (SOFTMAX && __any_sync(0xffffffff, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int dn = 0; dn < DT; ++dn) {
        o[dn][0] *= corr[0];
        o[dn][1] *= corr[0];
        o[dn][2] *= corr[1];
        o[dn][3] *= corr[1];
      }
      if constexpr (tc_sum) {
        lacc[0][0] *= corr[0];
        lacc[0][1] *= corr[0];
        lacc[0][2] *= corr[1];
        lacc[0][3] *= corr[1];
      }
    }
  }
  // Pins the tensor cores' row sums around an asynchronous product, as fence_accumulators(o).
  __device__ __forceinline__ void fence_sums() {
    if constexpr (tc_sum) fence_accumulators(lacc);
  }
  // The quad's total weight of row h (every lane of the quad gets it).
  __device__ __forceinline__ float total(int h) const {
    if constexpr (tc_sum) return lacc[0][2 * h];
    float x = l[h];
    x += __shfl_xor_sync(0xffffffff, x, 1);
    x += __shfl_xor_sync(0xffffffff, x, 2);
    return x;
  }
  // Natural-log LSE of a row from its total weight (m: the running max or the fixed reference).
  __device__ __forceinline__ float lse(int h, float l_total) const {
    const float base = (!SOFTMAX || m[h] == -INFINITY) ? 0.f : m[h];
    return l_total > 0.f ? (base + __log2f(l_total)) * kLn2 : -INFINITY;
  }
};

}  // namespace rtattn
