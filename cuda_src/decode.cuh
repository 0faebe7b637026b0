// Persistent paged-KV decode attention on tensor cores (mma.sync m16n8k16).
//
// Grid (num_ctas, num_kv_heads * head_blocks), fixed for the life of a wrapper so a CUDA graph
// stays valid while plans change. CTA (c, y) walks work queue c of the plan; each item is
// (request, up to tile_q query tokens, KV token range). Head-group fusion: the g query heads
// that share KV head y are folded into the row axis (rows = tokens x heads, at most 16*M_TILES),
// so each K/V byte is loaded once for all of them. Each warp owns 16 of the block's tokens and
// keeps its own online-softmax state; the warps' states are combined with the merge operator
// at the end of the item, then written as final O (writethrough) or a float32 partial row that
// the merge kernel (merge.cuh) folds in the plan's fixed order.
#pragma once
#include "ptx.cuh"

namespace rtattn {

template <int HEAD_DIM, int M_TILES, int NUM_WARPS, int STAGES, int ELEM_BYTES>
struct DecodeShape {
  static constexpr int rows = 16 * M_TILES;
  static constexpr int threads = NUM_WARPS * 32;
  static constexpr int block_tokens = NUM_WARPS * 16;
  static constexpr int row_stride = HEAD_DIM + 8;  // +16 bytes: ldmatrix rows land on distinct banks
  static constexpr int vecs_per_row = HEAD_DIM / 8;
  static constexpr int stage_elems = block_tokens * row_stride;
  static constexpr int kv_bytes = STAGES * 2 * stage_elems * ELEM_BYTES;
  static constexpr int q_bytes = rows * row_stride * ELEM_BYTES;
  static constexpr int combine_bytes = NUM_WARPS * rows * (HEAD_DIM + 2) * 4;
  static constexpr int smem_bytes = q_bytes + (kv_bytes > combine_bytes ? kv_bytes : combine_bytes);
  static_assert(HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(threads % vecs_per_row == 0, "threads must cover whole rows");
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class Variant, class P, int M_TILES, int NUM_WARPS, int STAGES>
__device__ __forceinline__ void decode_persistent(const P& p, char* smem) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using S = DecodeShape<D, M_TILES, NUM_WARPS, STAGES, sizeof(T)>;
  constexpr int KT = D / 16;  // k-steps of the QK product, also 16-wide column pairs of PV

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y / p.head_blocks;
  const int head_block = blockIdx.y % p.head_blocks;
  const int heads = p.heads_per_cta;  // query heads of this CTA's group slice
  const int first_qo_head = kv_head * p.group_size + head_block * heads;

  T* q_smem = reinterpret_cast<T*>(smem);
  T* kv_smem = reinterpret_cast<T*>(smem + S::q_bytes);
  float* combine = reinterpret_cast<float*>(smem + S::q_bytes);

  // Programmatic dependent launch: everything below may read what the previous kernel wrote.
  wait_for_previous_grid();
  const int item_begin = p.plan.work_indptr[blockIdx.x];
  const int item_end = p.plan.work_indptr[blockIdx.x + 1];

  for (int item = item_begin; item < item_end; ++item) {
    const int b = p.plan.item_request[item];
    const int q_row0 = p.plan.item_qo_start[item];
    const int q_tokens = p.plan.item_qo_len[item];
    const int kv_begin = p.plan.item_kv_start[item];
    const int kv_end = p.plan.item_kv_end[item];
    const int partial_row = p.plan.item_partial[item];
    const int qo_len = p.plan.req_qo_len[b];
    const int kv_len = p.plan.req_kv_len[b];
    const int qo_idx0 = q_row0 - p.plan.req_qo_start[b];
    const int* pages = p.plan.kv_indices + p.plan.req_kv_page_start[b];
    const int rows_valid = q_tokens * heads;
    const int num_blocks = (kv_end - kv_begin + S::block_tokens - 1) / S::block_tokens;

    Variant var;
    var.init(p, b, qo_len, kv_len);

    // ---- KV block loader: every thread copies the same 16-byte column of several tokens.
    auto load_block = [&](int blk, int stage) {
      T* ks = kv_smem + stage * 2 * S::stage_elems;
      T* vs = ks + S::stage_elems;
      const int vec = tid % S::vecs_per_row;
#pragma unroll
      for (int i = 0; i < S::block_tokens * S::vecs_per_row / S::threads; ++i) {
        const int tok = tid / S::vecs_per_row + i * (S::threads / S::vecs_per_row);
        const int pos = kv_begin + blk * S::block_tokens + tok;
        const bool valid = pos < kv_end;
        int64_t page = 0, slot = 0;
        if (valid) {
          page = pages[pos >> p.page_shift];
          slot = pos & ((1 << p.page_shift) - 1);
        }
        const T* kp = p.k_cache + page * p.k_stride_page + slot * p.k_stride_tok + kv_head * p.k_stride_head + vec * 8;
        const T* vp = p.v_cache + page * p.v_stride_page + slot * p.v_stride_tok + kv_head * p.v_stride_head + vec * 8;
        cp_async_16(ks + tok * S::row_stride + vec * 8, kp, valid);
        cp_async_16(vs + tok * S::row_stride + vec * 8, vp, valid);
      }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < num_blocks) load_block(s, s);
      cp_async_commit();
    }

    // ---- Query rows (token t, head j) -> row t*heads + j; transform in float, store as T.
    for (int i = tid; i < S::rows * (D / 2); i += S::threads) {
      const int r = i / (D / 2), d = i % (D / 2);
      float lo = 0.f, hi = 0.f;
      if (r < rows_valid) {
        const int t = r / heads, qo_head = first_qo_head + r % heads;
        const T* qp = p.q + int64_t(q_row0 + t) * p.q_stride_tok + int64_t(qo_head) * p.q_stride_head;
        lo = to_float(qp[d]);
        hi = to_float(qp[d + D / 2]);
        if constexpr (Variant::has_query_transform) var.QueryTransform(p, lo, hi, d, qo_idx0 + t, qo_head);
      }
      q_smem[r * S::row_stride + d] = from_float<T>(lo);
      q_smem[r * S::row_stride + d + D / 2] = from_float<T>(hi);
    }
    __syncthreads();
    uint32_t qa[M_TILES][KT][4];
#pragma unroll
    for (int mi = 0; mi < M_TILES; ++mi)
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        const int m = lane / 8;
        ldmatrix_x4(qa[mi][kk], q_smem + (mi * 16 + (m % 2) * 8 + lane % 8) * S::row_stride + kk * 16 + (m / 2) * 8);
      }

    // Rows this thread holds in the accumulator layout: row = mi*16 + lane/4 + 8*half.
    int row_qo_idx[M_TILES][2], row_qo_head[M_TILES][2];
#pragma unroll
    for (int mi = 0; mi < M_TILES; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Padding rows borrow the last real row's indices so hooks never see a query past the
        // request (a custom mask would read outside its bits); their results are never written.
        const int r = min(mi * 16 + lane / 4 + 8 * h, rows_valid - 1);
        row_qo_idx[mi][h] = qo_idx0 + r / heads;
        row_qo_head[mi][h] = first_qo_head + r % heads;
      }

    float o[M_TILES][D / 8][4];
    float m_run[M_TILES][2], l_run[M_TILES][2];
#pragma unroll
    for (int mi = 0; mi < M_TILES; ++mi) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][dn][e] = 0.f;
      m_run[mi][0] = m_run[mi][1] = -INFINITY;
      l_run[mi][0] = l_run[mi][1] = 0.f;
    }

    for (int blk = 0; blk < num_blocks; ++blk) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      {
        const int nxt = blk + STAGES - 1;
        if (nxt < num_blocks) load_block(nxt, nxt % STAGES);
        cp_async_commit();
      }
      T* ks = kv_smem + (blk % STAGES) * 2 * S::stage_elems;
      T* vs = ks + S::stage_elems;
      const int blk_pos0 = kv_begin + blk * S::block_tokens;
      if constexpr (Variant::has_key_transform) {
        for (int i = tid; i < S::block_tokens * (D / 2); i += S::threads) {
          const int tok = i / (D / 2), d = i % (D / 2);
          float lo = to_float(ks[tok * S::row_stride + d]), hi = to_float(ks[tok * S::row_stride + d + D / 2]);
          var.KeyTransform(p, lo, hi, d, blk_pos0 + tok, kv_head);
          ks[tok * S::row_stride + d] = from_float<T>(lo);
          ks[tok * S::row_stride + d + D / 2] = from_float<T>(hi);
        }
        __syncthreads();
      }

      // S = Q K^T for this warp's 16 tokens: two n-tiles of 8 tokens.
      float s[M_TILES][2][4];
#pragma unroll
      for (int mi = 0; mi < M_TILES; ++mi)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t kb[4];
        const int m = lane / 8;
        ldmatrix_x4(kb, ks + (warp * 16 + (m / 2) * 8 + lane % 8) * S::row_stride + kk * 16 + (m % 2) * 8);
#pragma unroll
        for (int mi = 0; mi < M_TILES; ++mi) {
          MmaOp<T>::run(s[mi][0], qa[mi][kk], kb[0], kb[1]);
          MmaOp<T>::run(s[mi][1], qa[mi][kk], kb[2], kb[3]);
        }
      }

      // Logits (log2 units), masks, online softmax (or sigmoid weights), P as an A fragment.
      uint32_t pa[M_TILES][4];
#pragma unroll
      for (int mi = 0; mi < M_TILES; ++mi) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e / 2;
            const int kv_pos = blk_pos0 + warp * 16 + n * 8 + (lane % 4) * 2 + (e & 1);
            float x = s[mi][n][e];
            if constexpr (Variant::has_logits_transform) {
              x = var.LogitsTransform(p, x * p.sm_scale, row_qo_idx[mi][h], kv_pos, row_qo_head[mi][h], kv_head) * kLog2e;
            } else {
              x *= p.sm_scale_log2;
            }
            bool keep = kv_pos < kv_end;
            if constexpr (Variant::has_logits_mask)
              keep = keep && var.LogitsMask(p, row_qo_idx[mi][h], kv_pos, row_qo_head[mi][h], kv_head);
            x = keep ? x : -INFINITY;
            s[mi][n][e] = x;
            mx[h] = fmaxf(mx[h], x);
          }
        if constexpr (Variant::use_softmax) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
            const float m_new = fmaxf(m_run[mi][h], mx[h]);
            const float base = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: no NaN
            const float corr = fast_exp2(m_run[mi][h] - base);
            m_run[mi][h] = m_new;
            l_run[mi][h] *= corr;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
              o[mi][dn][2 * h] *= corr;
              o[mi][dn][2 * h + 1] *= corr;
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
              for (int e = 2 * h; e < 2 * h + 2; ++e) {
                s[mi][n][e] = fast_exp2(s[mi][n][e] - base);
                l_run[mi][h] += s[mi][n][e];
              }
          }
        } else {
#pragma unroll
          for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x = s[mi][n][e];  // log2 units; sigmoid(x ln2)
              s[mi][n][e] = x == -INFINITY ? 0.f : 1.f / (1.f + fast_exp2(-x));
              l_run[mi][e / 2] += s[mi][n][e];
            }
        }
        pa[mi][0] = pack2<T>(s[mi][0][0], s[mi][0][1]);
        pa[mi][1] = pack2<T>(s[mi][0][2], s[mi][0][3]);
        pa[mi][2] = pack2<T>(s[mi][1][0], s[mi][1][1]);
        pa[mi][3] = pack2<T>(s[mi][1][2], s[mi][1][3]);
      }

      // O += P V for this warp's 16 tokens.
#pragma unroll
      for (int dp = 0; dp < KT; ++dp) {
        uint32_t vb[4];
        const int m = lane / 8;
        ldmatrix_x4_trans(vb, vs + (warp * 16 + (m % 2) * 8 + lane % 8) * S::row_stride + dp * 16 + (m / 2) * 8);
#pragma unroll
        for (int mi = 0; mi < M_TILES; ++mi) {
          MmaOp<T>::run(o[mi][2 * dp], pa[mi], vb[0], vb[1]);
          MmaOp<T>::run(o[mi][2 * dp + 1], pa[mi], vb[2], vb[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the KV stages: reuse them for the combine

    // ---- Combine the warps: combine[w][row][0..D) = O, [D] = m (log2), [D+1] = l.
#pragma unroll
    for (int mi = 0; mi < M_TILES; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_run[mi][h];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const int r = mi * 16 + lane / 4 + 8 * h;
        float* dst = combine + (warp * S::rows + r) * (D + 2);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const int d = dn * 8 + (lane % 4) * 2;
          dst[d] = o[mi][dn][2 * h];
          dst[d + 1] = o[mi][dn][2 * h + 1];
        }
        if (lane % 4 == 0) {
          dst[D] = Variant::use_softmax ? m_run[mi][h] : 0.f;
          dst[D + 1] = l;
        }
      }
    __syncthreads();

    for (int i = tid; i < rows_valid * (D / 2); i += S::threads) {
      const int r = i / (D / 2), d = (i % (D / 2)) * 2;
      float m_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) m_max = fmaxf(m_max, combine[(w * S::rows + r) * (D + 2) + D]);
      const float base = m_max == -INFINITY ? 0.f : m_max;
      float l = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) {
        const float* src = combine + (w * S::rows + r) * (D + 2);
        const float f = Variant::use_softmax ? fast_exp2(src[D] - base) : 1.f;
        l += f * src[D + 1];
        o0 += f * src[d];
        o1 += f * src[d + 1];
      }
      // Natural-log LSE of the total weight; softmax O is normalized, sigmoid O is a plain sum.
      const float lse = l > 0.f ? (base + __log2f(l)) * kLn2 : -INFINITY;
      if (Variant::use_softmax) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        o0 *= inv;
        o1 *= inv;
      }
      const int t = r / heads, qo_head = first_qo_head + r % heads;
      if (partial_row < 0) {
        if constexpr (Variant::has_output_transform) {
          o0 = var.OutputTransform(p, o0, qo_head, d);
          o1 = var.OutputTransform(p, o1, qo_head, d + 1);
        }
        T* op = p.o + int64_t(q_row0 + t) * p.o_stride_tok + int64_t(qo_head) * p.o_stride_head + d;
        op[0] = from_float<T>(o0);
        op[1] = from_float<T>(o1);
        if (p.lse != nullptr && d == 0) p.lse[int64_t(q_row0 + t) * p.num_qo_heads + qo_head] = lse;
      } else {
        const int64_t prow = int64_t(partial_row + t) * p.num_qo_heads + qo_head;
        p.partial_o[prow * D + d] = o0;
        p.partial_o[prow * D + d + 1] = o1;
        if (d == 0) p.partial_lse[prow] = lse;
      }
    }
    __syncthreads();  // the combine area is the next item's first KV stages
  }
  // Let a programmatically dependent launch (the next layer's kernel) start its prologue.
  allow_next_grid();
}

}  // namespace rtattn
