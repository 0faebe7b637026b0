// Persistent prefill attention on Hopper warpgroup MMA (sm_90a wgmma), the prefill family's
// kernel for cc 9.0. Same params, plan, work queues, variant hooks and outputs as the mma.sync
// kernel (prefill.cuh), whose per-block logits/softmax and epilogue it shares (prefill_rows.cuh).
//
// A CTA is WGS warpgroups (4 warps, 128 threads each) owning 64 * WGS fused query rows (row r =
// token r / g, head r % g); warpgroup u issues the products of rows [64u, 64u + 64), warp w holds
// rows [16w, 16w + 16) and their online softmax state. With one warpgroup two CTAs share an SM
// (the resource model keeps both resident), so one's softmax and item prologue overlap the
// other's tensor-core products; two warpgroups share each K/V tile (half the shared-memory fill
// per product). Per KV block of TILE_KV tokens, per warpgroup:
//   S (64 x TILE_KV) = Q K^T   D/16 wgmma m64nTILE_KVk16, q and K by descriptor (K-major);
//   logits -> softmax -> P     on the accumulators, exactly the mma.sync C layout;
//   O (64 x D) += P V          TILE_KV/16 wgmma m64nDk16, P from registers, V N-major.
// q, K and V tiles are in the canonical 128-byte swizzle (Sw128Tile), filled by cp.async (the
// paged loader: any page size, ragged KV) through STAGES stages; the next tile's copies are
// issued while the QK^T products run.
#pragma once
#include "paged_loader.cuh"
#include "prefill_rows.cuh"
#include "query_transform.cuh"
#include "swizzle.cuh"
#include "wgmma.cuh"

namespace rtattn {

template <int HEAD_DIM, int WGS, int TILE_KV, int STAGES, int ELEM_BYTES>
struct PrefillSm90Shape {
  static constexpr int rows = 64 * WGS;
  static constexpr int threads = 128 * WGS;
  static constexpr int q_bytes = rows * HEAD_DIM * ELEM_BYTES;
  static constexpr int tile_bytes = TILE_KV * HEAD_DIM * ELEM_BYTES;
  static constexpr int stage_bytes = 2 * tile_bytes;
  static constexpr int smem_bytes = q_bytes + STAGES * stage_bytes;
  static_assert(TILE_KV % 16 == 0 && TILE_KV <= 128, "KV tiles are whole k-steps of PV, at most n128 of QK^T");
  static_assert(STAGES >= 2, "the pipeline needs a stage to compute and one in flight");
  static_assert(q_bytes % 1024 == 0 && tile_bytes % 1024 == 0, "tiles are whole 1024-byte swizzle atoms");
};

template <class Variant, class P, int WGS, int TILE_KV, int STAGES, bool PAGED>
__device__ __forceinline__ void prefill_sm90_persistent(const P& p, char* smem) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using S = PrefillSm90Shape<D, WGS, TILE_KV, STAGES, sizeof(T)>;
  using QTile = Sw128Tile<D, S::rows>;
  using KVTile = Sw128Tile<D, TILE_KV>;
  using Loader = KVTileLoader<T, D, TILE_KV, S::threads, PAGED, false, KVTile>;
  constexpr int KT = D / 16;       // k-steps of QK^T
  constexpr int NT = TILE_KV / 8;  // 8-column chunks of S
  constexpr int KS = TILE_KV / 16; // k-steps of PV
  constexpr int DT = D / 8;        // 8-column chunks of O

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y;
  const int heads = p.group_size;
  const int first_qo_head = kv_head * heads;
  const int warp_row0 = warp * 16;

  T* q_smem = reinterpret_cast<T*>(smem);
  auto k_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes); };
  auto v_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes + S::tile_bytes); };
  // Descriptors: q and K K-major (8-row groups 1024 B apart; a k16 step is 32 B inside a 64-column
  // slab, slabs rows * 128 B apart); V N-major (d slabs TILE_KV * 128 B apart (leading), 8-token
  // groups 1024 B apart (stride); a k16 step is 16 tokens = 2048 B).
  auto kmajor_desc = [](uint32_t base, int slab_bytes, int kk) {
    return sw128_desc(base + (kk / 4) * slab_bytes + (kk % 4) * 32, 16, 1024);
  };
  const uint32_t q_base = smem_addr(q_smem) + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows

  const int item_begin = p.plan.work_indptr[blockIdx.x];
  const int item_end = p.plan.work_indptr[blockIdx.x + 1];
  Loader ld;
  ld.init(p, kv_head, tid);

  wait_for_previous_grid();  // programmatic dependent launch, as the mma.sync kernel
  allow_next_grid();

  // Each CTA walks its queue from its own offset (prefill.cuh says why); the order changes no result.
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

    __syncthreads();  // the previous item's products are done with q and every stage
    // ---- Query rows -> the q tile (rows past the item are zeros, never written out): cp.async
    // copies joining the first pipeline group, or, with a QueryTransform, through registers.
    if constexpr (!Variant::has_query_transform) {
      constexpr int QC = D / 8;
      static_assert(S::rows * QC % S::threads == 0 && S::threads % QC == 0, "whole passes of rows");
#pragma unroll
      for (int pass = 0; pass < S::rows * QC / S::threads; ++pass) {
        const int r = (tid + pass * S::threads) / QC, c = tid % QC;
        const bool valid = r < rows_valid;
        const T* qp = valid ? p.q + int64_t(q_row0 + r / heads) * p.q_stride_tok +
                                  int64_t(first_qo_head + r % heads) * p.q_stride_head + c * 8
                            : p.q;
        cp_async_16(q_smem + QTile::at(r, c), qp, valid);
      }
    }
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
      constexpr int QV = D / 16;
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
        *reinterpret_cast<uint4*>(q_smem + QTile::at(r, c / 8)) = lo4;
        *reinterpret_cast<uint4*>(q_smem + QTile::at(r, (c + D / 2) / 8)) = hi4;
      }
      // the fence and barrier of the first block publish these stores to the tensor cores
    }

    int row_qo_idx[2], row_qo_head[2];
    auto row_ids = [&] {
      group_row_ids(row_qo_idx, row_qo_head, warp_row0, rows_valid, heads, qo_idx0, first_qo_head, lane);
    };
    if constexpr (Variant::has_logits_transform) row_ids();

    float o[DT][4];
    RowSoftmax<Variant::use_softmax, NT, DT> sm;
    sm.reset();
#pragma unroll
    for (int dn = 0; dn < DT; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dn][e] = 0.f;

    auto issue_next = [&](int blk) {
      const int nb = blk + STAGES - 1, ns = nb % STAGES;
      if (nb < num_blocks) {
        ld.issue(p, k_stage(ns), v_stage(ns), lo + nb * TILE_KV, hi);
        ld.fetch(p, pages, page_start, lo + (nb + 1) * TILE_KV, hi);
      }
      cp_async_commit();
    };
    auto block = [&](auto masked, int blk) {
      constexpr bool kMasked = decltype(masked)::value;
      const int st = blk % STAGES;
      T* ks = k_stage(st);
      const int pos0 = lo + blk * TILE_KV;
      if constexpr (Variant::has_key_transform) {
        for (int i = tid; i < TILE_KV * (D / 2); i += S::threads) {
          const int tok = i / (D / 2), d = i % (D / 2);
          const int lo_at = KVTile::at(tok, d / 8) + d % 8, hi_at = KVTile::at(tok, (d + D / 2) / 8) + d % 8;
          float x = to_float(ks[lo_at]), y = to_float(ks[hi_at]);
          var.KeyTransform(p, x, y, d, pos0 + tok, kv_head);
          ks[lo_at] = from_float<T>(x);
          ks[hi_at] = from_float<T>(y);
        }
        fence_proxy_async();
        __syncthreads();
      }

      // ---- S = Q K^T (asynchronous; the next tile's copies are issued meanwhile)
      float s[NT][4];
      const uint32_t k_base = smem_addr(ks);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KT; ++kk)
        WgmmaSS<T, TILE_KV>::run(s, kmajor_desc(q_base, QTile::slab_bytes, kk),
                                 kmajor_desc(k_base, KVTile::slab_bytes, kk), kk > 0);
      wgmma_commit();
      issue_next(blk);
      wgmma_wait<0>();
      fence_accumulators(s);

      if constexpr (kMasked && Variant::has_logits_mask && !Variant::has_logits_transform) row_ids();
      uint32_t pa[KS][4];
      logits_to_p<kMasked>(p, var, sm, s, o, pa, pos0, hi, row_qo_idx, row_qo_head, kv_head, lane);

      // ---- O += P V
      const uint32_t v_base = smem_addr(v_stage(st));
      fence_accumulators(o);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < KS; ++j)
        WgmmaRS<T, D>::run(o, pa[j], sw128_desc(v_base + j * 2048, KVTile::slab_bytes, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(o);
    };

    for (int blk = 0; blk < num_blocks; ++blk) {
      cp_async_wait<STAGES - 2>();
      fence_proxy_async();
      __syncthreads();  // tile blk (and q) landed for everyone; everyone is past tile blk - 1
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

    store_group(p, var, sm, o, warp_row0, rows_valid, heads, first_qo_head, q_row0, partial_row, lane);
  }
}

}  // namespace rtattn
