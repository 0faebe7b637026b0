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
//
// CROSS: the KV stream runs across the items of the queue (QueueKVStream, as the wgmma kernel's):
// the next item's first tiles are issued while the current item's last blocks compute, and each
// warp copies the next item's q rows into its own rows once its last QK^T has read them.
#pragma once
#include "paged_loader.cuh"
#include "prefill_item.cuh"
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

template <class Variant, class P, int NUM_WARPS, int MMA_Q, int TILE_KV, int STAGES, bool PAGED, bool CROSS = false>
__device__ __forceinline__ void prefill_persistent(const P& p, char* smem) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using S = PrefillShape<D, NUM_WARPS, MMA_Q, TILE_KV, STAGES, sizeof(T)>;
  using Tile = SwizzledRows<D>;
  using Loader = KVTileLoader<T, D, TILE_KV, S::threads, PAGED, kPrefillKvEvictFirst>;
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

  PrefillQueue queue;
  queue.init(p);
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

  // CROSS: the queue's KV stream, the blocks consumed so far (its tile index) and whether this
  // item's q rows were copied during the previous item.
  QueueKVStream<Variant, TILE_KV> stream;
  int blocks_done = 0;
  bool q_copied = false;
  if constexpr (CROSS) stream.init(ld, p, queue, heads);

  for (int k = 0; k < queue.size; ++k) {
    const int item = queue.item(k);
    Variant var;
    PrefillItem<Variant> it;
    it.template load<TILE_KV>(p, item, heads, var);
    const int q_row0 = it.q_row0, partial_row = it.partial_row, hi = it.hi, lo = it.lo;
    const int qo_idx0 = it.qo_idx0, rows_valid = it.rows_valid, num_blocks = it.num_blocks;

    if constexpr (CROSS) {
      // The stream already holds this item's first tiles (the queue's first: issued here, after q).
      if (!q_copied) {
        // q's last copies (an item without KV tiles took them) landed; every warp is done with q
        if (!Variant::has_query_transform && k > 0) cp_async_wait<0>();
        __syncthreads();
        if constexpr (!Variant::has_query_transform) copy_q_rows<Tile, S::rows, S::threads>(p, q_smem, it, heads, first_qo_head, tid);
      }
      if (k == 0) {
        stream.template start<STAGES>(ld, p, queue, heads, k_stage, v_stage);
      } else if (!q_copied && !Variant::has_query_transform) {
        cp_async_commit();  // q's own group: the first block waits for every group
      }
    } else {
      __syncthreads();  // the previous item's readers of q and of every stage are done
      // ---- Query rows (cp.async, joining the first KV group) and the KV stream's first tiles
      if constexpr (!Variant::has_query_transform) copy_q_rows<Tile, S::rows, S::threads>(p, q_smem, it, heads, first_qo_head, tid);
      start_kv_stream<STAGES, TILE_KV>(ld, p, it, k_stage, v_stage);
    }

    if constexpr (Variant::has_query_transform) {
      transform_q_rows<Tile, S::rows, S::threads>(p, var, q_smem, it, heads, first_qo_head, tid);
      __syncthreads();
    } else if constexpr (kQRegs) {
      // the group holding q (the first; CROSS past the queue's first item: possibly the newest) ...
      if (CROSS && k > 0) {
        cp_async_wait<0>();
      } else {
        cp_async_wait<STAGES - 2>();
      }
      __syncthreads();  // ... landed for every thread
    }  // else: the first block's wait covers q
    const bool q_first_wait = CROSS && !Variant::has_query_transform && !kQRegs && k > 0;
    if constexpr (CROSS) q_copied = false;
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
    if constexpr (Variant::has_logits_transform || Variant::has_linear_bias) row_ids(row_qo_idx, row_qo_head);
    GroupBias<Variant> bias[MMA_Q];
#pragma unroll
    for (int mi = 0; mi < MMA_Q; ++mi) bias[mi].init(p, var, row_qo_idx[mi], row_qo_head[mi], lane);

    float o[MMA_Q][DT][4];
    GroupSoftmax<Variant, P, NT, DT> sm[MMA_Q];
#pragma unroll
    for (int mi = 0; mi < MMA_Q; ++mi) {
      sm[mi].reset(logits_bound(p, var));
#pragma unroll
      for (int dn = 0; dn < DT; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][dn][e] = 0.f;
    }

    // One KV block: S = QK^T, (mask,) online softmax, O += PV. Instantiated twice: blocks that
    // the mask cuts (causal diagonal, window edge, the range's tail) and blocks it does not, so
    // the common unmasked block carries no per-logit compare/select (a warp-uniform branch).
    auto block = [&](auto masked, int blk) {
      constexpr bool kMasked = decltype(masked)::value;
      const int st = (CROSS ? blocks_done + blk : blk) % STAGES;
      T* ks = k_stage(st);
      const int pos0 = lo + blk * TILE_KV;
      if constexpr (Variant::has_key_transform) {
        transform_k_tile<Tile, TILE_KV, S::threads>(p, var, ks, pos0, kv_head, tid);
        __syncthreads();
      }

      // ---- S = Q K^T, from zero or the linear bias
      float s[MMA_Q][NT][4];
#pragma unroll
      for (int mi = 0; mi < MMA_Q; ++mi) bias[mi].start(s[mi], pos0);
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

      // The next tile's copies between the QK products and the softmax: the loader's integer
      // work then runs while the tensor pipe finishes S (before the products it ran alone).
      if constexpr (CROSS) {
        const int ns = (blocks_done + blk + STAGES - 1) % STAGES;  // the stage block n - 1 used
        stream.issue(ld, p, queue, heads, k_stage(ns), v_stage(ns));
        // The item's last QK^T read this warp's q rows (or they sit in registers): the next
        // item's rows into them, in this block's group (which the next item's first block waits for).
        if constexpr (!Variant::has_query_transform) {
          if (blk == num_blocks - 1 && k + 1 < queue.size) {
            __syncwarp();
            QueryRows next;
            next.load(p, queue.item(k + 1), heads);
            copy_q_rows<Tile, 16 * MMA_Q, 32>(p, q_smem, next, heads, first_qo_head, lane, warp_row0);
            q_copied = true;
          }
        }
        cp_async_commit();
      } else {
        next_kv_tile<STAGES, TILE_KV>(ld, p, it, k_stage, v_stage, blk);
      }

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
      if (q_first_wait && blk == 0) {
        cp_async_wait<0>();  // q may sit in the newest group
      } else {
        cp_async_wait<STAGES - 2>();
      }
      __syncthreads();  // tile blk landed for everyone; everyone is past tile blk - 1
      if (it.template needs_mask<TILE_KV>(p, var, lo + blk * TILE_KV)) {
        block(BoolConst<true>{}, blk);
      } else {
        block(BoolConst<false>{}, blk);
      }
    }
    if constexpr (CROSS) {
      blocks_done += num_blocks;
    } else {
      cp_async_wait<0>();  // only empty groups can remain; the next item refills every stage
    }

    // ---- Epilogue
#pragma unroll
    for (int mi = 0; mi < MMA_Q; ++mi)
      store_group(p, var, sm[mi], o[mi], warp_row0 + mi * 16, rows_valid, heads, first_qo_head, q_row0, partial_row, lane);
  }
}

}  // namespace rtattn
