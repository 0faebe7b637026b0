// One 16-row group of a prefill tile, on accumulators in the mma m16n8 C layout (thread holds
// rows lane/4 and lane/4 + 8, columns (lane%4)*2 + {0,1} of each 8-column chunk): the per-block
// logits (transform, mask, online softmax, P packing) and the epilogue. Shared by the prefill
// kernels: the mma.sync kernel (prefill.cuh) and the wgmma one (prefill_sm90.cuh), whose
// m64nN accumulators are, per warp, exactly N/8 such chunks.
#pragma once
#include "epilogue.cuh"
#include "online_softmax.cuh"
#include "ptx.cuh"

namespace rtattn {

template <bool B> struct BoolConst { static constexpr bool value = B; };

// The query index and head of the two rows (h = 0, 1) this thread holds in the 16-row group that
// starts at fused row `row0`. Padding rows borrow the last real row's indices so hooks never see
// a query outside the request.
__device__ __forceinline__ void group_row_ids(int (&idx)[2], int (&head)[2], int row0, int rows_valid, int heads,
                                              int qo_idx0, int first_qo_head, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = min(row0 + lane / 4 + 8 * h, rows_valid - 1);
    idx[h] = qo_idx0 + r / heads;
    head[h] = first_qo_head + r % heads;
  }
}

// Accumulators set to zero (an item's O, a block's S).
template <int C>
__device__ __forceinline__ void zero_accumulators(float (&a)[C][4]) {
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[c][e] = 0.f;
}

// The QK accumulators' start for one 16-row group: zero, or with a linear bias (ALiBi) the rows'
// bias in q.k units, slope / sm_scale * (kv_pos - origin), which the tensor cores then add to
// q.k: one FMA per logit (a column's offset is an immediate), no index math, and the max, mask
// and exponent stay as without a bias. Per thread, across blocks: each row's scaled slope and
// its first column's distance to the origin. A prefill kernel starts S with start() wherever
// its first k-step accumulates (an mma that zeroes its accumulators there would drop the bias).
template <class Variant, bool = Variant::has_linear_bias>
struct GroupBias {
  template <class P>
  __device__ __forceinline__ void init(const P&, const Variant&, const int (&)[2], const int (&)[2], int) {}
  template <int NT>
  __device__ __forceinline__ void start(float (&s)[NT][4], int) const { zero_accumulators(s); }
};
template <class Variant>
struct GroupBias<Variant, true> {
  float slope[2];  // slope / sm_scale
  int delta[2];    // this thread's first column (lane % 4) * 2 minus the row's origin

  template <class P>
  __device__ __forceinline__ void init(const P& p, const Variant& var, const int (&qo_idx)[2], const int (&qo_head)[2],
                                       int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const LinearBias b = var.LinearBiasOf(p, qo_idx[h], qo_head[h]);
      slope[h] = b.slope / p.sm_scale;
      delta[h] = (lane % 4) * 2 - b.origin;
    }
  }
  template <int NT>
  __device__ __forceinline__ void start(float (&s)[NT][4], int pos0) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float row = slope[h] * float(pos0 + delta[h]);
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) s[n][2 * h + c] = fmaf(slope[h], float(n * 8 + c), row);
    }
  }
};

// Logits s of KV tokens [pos0, pos0 + 8 NT) (q.k, plus the linear bias GroupBias started them
// at) -> soft cap / LogitsTransform -> mask (tokens at or past `hi` and the variant's
// LogitsMask, when MASKED), in place. A soft cap alone is tanh(s * sm_scale / cap), its outer
// cap * log2(e) logits_scale's factor: one multiply and one tanh per logit, two constants.
template <bool MASKED, class Variant, class P, int NT>
__device__ __forceinline__ void mask_logits(const P& p, Variant& var, float (&s)[NT][4], int pos0, int hi,
                                            const int (&qo_idx)[2], const int (&qo_head)[2], int kv_head, int lane) {
  constexpr bool kCap = Variant::has_soft_cap, kCode = Variant::has_logits_transform;
  float cap_in = 0.f, cap_out = 0.f;
  if constexpr (kCap) {
    const SoftCap c = var.SoftCapOf(p);
    cap_in = p.sm_scale * c.inv_cap;
    cap_out = c.cap;
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e / 2;
      const int kv_pos = pos0 + n * 8 + (lane % 4) * 2 + (e & 1);
      float x = s[n][e];
      if constexpr (kCap) x = tanh_approx(x * cap_in);
      if constexpr (kCode)  // natural-log units; else the scale joins the exponent's FMA
        x = var.LogitsTransform(p, kCap ? cap_out * x : x * p.sm_scale, qo_idx[h], kv_pos, qo_head[h], kv_head);
      if constexpr (MASKED) {
        bool keep = kv_pos < hi;
        if constexpr (Variant::has_logits_mask) keep = keep && var.LogitsMask(p, qo_idx[h], kv_pos, qo_head[h], kv_head);
        x = keep ? x : -INFINITY;
      }
      s[n][e] = x;
    }
}

// The factor taking mask_logits' output to log2 units in the softmax.
template <class Variant, class P>
__device__ __forceinline__ float logits_scale(const P& p, const Variant& var) {
  if constexpr (Variant::has_logits_transform) return kLog2e;
  if constexpr (Variant::has_soft_cap) return var.SoftCapOf(p).cap * kLog2e;
  return p.sm_scale_log2;
}

// Whether a 16-bit type's exponent range is fp32's (bf16; fp16 spans 30 octaves).
template <class T> struct WideExponent : BoolConst<false> {};
template <> struct WideExponent<__nv_bfloat16> : BoolConst<true> {};

// The softmax of a 16-row group. A soft cap alone bounds every scaled logit by logits_scale
// (tanh's range): with bf16 weights the group can weigh against RowSoftmax's fixed reference
// (BOUNDED, reset(logits_bound); the RTATTN_FIXED_SOFTMAX build) in place of a running max.
template <class Variant, class P, int NT, int DT, bool FMA_EXP2 = false, bool TC_SUM = false>
using GroupSoftmax = RowSoftmax<Variant::use_softmax, NT, DT, FMA_EXP2,
                                Variant::use_softmax && Variant::has_soft_cap && !Variant::has_logits_transform &&
                                    WideExponent<typename P::DType>::value,
                                TC_SUM>;
template <class Variant, class P>
__device__ __forceinline__ float logits_bound(const P& p, const Variant& var) {
  if constexpr (Variant::has_soft_cap && !Variant::has_logits_transform) return logits_scale(p, var);
  return INFINITY;
}

// Weights s -> P as mma A fragments (KS = NT / 2 k-steps of 16 tokens).
template <class T, int NT>
__device__ __forceinline__ void pack_p(const float (&s)[NT][4], uint32_t (&pa)[NT / 2][4]) {
#pragma unroll
  for (int j = 0; j < NT / 2; ++j) {
    pa[j][0] = pack2<T>(s[2 * j][0], s[2 * j][1]);
    pa[j][1] = pack2<T>(s[2 * j][2], s[2 * j][3]);
    pa[j][2] = pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]);
    pa[j][3] = pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3]);
  }
}

// One block of a 16-row group: mask_logits -> online softmax (O rescaled in place when the row max
// moves) -> P.
template <bool MASKED, class Variant, class P, class SM, int NT, int DT>
__device__ __forceinline__ void logits_to_p(const P& p, Variant& var, SM& sm, float (&s)[NT][4], float (&o)[DT][4],
                                            uint32_t (&pa)[NT / 2][4], int pos0, int hi, const int (&qo_idx)[2],
                                            const int (&qo_head)[2], int kv_head, int lane) {
  mask_logits<MASKED>(p, var, s, pos0, hi, qo_idx, qo_head, kv_head, lane);
  sm.update(s, o, logits_scale(p, var));
  pack_p<typename P::DType>(s, pa);
}

// Epilogue of a 16-row group starting at fused row `row0`: each row's quad sums its weights; rows
// past the item are not written. A sink joins a row's softmax once, where its state is final:
// here for writethrough rows, in the merge kernel for split ones.
template <class Variant, class P, class SM, int DT>
__device__ __forceinline__ void store_group(const P& p, const Variant& var, const SM& sm, const float (&o)[DT][4],
                                            int row0, int rows_valid, int heads, int first_qo_head, int q_row0,
                                            int partial_row, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l_total = sm.total(h);
    const int r = row0 + lane / 4 + 8 * h;
    if (r < rows_valid) {
      const int t = r / heads, qo_head = first_qo_head + r % heads;
      float norm = (Variant::use_softmax && l_total > 0.f) ? 1.f / l_total : 1.f;
      float lse = sm.lse(h, l_total);
      if constexpr (Variant::has_sink) {
        if (partial_row < 0) {
          const SinkJoin j = join_sink(sm.m[h], l_total, var.SinkLogit(p, qo_head) * kLog2e);
          norm = j.l > 0.f ? j.scale / j.l : 0.f;
          lse = j.l > 0.f ? (j.top + __log2f(j.l)) * kLn2 : -INFINITY;
        }
      }
      store_row(p, var, o, h, norm, lse, q_row0 + t, qo_head, partial_row < 0 ? -1 : partial_row + t, lane);
    }
  }
}

}  // namespace rtattn
