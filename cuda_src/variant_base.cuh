// The variant contract. A variant is a struct deriving from VariantBase that overrides only the
// hooks it needs and turns on the matching `has_*` flag; the kernels test the flags with
// `if constexpr`, so a variant pays for nothing it leaves out. One variant object is built per
// work item (init) and may cache per-request values (lengths, mask offsets, slopes).
//
// Index conventions, shared with the float64 reference (rtattn/plan/reference.py):
//   qo_idx  query token index inside its request, 0 .. qo_len-1
//   kv_idx  KV token index inside its request,    0 .. kv_len-1
//   q_pos   = kv_len - qo_len + qo_idx: the query's position in the sequence (causal frontier)
// A logit's transforms, in this order, on sm_scale * q.k (natural-log units): the linear bias,
// the soft cap, then LogitsTransform (transform_logit below is the whole chain). The first two
// are declared as data (has_linear_bias, has_soft_cap, their parameters from hooks) so that a
// tiled kernel folds them into its own arithmetic: the prefill kernels start the QK accumulators
// at the bias and put the caps into the constants around one tanh; LogitsTransform is code
// they call per logit, as it is.
// Query/Key transforms see the element pair (d, d + D/2), which covers rotary embeddings
// (rotate-half form) and any elementwise map.
#pragma once
#include "types.cuh"

namespace rtattn {

// tanh in one MUFU instruction (sm_75+): absolute error <= ~5e-4 (2^-10.99 relative), below
// the bf16 rounding of the softmax weights it feeds; tests check soft-cap against float64.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A query row's linear bias (ALiBi): key kv_idx adds slope * (kv_idx - origin) to its logit.
struct LinearBias {
  float slope;
  int origin;
};
// A soft cap: logit -> cap * tanh(logit * inv_cap), cap > 0.
struct SoftCap {
  float cap, inv_cap;
};

struct VariantBase {
  static constexpr bool use_softmax = true;  // false: weights are sigmoid(logit), partials add up
  static constexpr bool has_query_transform = false;
  static constexpr bool has_key_transform = false;
  static constexpr bool has_linear_bias = false;  // LinearBiasOf(p, qo_idx, qo_head)
  static constexpr bool has_soft_cap = false;     // SoftCapOf(p)
  static constexpr bool has_logits_transform = false;
  static constexpr bool has_logits_mask = false;
  static constexpr bool has_output_transform = false;
  // An attention sink: SinkLogit(p, qo_head) (natural-log units, like the logits) joins every
  // row's softmax denominator with no value; folded once per row, where its state is final.
  static constexpr bool has_sink = false;

  int batch_idx, qo_len, kv_len;

  template <class P>
  __device__ __forceinline__ void init(const P&, int batch, int qo_length, int kv_length) {
    batch_idx = batch;
    qo_len = qo_length;
    kv_len = kv_length;
  }
  __device__ __forceinline__ int q_pos(int qo_idx) const { return kv_len - qo_len + qo_idx; }

  template <class P>
  __device__ __forceinline__ void QueryTransform(const P&, float&, float&, int, int, int) const {}
  template <class P>
  __device__ __forceinline__ void KeyTransform(const P&, float&, float&, int, int, int) const {}
  template <class P>
  __device__ __forceinline__ LinearBias LinearBiasOf(const P&, int qo_idx, int) const { return {0.f, q_pos(qo_idx)}; }
  template <class P>
  __device__ __forceinline__ SoftCap SoftCapOf(const P&) const { return {1.f, 1.f}; }
  template <class P>
  __device__ __forceinline__ float LogitsTransform(const P&, float logit, int, int, int, int) const {
    return logit;
  }
  template <class P>
  __device__ __forceinline__ bool LogitsMask(const P&, int, int, int, int) const { return true; }
  template <class P>
  __device__ __forceinline__ float OutputTransform(const P&, float o, int, int) const { return o; }
  template <class P>
  __device__ __forceinline__ float SinkLogit(const P&, int) const { return -INFINITY; }

  // Block skipping (tiled kernels): clip [lo, hi) to the KV positions some query at positions
  // [q_lo, q_hi] can see -- blocks outside are never loaded; and say whether every query in
  // [q_lo, q_hi] sees every key in [k0, k1) -- such a block skips LogitsMask. A variant whose
  // mask has no such structure keeps the defaults (all KV, mask every block).
  template <class P>
  __device__ __forceinline__ void VisibleKV(const P&, int, int, int&, int&) const {}
  template <class P>
  __device__ __forceinline__ bool BlockUnmasked(const P&, int, int, int, int) const { return false; }
};

// Whether a variant changes logits at all (kernels that fold nothing test this one flag). A
// function: constexpr variables, like the flags above, are emitted as device globals.
template <class V>
__device__ constexpr bool transforms_logits() {
  return V::has_linear_bias || V::has_soft_cap || V::has_logits_transform;
}

// The whole chain on one natural-log logit, for kernels that fold none of it (decode).
template <class V, class P>
__device__ __forceinline__ float transform_logit(const V& var, const P& p, float s, int qo_idx, int kv_idx,
                                                 int qo_head, int kv_head) {
  if constexpr (V::has_linear_bias) {
    const LinearBias b = var.LinearBiasOf(p, qo_idx, qo_head);
    s += b.slope * float(kv_idx - b.origin);
  }
  if constexpr (V::has_soft_cap) {
    const SoftCap c = var.SoftCapOf(p);
    s = c.cap * tanh_approx(s * c.inv_cap);
  }
  if constexpr (V::has_logits_transform) s = var.LogitsTransform(p, s, qo_idx, kv_idx, qo_head, kv_head);
  return s;
}

}  // namespace rtattn
