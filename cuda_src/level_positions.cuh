// Absolute positions on a cascade level. A level's group attends only part of its requests' KV
// (a shared prefix, or a suffix that starts after it), and one group holds queries of several
// requests, so the index conventions of variant_base.cuh (q_pos = kv_len - qo_len + qo_idx, KV
// positions from 0) do not give the queries' real positions. The plan set stores them:
// cascade_q_pos[row] is query row `row`'s absolute position, cascade_kv_offset[b] the absolute
// position of group b's first KV token. Position-dependent hooks see relative distances only
// (kv_idx - q_pos), so the wrapper hands the base variant the query index whose standard
// position, counted from the group's first KV token, is the real one: every built-in hook
// (causal, window, ALiBi's LinearBiasOf) then needs no change.
#pragma once
#include "variant_base.cuh"

namespace rtattn {

template <class Base>
struct LevelPositions : Base {
  const int32_t* q_pos_rows;  // absolute positions of the group's query rows
  int q_shift;                // kv_len - qo_len + kv_offset: turns a position into a base qo_idx

  template <class P>
  __device__ __forceinline__ void init(const P& p, int batch, int qo_length, int kv_length) {
    Base::init(p, batch, qo_length, kv_length);
    q_pos_rows = p.extra.cascade_q_pos + p.plan.req_qo_start[batch];
    q_shift = kv_length - qo_length + p.extra.cascade_kv_offset[batch];
  }
  __device__ __forceinline__ int base_qo_idx(int qo_idx) const { return q_pos_rows[qo_idx] - q_shift; }

  template <class P>
  __device__ __forceinline__ float LogitsTransform(const P& p, float s, int qo_idx, int kv_idx, int qo_head,
                                                   int kv_head) const {
    return Base::LogitsTransform(p, s, base_qo_idx(qo_idx), kv_idx, qo_head, kv_head);
  }
  template <class P>
  __device__ __forceinline__ LinearBias LinearBiasOf(const P& p, int qo_idx, int qo_head) const {
    return Base::LinearBiasOf(p, base_qo_idx(qo_idx), qo_head);
  }
  template <class P>
  __device__ __forceinline__ bool LogitsMask(const P& p, int qo_idx, int kv_idx, int qo_head, int kv_head) const {
    return Base::LogitsMask(p, base_qo_idx(qo_idx), kv_idx, qo_head, kv_head);
  }
  // Tiled kernels (prefill): a shared group's tile holds queries of several requests, whose
  // positions need not grow with the row, so its first and last rows bound nothing. Read all
  // of the group's KV and mask every block (the mask sees each query's real position).
  template <class P>
  __device__ __forceinline__ void VisibleKV(const P&, int, int, int&, int&) const {}
  template <class P>
  __device__ __forceinline__ bool BlockUnmasked(const P&, int, int, int, int) const { return false; }
};

}  // namespace rtattn
