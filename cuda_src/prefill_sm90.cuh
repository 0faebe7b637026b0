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
//
// CROSS (a tile field, "_x" in its tag): the KV stream runs across the items of the queue
// (QueueKVStream): the next item's first tiles are issued while the current item's last blocks
// compute, and its q rows right after the current item's last QK^T (each warpgroup its own rows,
// once its products are done with them), so an item starts with its pipeline full and the
// epilogue's stores overlap the next item's loads. The same products in the same order: the
// outputs are bitwise those of the per-item stream.
//
// PINGPONG (two warpgroups; "_pp" in the tag): the warpgroups take turns on the tensor cores
// within a block, QK^T of warpgroup 0, then of 1, then PV of 0, then of 1 (named barriers order
// the issues), so each one's softmax runs under the other's products instead of both softmaxes
// at once with the tensor cores idle. The same products on the same operands: bitwise the same
// outputs.
//
// FMA_EXP2 ("_fe"): half of the softmax's exp2 on the FMA pipe (fma_exp2), the other half and a
// soft cap's tanh on the MUFU, whose 16 lanes per clock otherwise bound a soft-capped block.
#pragma once
#include "paged_loader.cuh"
#include "prefill_item.cuh"
#include "prefill_rows.cuh"
#include "swizzle.cuh"
#include "wgmma.cuh"

namespace rtattn {

template <int HEAD_DIM, int WGS, int TILE_KV, int STAGES, int ELEM_BYTES>
struct PrefillSm90Shape : Sw128TileStages<HEAD_DIM, 64 * WGS, 1, TILE_KV, STAGES, ELEM_BYTES> {
  static constexpr int rows = 64 * WGS;
  static constexpr int threads = 128 * WGS;
};

// Warpgroup u's 128 threads meet (named barrier 1 + u; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int u) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + u) : "memory"); }

// PINGPONG's turns, between the two warpgroups (256 threads): one warpgroup arrives once its
// products are issued, the other waits there before issuing its own. Barriers 3-5 (1, 2 are
// warpgroup_sync's), each used once per block between the block's __syncthreads.
struct WarpgroupTurns {
  enum : int { kQK1 = 3, kPV0 = 4, kPV1 = 5 };  // the turn of: QK^T of 1, PV of 0, PV of 1
  template <int ID>
  static __device__ __forceinline__ void wait() { asm volatile("bar.sync %0, 256;\n" ::"n"(ID) : "memory"); }
  template <int ID>
  static __device__ __forceinline__ void pass() { asm volatile("bar.arrive %0, 256;\n" ::"n"(ID) : "memory"); }
  // Before / after this warpgroup's (wg: 0 or 1) QK^T and PV issues.
  static __device__ __forceinline__ void before_qk(int wg) { if (wg == 1) wait<kQK1>(); }
  static __device__ __forceinline__ void after_qk(int wg) { wg == 0 ? pass<kQK1>() : pass<kPV0>(); }
  static __device__ __forceinline__ void before_pv(int wg) { wg == 0 ? wait<kPV0>() : wait<kPV1>(); }
  static __device__ __forceinline__ void after_pv(int wg) { if (wg == 0) pass<kPV1>(); }
};

template <class Variant, class P, int WGS, int TILE_KV, int STAGES, bool PAGED, bool CROSS = false,
          bool PINGPONG = false, bool FMA_EXP2 = false>
__device__ __forceinline__ void prefill_sm90_persistent(const P& p, char* smem) {
  static_assert(!PINGPONG || WGS == 2, "turns are taken between two warpgroups");
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using S = PrefillSm90Shape<D, WGS, TILE_KV, STAGES, sizeof(T)>;
  using QTile = Sw128Tile<D, S::rows>;
  using KVTile = Sw128Tile<D, TILE_KV>;
  using Loader = KVTileLoader<T, D, TILE_KV, S::threads, PAGED, kPrefillKvEvictFirst, KVTile>;
  constexpr int NT = TILE_KV / 8;  // 8-column chunks of S
  constexpr int KS = TILE_KV / 16; // k-steps of PV
  constexpr int DT = D / 8;        // 8-column chunks of O

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y;
  const int heads = p.group_size;
  const int first_qo_head = kv_head * heads;
  const int warp_row0 = warp * 16;
  const int wg = warp / 4;

  T* q_smem = reinterpret_cast<T*>(smem);
  auto k_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes); };
  auto v_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes + S::tile_bytes); };
  const uint32_t q_base = smem_addr(q_smem) + wg * 64 * 128;  // this warpgroup's 64 rows

  PrefillQueue queue;
  queue.init(p);
  Loader ld;
  ld.init(p, kv_head, tid);
  __shared__ OnesTile<T> ones;
  if constexpr (kTcRowSum) ones.fill(tid, S::threads);  // published by the first block's barrier
  const uint64_t ones_desc = kTcRowSum ? ones.desc() : 0;

  wait_for_previous_grid();  // programmatic dependent launch, as the mma.sync kernel
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
        // q's last copies (an item without KV tiles took them) landed; every warpgroup is done with q
        if (!Variant::has_query_transform && k > 0) cp_async_wait<0>();
        __syncthreads();
        if constexpr (Variant::has_query_transform) {
          transform_q_rows<QTile, S::rows, S::threads>(p, var, q_smem, it, heads, first_qo_head, tid);
        } else {
          copy_q_rows<QTile, S::rows, S::threads>(p, q_smem, it, heads, first_qo_head, tid);
        }
      }
      if (k == 0) {
        stream.template start<STAGES>(ld, p, queue, heads, k_stage, v_stage);
      } else if (!q_copied) {
        cp_async_commit();  // q's own group: the first block waits for every group
      }
      q_copied = false;
    } else {
      if (tid == 0) prefetch_next_items<PAGED>(p, queue, k);  // the next items' plan fields into L1
      __syncthreads();  // the previous item's products are done with q and every stage
      // ---- Query rows (cp.async, joining the first KV group; or through registers with a
      // QueryTransform: the first block's fence and barrier publish those stores to the tensor
      // cores) and the KV stream's first tiles.
      if constexpr (!Variant::has_query_transform) copy_q_rows<QTile, S::rows, S::threads>(p, q_smem, it, heads, first_qo_head, tid);
      start_kv_stream<STAGES, TILE_KV>(ld, p, it, k_stage, v_stage);
      if constexpr (Variant::has_query_transform)
        transform_q_rows<QTile, S::rows, S::threads>(p, var, q_smem, it, heads, first_qo_head, tid);
    }

    int row_qo_idx[2], row_qo_head[2];
    auto row_ids = [&] {
      group_row_ids(row_qo_idx, row_qo_head, warp_row0, rows_valid, heads, qo_idx0, first_qo_head, lane);
    };
    if constexpr (Variant::has_logits_transform || Variant::has_linear_bias) row_ids();
    GroupBias<Variant> bias;
    bias.init(p, var, row_qo_idx, row_qo_head, lane);

    float o[DT][4];
    GroupSoftmax<Variant, P, NT, DT, FMA_EXP2, kTcRowSum> sm;
    sm.reset(logits_bound(p, var));
    zero_accumulators(o);

    auto block = [&](auto masked, int blk) {
      constexpr bool kMasked = decltype(masked)::value;
      const int st = (CROSS ? blocks_done + blk : blk) % STAGES;
      T* ks = k_stage(st);
      const int pos0 = lo + blk * TILE_KV;
      if constexpr (Variant::has_key_transform) {
        transform_k_tile<KVTile, TILE_KV, S::threads>(p, var, ks, pos0, kv_head, tid);
        fence_proxy_async();
        __syncthreads();
      }

      // ---- S = Q K^T (asynchronous; the next tile's copies are issued meanwhile)
      float s[NT][4];
      bias.start(s, pos0);  // wgmma adds q.k to it from the first k-step on
      const uint32_t k_base = smem_addr(ks);
      if constexpr (PINGPONG) WarpgroupTurns::before_qk(wg);
      wgmma_fence();
      wgmma_qk<T, TILE_KV, D>(s, q_base, QTile::slab_bytes, k_base, KVTile::slab_bytes, Variant::has_linear_bias);
      wgmma_commit();
      if constexpr (PINGPONG) WarpgroupTurns::after_qk(wg);
      if constexpr (CROSS) {
        const int ns = (blocks_done + blk + STAGES - 1) % STAGES;  // the stage block n - 1 used
        stream.issue(ld, p, queue, heads, k_stage(ns), v_stage(ns));
      } else {
        next_kv_tile<STAGES, TILE_KV>(ld, p, it, k_stage, v_stage, blk);
      }
      wgmma_wait<0>();
      fence_accumulators(s);
      if constexpr (CROSS) {
        // The item's last QK^T is done: the next item's q rows into this warpgroup's rows, in
        // this block's group (which the next item's first block waits for).
        if constexpr (!Variant::has_query_transform) {
          if (blk == num_blocks - 1 && k + 1 < queue.size) {
            warpgroup_sync(wg);
            QueryRows next;
            next.load(p, queue.item(k + 1), heads);
            copy_q_rows<QTile, 64, 128>(p, q_smem, next, heads, first_qo_head, tid % 128, 64 * wg);
            q_copied = true;
          }
        }
        cp_async_commit();
      }

      if constexpr (kMasked && Variant::has_logits_mask && !Variant::has_logits_transform) row_ids();
      uint32_t pa[KS][4];
      logits_to_p<kMasked>(p, var, sm, s, o, pa, pos0, hi, row_qo_idx, row_qo_head, kv_head, lane);

      // ---- O += P V
      const uint32_t v_base = smem_addr(v_stage(st));
      fence_accumulators(o);
      sm.fence_sums();
      if constexpr (PINGPONG) WarpgroupTurns::before_pv(wg);
      wgmma_fence();
      wgmma_pv<T, TILE_KV, D>(o, pa, v_base, KVTile::slab_bytes);
      if constexpr (decltype(sm)::tc_sum) wgmma_rowsum<T, TILE_KV>(sm.lacc, pa, ones_desc);
      wgmma_commit();
      if constexpr (PINGPONG) WarpgroupTurns::after_pv(wg);
      wgmma_wait<0>();
      fence_accumulators(o);
      sm.fence_sums();
    };

    for (int blk = 0; blk < num_blocks; ++blk) {
      if (CROSS && !Variant::has_query_transform && blk == 0 && k > 0) {
        cp_async_wait<0>();  // q may sit in the newest group (the queue's first q: in the first)
      } else {
        cp_async_wait<STAGES - 2>();
      }
      fence_proxy_async();
      __syncthreads();  // tile blk (and q) landed for everyone; everyone is past tile blk - 1
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

    store_group(p, var, sm, o, warp_row0, rows_valid, heads, first_qo_head, q_row0, partial_row, lane);
  }
}

}  // namespace rtattn
