// Built-in variants. Each reads its parameters from `p.extra.<name>` (the spec in codegen/spec.py
// declares them, so the generated VariantParams struct has exactly these members).
#pragma once
#include "variant_base.cuh"

namespace rtattn {

// Softmax attention with optional causal mask, sliding window (p.extra.window_left), logits
// soft-cap (p.extra.soft_cap), ALiBi (p.extra.alibi_slopes[qo_head]) and attention sinks
// (p.extra.sinks[qo_head]). The flags are template parameters so each combination compiles to
// its own straight-line code.
template <bool CAUSAL, bool WINDOW, bool SOFTCAP, bool ALIBI, bool SINKS = false>
struct StandardAttention : VariantBase {
  static constexpr bool has_linear_bias = ALIBI;
  static constexpr bool has_soft_cap = SOFTCAP;
  static constexpr bool has_logits_mask = CAUSAL || WINDOW;
  static constexpr bool has_sink = SINKS;
  float inv_cap;  // 1 / soft_cap, once per item rather than a division per logit

  template <class P>
  __device__ __forceinline__ void init(const P& p, int batch, int qo_length, int kv_length) {
    VariantBase::init(p, batch, qo_length, kv_length);
    if constexpr (SOFTCAP) inv_cap = 1.f / p.extra.soft_cap;
  }
  template <class P>
  __device__ __forceinline__ LinearBias LinearBiasOf(const P& p, int qo_idx, int qo_head) const {
    return {p.extra.alibi_slopes[qo_head], q_pos(qo_idx)};  // ALiBi: slope * (kv_idx - q_pos)
  }
  template <class P>
  __device__ __forceinline__ SoftCap SoftCapOf(const P& p) const { return {p.extra.soft_cap, inv_cap}; }
  template <class P>
  __device__ __forceinline__ float SinkLogit(const P& p, int qo_head) const {
    if constexpr (SINKS) return p.extra.sinks[qo_head];
    return -INFINITY;
  }
  template <class P>
  __device__ __forceinline__ bool LogitsMask(const P& p, int qo_idx, int kv_idx, int, int) const {
    bool keep = true;
    if constexpr (CAUSAL) keep = kv_idx <= q_pos(qo_idx);
    if constexpr (WINDOW) keep = keep && kv_idx >= q_pos(qo_idx) - p.extra.window_left;
    return keep;
  }
  template <class P>
  __device__ __forceinline__ void VisibleKV(const P& p, int q_lo, int q_hi, int& lo, int& hi) const {
    if constexpr (CAUSAL) hi = min(hi, q_hi + 1);
    if constexpr (WINDOW) lo = max(lo, q_lo - p.extra.window_left);
  }
  template <class P>
  __device__ __forceinline__ bool BlockUnmasked(const P& p, int q_lo, int q_hi, int k0, int k1) const {
    bool all = true;
    if constexpr (CAUSAL) all = k1 - 1 <= q_lo;
    if constexpr (WINDOW) all = all && k0 >= q_hi - p.extra.window_left;
    return all;
  }
};

// FlashSigmoid: weight = sigmoid(logit + p.extra.sigmoid_bias); no normalization, so split partials
// are plain sums (the merge kernel adds them).
struct SigmoidAttention : VariantBase {
  static constexpr bool use_softmax = false;
  static constexpr bool has_logits_transform = true;
  template <class P>
  __device__ __forceinline__ float LogitsTransform(const P& p, float s, int, int, int, int) const {
    return s + p.extra.sigmoid_bias;
  }
};

// Rotary embedding applied inside attention (Streaming-LLM style: keys are rotated by their
// position in the cache, queries by q_pos), rotate-half layout, frequency
// p.extra.rope_theta^(-2i/D), positions shifted by p.extra.rope_offset. Optionally causal.
template <bool CAUSAL>
struct RopeAttention : VariantBase {
  static constexpr bool has_query_transform = true;
  static constexpr bool has_key_transform = true;
  static constexpr bool has_logits_mask = CAUSAL;

  template <class P>
  __device__ __forceinline__ static void rotate(const P& p, float& lo, float& hi, int d_lo, int pos) {
    const float inv_freq = powf(p.extra.rope_theta, -2.0f * float(d_lo) / float(P::head_dim));
    float s, c;
    sincosf(float(pos + p.extra.rope_offset) * inv_freq, &s, &c);
    const float x = lo, y = hi;
    lo = x * c - y * s;
    hi = y * c + x * s;
  }
  template <class P>
  __device__ __forceinline__ void QueryTransform(const P& p, float& lo, float& hi, int d_lo, int qo_idx,
                                                 int) const {
    rotate(p, lo, hi, d_lo, q_pos(qo_idx));
  }
  template <class P>
  __device__ __forceinline__ void KeyTransform(const P& p, float& lo, float& hi, int d_lo, int kv_idx,
                                               int) const {
    rotate(p, lo, hi, d_lo, kv_idx);
  }
  template <class P>
  __device__ __forceinline__ bool LogitsMask(const P&, int qo_idx, int kv_idx, int, int) const {
    return kv_idx <= q_pos(qo_idx);
  }
  template <class P>
  __device__ __forceinline__ void VisibleKV(const P&, int, int q_hi, int&, int& hi) const {
    if constexpr (CAUSAL) hi = min(hi, q_hi + 1);
  }
  template <class P>
  __device__ __forceinline__ bool BlockUnmasked(const P&, int q_lo, int, int, int k1) const {
    return k1 - 1 <= q_lo;
  }
};

// Custom mask (tree / speculative attention): request b's [qo_len, kv_len] boolean matrix,
// row-major, bit-packed little-endian, starting at byte p.extra.mask_offsets[b] of p.extra.mask (int64 byte offsets).
struct CustomMaskAttention : VariantBase {
  static constexpr bool has_logits_mask = true;
  const uint8_t* bits;
  template <class P>
  __device__ __forceinline__ void init(const P& p, int batch, int qo_length, int kv_length) {
    VariantBase::init(p, batch, qo_length, kv_length);
    bits = p.extra.mask + p.extra.mask_offsets[batch];
  }
  template <class P>
  __device__ __forceinline__ bool LogitsMask(const P&, int qo_idx, int kv_idx, int, int) const {
    const int64_t bit = int64_t(qo_idx) * kv_len + kv_idx;
    return (bits[bit >> 3] >> (bit & 7)) & 1;
  }
};

}  // namespace rtattn
