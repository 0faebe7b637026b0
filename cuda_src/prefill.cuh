// Persistent tensor-core prefill attention (FlashAttention-2 style, mma.sync m16n8k16).
//
// Grid (num_ctas, num_kv_heads), fixed for the life of a wrapper (graph-capturable, as decode).
// CTA (c, y) walks work queue c of the plan; an item is (request, up to tile_q query tokens, KV
// range). Head-group fusion: the g query heads of KV head y are folded into the rows (row r =
// token r / g, head r % g), so each K/V tile serves g heads. A CTA holds ROWS = 16 * MMA_Q *
// NUM_WARPS rows; warp w owns rows [16 * MMA_Q * w, + 16 * MMA_Q) and keeps their online softmax
// state in registers over the whole KV range, so no cross-warp combine is needed.
//
// KV tiles of TILE_KV tokens stream through STAGES shared-memory stages (cp.async, swizzled).
// The variant clips the KV loop to what the tile's queries can see (VisibleKV: causal and window
// blocks outside are never loaded) and says which blocks need no mask (BlockUnmasked: only the
// diagonal / window-edge blocks evaluate LogitsMask). Output: final O/LSE (writethrough) or
// float32 partial rows folded afterwards by the shared merge kernel (merge.cuh), which also joins
// an attention sink to a split row.
#pragma once
#include "paged_loader.cuh"
#include "prefill_rows.cuh"
#include "ptx.cuh"
#include "query_transform.cuh"
#include "swizzle.cuh"

namespace rtattn {

template <int HEAD_DIM, int NUM_WARPS, int MMA_Q, int TILE_KV, int STAGES, int ELEM_BYTES>
struct PrefillShape {
  static constexpr int rows = 16 * MMA_Q * NUM_WARPS;
  static constexpr int threads = NUM_WARPS * 32;
  static constexpr int q_bytes = rows * HEAD_DIM * ELEM_BYTES;
  static constexpr int tile_bytes = TILE_KV * HEAD_DIM * ELEM_BYTES;  // K or V of one stage
  static constexpr int stage_bytes = 2 * tile_bytes;
  static constexpr int smem_bytes = q_bytes + STAGES * stage_bytes;
  static_assert(TILE_KV % 16 == 0, "KV tiles are whole 16-token k-steps of the PV product");
  static_assert(STAGES >= 2, "the pipeline needs a stage to compute and one in flight");
  static_assert(q_bytes % 128 == 0 && tile_bytes % 128 == 0, "tiles start on 128-byte lines");
};

template <class Variant, class P, int NUM_WARPS, int MMA_Q, int TILE_KV, int STAGES, bool PAGED>
__device__ __forceinline__ void prefill_persistent(const P& p, char* smem) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using S = PrefillShape<D, NUM_WARPS, MMA_Q, TILE_KV, STAGES, sizeof(T)>;
  using Tile = SwizzledRows<D>;
  using Loader = KVTileLoader<T, D, TILE_KV, S::threads, PAGED>;
  constexpr int KT = D / 16;       // k-steps of QK^T; also 16-column pairs of O
  constexpr int NT = TILE_KV / 8;  // n-tiles of the logits
  constexpr int KS = TILE_KV / 16; // k-steps of PV
  constexpr int DT = D / 8;        // n-tiles of O
  // q fragments stay in registers when they are few; otherwise ldmatrix re-reads them per tile
  constexpr bool kQRegs = MMA_Q * KT * 4 <= 32 && NUM_WARPS <= 4;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y;
  const int heads = p.group_size;
  const int first_qo_head = kv_head * heads;

  T* q_smem = reinterpret_cast<T*>(smem);
  auto k_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes); };
  auto v_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes + S::tile_bytes); };

  const int item_begin = p.plan.work_indptr[blockIdx.x];
  const int item_end = p.plan.work_indptr[blockIdx.x + 1];
  Loader ld;
  ld.init(p, kv_head, tid);
  // ldmatrix lane offsets (bytes) inside a 16-token group of K / V and a 16-row tile of q:
  // K x4 = (tokens +8*(m/2), chunk m%2): two 8-token n-tiles x two k halves; V x4 transposed =
  // (tokens +8*(m%2), chunk m/2); q x4 = (rows +8*(m%2), chunk m/2), the A fragment order.
  const uint32_t k_lane = Tile::at((lane / 16) * 8 + lane % 8, lane / 8 % 2) * sizeof(T);
  const uint32_t v_lane = Tile::at((lane / 8 % 2) * 8 + lane % 8, lane / 16) * sizeof(T);
  const int warp_row0 = warp * 16 * MMA_Q;
  const uint32_t q_lane = smem_addr(q_smem) + Tile::at(warp_row0 + (lane / 8 % 2) * 8 + lane % 8, lane / 16) * sizeof(T);
  constexpr uint32_t kGroupBytes = 16 * D * sizeof(T);  // 16 rows of a tile

  // Programmatic dependent launch: the plan (an H2D copy complete before any kernel started) is
  // read freely; q, the KV cache and the outputs only after the previous grid finished.
  wait_for_previous_grid();
  allow_next_grid();

  // Each CTA walks its queue from its own offset. LPT gives every queue the same shape (costs
  // descending), so CTAs walking them in order reach their item prologues (plan reads, page ids,
  // first tiles) together, and the CTA sharing an SM (block L + the SM count: the same queue of
  // another KV head here) cannot hide them. Items are independent: the order changes no result.
  const int num_items = item_end - item_begin;
  const int first = int(int64_t(blockIdx.x + blockIdx.y * gridDim.x) * num_items / (gridDim.x * gridDim.y));
  for (int k = 0; k < num_items; ++k) {
    const int item = item_begin + (k + first < num_items ? k + first : k + first - num_items);
    const int b = p.plan.item_request[item], q_row0 = p.plan.item_qo_start[item];
    const int q_tokens = p.plan.item_qo_len[item];
    const int partial_row = p.plan.item_partial[item];
    int lo = p.plan.item_kv_start[item], hi = p.plan.item_kv_end[item];
    const int page_start = p.plan.item_kv_page_start[item];
    const int* pages = p.plan.kv_indices + page_start;
    const int qo_len = p.plan.req_qo_len[b], kv_len = p.plan.req_kv_len[b];
    const int qo_idx0 = q_row0 - p.plan.req_qo_start[b];
    const int rows_valid = q_tokens * heads;

    Variant var;
    var.init(p, b, qo_len, kv_len);
    const int q_lo = var.q_pos(qo_idx0), q_hi = var.q_pos(qo_idx0 + q_tokens - 1);
    var.VisibleKV(p, q_lo, q_hi, lo, hi);
    const int num_blocks = hi > lo ? (hi - lo + TILE_KV - 1) / TILE_KV : 0;

    __syncthreads();  // the previous item's readers of q and of every stage are done
    // ---- Query rows -> the swizzled q tile; rows past the item are zeros (their results are
    // never written). Without a QueryTransform the rows are cp.async copies issued before the
    // KV tiles, so they join the first pipeline group: one round trip for q and KV together
    // (a register round trip per row waited on each load: several microseconds per item).
    if constexpr (!Variant::has_query_transform) {
      constexpr int QC = D / 8;  // 16-byte chunks per row; a thread keeps one column of chunks
      static_assert(S::rows * QC % S::threads == 0 && S::threads % QC == 0, "whole passes of rows");
#pragma unroll
      for (int pass = 0; pass < S::rows * QC / S::threads; ++pass) {
        const int r = (tid + pass * S::threads) / QC, c = tid % QC;
        const bool valid = r < rows_valid;
        const T* qp = valid ? p.q + int64_t(q_row0 + r / heads) * p.q_stride_tok +
                                  int64_t(first_qo_head + r % heads) * p.q_stride_head + c * 8
                            : p.q;
        cp_async_16(q_smem + Tile::at(r, c), qp, valid);
      }
    }
    // ---- KV pipeline: STAGES - 1 tiles in flight before the first is computed.
    ld.fetch(p, pages, page_start, lo, hi);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < num_blocks) {
        ld.issue(p, k_stage(s), v_stage(s), lo + s * TILE_KV, hi);
        ld.fetch(p, pages, page_start, lo + (s + 1) * TILE_KV, hi);
      }
      cp_async_commit();
    }

    if constexpr (Variant::has_query_transform) {  // QueryTransform on the pair d, d + D/2
      constexpr int QV = D / 16;  // 8-element chunks per half row
      for (int i = tid; i < S::rows * QV; i += S::threads) {
        const int r = i / QV, c = (i % QV) * 8;
        uint4 lo4 = make_uint4(0u, 0u, 0u, 0u), hi4 = lo4;
        if (r < rows_valid) {
          const T* qp = p.q + int64_t(q_row0 + r / heads) * p.q_stride_tok +
                        int64_t(first_qo_head + r % heads) * p.q_stride_head + c;
          lo4 = *reinterpret_cast<const uint4*>(qp);
          hi4 = *reinterpret_cast<const uint4*>(qp + D / 2);
          transform_query_chunks<T>(var, p, lo4, hi4, c, qo_idx0 + r / heads, first_qo_head + r % heads);
        }
        *reinterpret_cast<uint4*>(q_smem + Tile::at(r, c / 8)) = lo4;
        *reinterpret_cast<uint4*>(q_smem + Tile::at(r, (c + D / 2) / 8)) = hi4;
      }
      __syncthreads();
    } else if constexpr (kQRegs) {
      cp_async_wait<STAGES - 2>();  // the first group (q and KV tile 0) landed ...
      __syncthreads();              // ... for every thread
    }  // else: the first block's wait covers q
    uint32_t qa[kQRegs ? MMA_Q : 1][kQRegs ? KT : 1][4];
    if constexpr (kQRegs) {
#pragma unroll
      for (int mi = 0; mi < MMA_Q; ++mi)
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) ldmatrix_x4(qa[mi][kk], Tile::kstep(q_lane + mi * kGroupBytes, kk));
    }

    // Rows this thread holds: mi*16 + lane/4 + 8h of the warp's rows. Only the hooks need their
    // indices: kept in registers for a variant that transforms every logit, else recomputed in
    // the (rare) masked blocks, so the common block holds no registers for them.
    auto row_ids = [&](int (&idx)[MMA_Q][2], int (&head)[MMA_Q][2]) {
#pragma unroll
      for (int mi = 0; mi < MMA_Q; ++mi)
        group_row_ids(idx[mi], head[mi], warp_row0 + mi * 16, rows_valid, heads, qo_idx0, first_qo_head, lane);
    };
    int row_qo_idx[MMA_Q][2], row_qo_head[MMA_Q][2];
    if constexpr (Variant::has_logits_transform) row_ids(row_qo_idx, row_qo_head);

    float o[MMA_Q][DT][4];
    RowSoftmax<Variant::use_softmax, NT, DT> sm[MMA_Q];
#pragma unroll
    for (int mi = 0; mi < MMA_Q; ++mi) {
      sm[mi].reset();
#pragma unroll
      for (int dn = 0; dn < DT; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][dn][e] = 0.f;
    }

    // The copies of tile blk + STAGES - 1 into the stage tile blk - 1 used (everyone is past it),
    // issued between the QK products and the softmax: the integer work of the loader then runs
    // while the tensor pipe finishes S (before the products it ran alone, after the barrier).
    auto issue_next = [&](int blk) {
      const int nb = blk + STAGES - 1, ns = nb % STAGES;
      if (nb < num_blocks) {
        ld.issue(p, k_stage(ns), v_stage(ns), lo + nb * TILE_KV, hi);
        ld.fetch(p, pages, page_start, lo + (nb + 1) * TILE_KV, hi);
      }
      cp_async_commit();
    };
    // One KV block: S = QK^T, (mask,) online softmax, O += PV. Instantiated twice: blocks that
    // the mask cuts (causal diagonal, window edge, the range's tail) and blocks it does not, so
    // the common unmasked block carries no per-logit compare/select (a warp-uniform branch).
    auto block = [&](auto masked, int blk) {
      constexpr bool kMasked = decltype(masked)::value;
      const int st = blk % STAGES;
      T* ks = k_stage(st);
      const int pos0 = lo + blk * TILE_KV;
      if constexpr (Variant::has_key_transform) {
        for (int i = tid; i < TILE_KV * (D / 2); i += S::threads) {
          const int tok = i / (D / 2), d = i % (D / 2);
          const int lo_at = Tile::at(tok, d / 8) + d % 8, hi_at = Tile::at(tok, (d + D / 2) / 8) + d % 8;
          float x = to_float(ks[lo_at]), y = to_float(ks[hi_at]);
          var.KeyTransform(p, x, y, d, pos0 + tok, kv_head);
          ks[lo_at] = from_float<T>(x);
          ks[hi_at] = from_float<T>(y);
        }
        __syncthreads();
      }

      // ---- S = Q K^T
      float s[MMA_Q][NT][4];
#pragma unroll
      for (int mi = 0; mi < MMA_Q; ++mi)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][n][e] = 0.f;
      const uint32_t k_base = smem_addr(ks) + k_lane;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t qf[MMA_Q][4];
#pragma unroll
        for (int mi = 0; mi < MMA_Q; ++mi) {
          if constexpr (kQRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qf[mi][e] = qa[mi][kk][e];
          } else {
            ldmatrix_x4(qf[mi], Tile::kstep(q_lane + mi * kGroupBytes, kk));
          }
        }
#pragma unroll
        for (int j = 0; j < KS; ++j) {
          uint32_t kb[4];
          ldmatrix_x4(kb, Tile::kstep(k_base + j * kGroupBytes, kk));
#pragma unroll
          for (int mi = 0; mi < MMA_Q; ++mi) {
            MmaOp<T>::run(s[mi][2 * j], qf[mi], kb[0], kb[1]);
            MmaOp<T>::run(s[mi][2 * j + 1], qf[mi], kb[2], kb[3]);
          }
        }
      }

      issue_next(blk);

      // ---- logits -> transform -> mask -> online softmax (scaled to log2 units) -> P fragments
      if constexpr (kMasked && Variant::has_logits_mask && !Variant::has_logits_transform)
        row_ids(row_qo_idx, row_qo_head);
      uint32_t pa[MMA_Q][KS][4];
#pragma unroll
      for (int mi = 0; mi < MMA_Q; ++mi)
        logits_to_p<kMasked>(p, var, sm[mi], s[mi], o[mi], pa[mi], pos0, hi, row_qo_idx[mi], row_qo_head[mi],
                             kv_head, lane);

      // ---- O += P V
      const uint32_t v_base = smem_addr(v_stage(st)) + v_lane;
#pragma unroll
      for (int j = 0; j < KS; ++j)
#pragma unroll
        for (int dp = 0; dp < KT; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, Tile::kstep(v_base + j * kGroupBytes, dp));
#pragma unroll
          for (int mi = 0; mi < MMA_Q; ++mi) {
            MmaOp<T>::run(o[mi][2 * dp], pa[mi][j], vb[0], vb[1]);
            MmaOp<T>::run(o[mi][2 * dp + 1], pa[mi][j], vb[2], vb[3]);
          }
        }
    };

    for (int blk = 0; blk < num_blocks; ++blk) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile blk landed for everyone; everyone is past tile blk - 1
      const int pos0 = lo + blk * TILE_KV;
      bool need_mask = pos0 + TILE_KV > hi;  // the range's tail block
      if constexpr (Variant::has_logits_mask)
        need_mask = need_mask || !var.BlockUnmasked(p, q_lo, q_hi, pos0, pos0 + TILE_KV);
      if (need_mask) {
        block(BoolConst<true>{}, blk);
      } else {
        block(BoolConst<false>{}, blk);
      }
    }
    cp_async_wait<0>();  // only empty groups can remain; the next item refills every stage

    // ---- Epilogue
#pragma unroll
    for (int mi = 0; mi < MMA_Q; ++mi)
      store_group(p, var, sm[mi], o[mi], warp_row0 + mi * 16, rows_valid, heads, first_qo_head, q_row0, partial_row, lane);
  }
}

}  // namespace rtattn
