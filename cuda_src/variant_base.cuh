// The variant contract. A variant is a struct deriving from VariantBase that overrides only the
// hooks it needs and turns on the matching `has_*` flag; the kernels test the flags with
// `if constexpr`, so a variant pays for nothing it leaves out. One variant object is built per
// work item (init) and may cache per-request values (lengths, mask offsets, slopes).
//
// Index conventions, shared with the float64 reference (rtattn/plan/reference.py):
//   qo_idx  query token index inside its request, 0 .. qo_len-1
//   kv_idx  KV token index inside its request,    0 .. kv_len-1
//   q_pos   = kv_len - qo_len + qo_idx: the query's position in the sequence (causal frontier)
// Logits reach LogitsTransform already multiplied by sm_scale (natural-log units).
// Query/Key transforms see the element pair (d, d + D/2), which covers rotary embeddings
// (rotate-half form) and any elementwise map.
#pragma once
#include "types.cuh"

namespace rtattn {

struct VariantBase {
  static constexpr bool use_softmax = true;  // false: weights are sigmoid(logit), partials add up
  static constexpr bool has_query_transform = false;
  static constexpr bool has_key_transform = false;
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

}  // namespace rtattn
