// Persistent prefill attention on Hopper, warp-specialized (sm_90a): the prefill family's
// third kernel, on the same params, plan, work queues, variant hooks and outputs as the others
// (prefill.cuh, prefill_sm90.cuh), whose item fields, loader, logits and epilogue it shares.
//
// A CTA is three warpgroups over a 128-row tile (rows = token r / g, head r % g):
//   producer (warpgroup 2, few registers): walks the CTA's queue and fills STAGES K and V slots
//     (cp.async through the paged loader) and two q tiles, one item after another, each copy
//     announced on an mbarrier ("full") once it has landed, each slot reused once the consumers
//     have announced it "empty"; each item's plan fields travel with its q tile. It never waits
//     for the tensor cores, only for slots.
//   consumers (warpgroups 0 and 1, the registers the producer gave back): rows [64u, 64u + 64)
//     of the tile, as the wgmma kernel's warpgroups. Per KV block n they issue S(n) = Q K(n)^T
//     and O += P(n-1) V(n-1) together, then weigh S(n) while PV(n-1) runs (the softmax under the
//     product), then rescale O and pack P(n). The two consumers take turns issuing (named
//     barriers 1 and 2), so one's softmax runs under the other's products.
// Nothing waits at a CTA-wide barrier after the start: an item's prologue (plan fields, page ids,
// first tiles, q) is the producer's, during the previous item's last blocks and epilogue, and a
// consumer's epilogue overlaps the next item's loads. Variants that transform q or K do it in the
// producer, on the landed copies, before announcing them.
#pragma once
#include "mbarrier.cuh"
#include "paged_loader.cuh"
#include "prefill_item.cuh"
#include "prefill_rows.cuh"
#include "swizzle.cuh"
#include "wgmma.cuh"

namespace rtattn {

// Two q tiles: the next item's q lands while the current item's blocks compute (one tile would
// leave its copy to the gap between an item's last QK^T and the next item's first).
template <int HEAD_DIM, int TILE_KV, int STAGES, int ELEM_BYTES>
struct PrefillWsShape : Sw128TileStages<HEAD_DIM, 128, 2, TILE_KV, STAGES, ELEM_BYTES> {
  static constexpr int rows = 128;
  static constexpr int consumer_threads = 256;
  static constexpr int threads = consumer_threads + 128;
  // 64K registers per SM, one CTA: the producer 88 per thread (its loader holds a tile's page ids and
  // rows; fewer spill), the consumers 208 (S, P and O of 64 rows at d128 kv128 without a spill).
  static constexpr int producer_regs = 88, consumer_regs = 208;
  static_assert(128 * producer_regs + consumer_threads * consumer_regs <= 65536, "the register file");
};

// The handshakes, per slot: "full" (the producer's 128 threads arrive once their copies landed)
// and "empty" (the consumers' 8 warps arrive once their products read it; for q, every consumer
// thread, since each reads the item's fields itself and one lane's arrival would not order the other
// lanes' reads before the producer's next write, a race under racecheck). K and V of a stage are
// separate slots: K(n) is free once S(n) is computed, V(n) only after PV(n), a block later, so the
// producer refills each as early as it can (one whole block of latency hidden, where one slot for
// both would leave the next tile's copies none at two stages). The same pair for q.
struct WsSlot {
  uint64_t full, empty;
  __device__ __forceinline__ void init(int producers = 128, int consumers = 8) {
    mbar_init(&full, producers);
    mbar_init(&empty, consumers);
  }
};
// A q slot also carries its item (below): the producer's thread 0 arrives once more, after writing it.
template <int STAGES>
struct WsBarriers {
  WsSlot k[STAGES], v[STAGES], q[2];
  __device__ __forceinline__ void init() {
    for (int s = 0; s < STAGES; ++s) {
      k[s].init();
      v[s].init();
    }
    q[0].init(128 + 1, 256);
    q[1].init(128 + 1, 256);
  }
};

// An item as the producer read it (plan fields, the variant initialized for its request), handed to
// the consumers in shared memory with its q tile (queue position k: q slot k % 2): the consumers
// read no plan field, so entering an item waits on no global round trip.
template <class Variant>
struct WsItem {
  PrefillItem<Variant> it;
  Variant var;
};

// The consumers' turns at the tensor cores: consumer u waits at barrier 1 + u for the other's
// pass (256 threads: its own 128 waiting, the other's 128 arriving), issues, then passes.
struct ConsumerTurns {
  static __device__ __forceinline__ void wait(int u) { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + u) : "memory"); }
  static __device__ __forceinline__ void pass(int u) { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - u) : "memory"); }
};

// Pipeline position n (counted over the CTA's whole stream): its stage and the parity of its round.
template <int STAGES>
struct StagePos {
  static __device__ __forceinline__ int stage(int n) { return n % STAGES; }
  static __device__ __forceinline__ uint32_t parity(int n) { return uint32_t(n / STAGES) & 1u; }
};

template <class Variant, class P, int TILE_KV, int STAGES, bool PAGED, class Bars, class KStage, class VStage>
__device__ __forceinline__ void prefill_ws_produce(const P& p, const PrefillQueue& queue, Bars& bars,
                                                   WsItem<Variant>* handoff, typename P::DType* q_smem,
                                                   KStage k_stage, VStage v_stage, int ptid) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using QTile = Sw128Tile<D, 128>;
  using KVTile = Sw128Tile<D, TILE_KV>;
  // (ptxas, NVRTC 13.0: this kernel's evict-first copies read a uniform register nothing writes,
  // the fp8 miscompile of ptx.cuh; tools/scan_sass.py finds it. PrefillTile refuses the pair.)
  static_assert(!kPrefillKvEvictFirst, "the warp-specialized kernel keeps L2's normal policy");
  using Loader = KVTileLoader<T, D, TILE_KV, 128, PAGED, false, KVTile>;
  using Pos = StagePos<STAGES>;
  const int kv_head = blockIdx.y, heads = p.group_size, first_qo_head = kv_head * heads;
  Loader ld;
  ld.init(p, kv_head, ptid);
  int n = 0;  // tiles issued so far
  for (int k = 0; k < queue.size; ++k) {
    Variant var;
    PrefillItem<Variant> it;
    it.template load<TILE_KV>(p, queue.item(k), heads, var);
    if (ptid == 0) prefetch_next_items<PAGED>(p, queue, k);  // the next items' plan fields into L1
    WsSlot& qs = bars.q[k & 1];
    T* q_tile = q_smem + (k & 1) * 128 * D;
    mbar_wait(&qs.empty, ((k >> 1) & 1) ^ 1);
    if (ptid == 0) {
      handoff[k & 1] = {it, var};
      mbar_arrive(&qs.full);
    }
    if (it.num_blocks == 0) {  // the consumers write its rows without q or KV
      mbar_arrive(&qs.full);
      continue;
    }
    if constexpr (Variant::has_query_transform) {
      transform_q_rows<QTile, 128, 128>(p, var, q_tile, it, heads, first_qo_head, ptid);
      fence_proxy_async();
      mbar_arrive(&qs.full);
    } else {
      copy_q_rows<QTile, 128, 128, true>(p, q_tile, it, heads, first_qo_head, ptid);
      mbar_arrive_on_copies(&qs.full);
    }
    ld.fetch(p, it.pages, it.page_start, it.lo, it.hi);
    for (int blk = 0; blk < it.num_blocks; ++blk, ++n) {
      const int s = Pos::stage(n), pos0 = it.lo + blk * TILE_KV;
      mbar_wait(&bars.k[s].empty, Pos::parity(n) ^ 1);
      ld.template issue<true, false>(p, k_stage(s), v_stage(s), pos0, it.hi);
      if constexpr (Variant::has_key_transform) {
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("bar.sync 3, 128;\n" ::: "memory");  // the producer's copies of the tile landed
        transform_k_tile<KVTile, TILE_KV, 128>(p, var, k_stage(s), pos0, kv_head, ptid);
        fence_proxy_async();
        mbar_arrive(&bars.k[s].full);
      } else {
        mbar_arrive_on_copies(&bars.k[s].full);
      }
      mbar_wait(&bars.v[s].empty, Pos::parity(n) ^ 1);
      ld.template issue<false, true>(p, k_stage(s), v_stage(s), pos0, it.hi);
      ld.fetch(p, it.pages, it.page_start, pos0 + TILE_KV, it.hi);
      mbar_arrive_on_copies(&bars.v[s].full);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();  // no copy outlives its thread
}

template <class Variant, class P, int TILE_KV, int STAGES, bool FMA_EXP2, class Bars, class KStage, class VStage>
__device__ __forceinline__ void prefill_ws_consume(const P& p, const PrefillQueue& queue, Bars& bars,
                                                   const WsItem<Variant>* handoff, typename P::DType* q_smem,
                                                   const OnesTile<typename P::DType>& ones, KStage k_stage,
                                                   VStage v_stage, int tid) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  using QTile = Sw128Tile<D, 128>;
  using KVTile = Sw128Tile<D, TILE_KV>;
  using Pos = StagePos<STAGES>;
  constexpr int NT = TILE_KV / 8;  // 8-column chunks of S
  constexpr int KS = TILE_KV / 16; // k-steps of PV
  constexpr int DT = D / 8;        // 8-column chunks of O
  const int warp = tid / 32, lane = tid % 32, wg = warp / 4, warp_row0 = warp * 16;
  const int kv_head = blockIdx.y, heads = p.group_size, first_qo_head = kv_head * heads;
  uint32_t q_base = 0;  // this warpgroup's 64 rows of the item's q tile
  auto issue_qk = [&](float (&s)[NT][4], int st) {
    wgmma_qk<T, TILE_KV, D>(s, q_base, QTile::slab_bytes, smem_addr(k_stage(st)), KVTile::slab_bytes,
                            Variant::has_linear_bias);
    wgmma_commit();
  };
  const uint64_t ones_desc = kTcRowSum ? ones.desc() : 0;
  auto issue_pv = [&](float (&o)[DT][4], float (&lacc)[1][4], const uint32_t (&pa)[KS][4], int st) {
    wgmma_pv<T, TILE_KV, D>(o, pa, smem_addr(v_stage(st)), KVTile::slab_bytes);
    if constexpr (kTcRowSum && Variant::use_softmax) wgmma_rowsum<T, TILE_KV>(lacc, pa, ones_desc);
    wgmma_commit();
  };

  if (wg == 1) ConsumerTurns::pass(1);  // consumer 0 issues first
  int n = 0;  // tiles consumed so far
  for (int k = 0; k < queue.size; ++k) {
    WsSlot& qs = bars.q[k & 1];
    mbar_wait(&qs.full, (k >> 1) & 1);
    PrefillItem<Variant> it = handoff[k & 1].it;
    Variant var = handoff[k & 1].var;
    const int lo = it.lo, hi = it.hi, nb = it.num_blocks;
    if (nb == 0) mbar_arrive(&qs.empty);  // its fields are read: the slot is free
    int row_qo_idx[2], row_qo_head[2];
    group_row_ids(row_qo_idx, row_qo_head, warp_row0, it.rows_valid, heads, it.qo_idx0, first_qo_head, lane);
    GroupBias<Variant> bias;
    bias.init(p, var, row_qo_idx, row_qo_head, lane);
    float o[DT][4];
    GroupSoftmax<Variant, P, NT, DT, FMA_EXP2, kTcRowSum> sm;
    sm.reset(logits_bound(p, var));
    zero_accumulators(o);

    // Block blk's logits (landed in s) -> weights, the factor O takes in corr; its K slot released,
    // and q once the item's last logits are weighed.
    auto weigh = [&](float (&s)[NT][4], int blk, float (&corr)[2]) {
      fence_accumulators(s);
      mbar_arrive_warp(&bars.k[Pos::stage(n + blk)].empty, lane);
      const int pos0 = lo + blk * TILE_KV;
      if (it.template needs_mask<TILE_KV>(p, var, pos0)) {
        mask_logits<true>(p, var, s, pos0, hi, row_qo_idx, row_qo_head, kv_head, lane);
      } else {
        mask_logits<false>(p, var, s, pos0, hi, row_qo_idx, row_qo_head, kv_head, lane);
      }
      sm.weigh(s, logits_scale(p, var), corr);
      // After the softmax, not before it: this branch ends the softmax's basic block, and ptxas
      // hoists the PV's wait (WARPGROUP.DEPBAR) to the top of the block that holds it -- in the
      // softmax's block, the softmax ran after the product instead of under it (SASS, cuobjdump).
      // The __syncwarp keeps it a branch: a lone arrival was predicated instead, the blocks merged
      // and only 5 of 32 exponentials stayed under PV (tools/scan_sass.py checks).
      if (blk == nb - 1) {
        __syncwarp();
        mbar_arrive(&qs.empty);
      }
    };

    if (nb > 0) {
      q_base = smem_addr(q_smem + (k & 1) * 128 * D) + wg * 64 * 128;
      float s[NT][4], corr[2];
      uint32_t pa[KS][4];
      // Block 0: S alone.
      int st = Pos::stage(n);
      ConsumerTurns::wait(wg);
      mbar_wait(&bars.k[st].full, Pos::parity(n));
      fence_proxy_async();
      if constexpr (Variant::has_linear_bias) bias.start(s, lo);  // else the first k-step overwrites S
      wgmma_fence();
      issue_qk(s, st);
      ConsumerTurns::pass(wg);
      wgmma_wait<0>();
      weigh(s, 0, corr);
      pack_p<T>(s, pa);
      // Blocks 1 .. nb-1: S(blk) and PV(blk - 1) in flight together, S weighed under PV.
      for (int blk = 1; blk < nb; ++blk) {
        const int prev = st;
        st = Pos::stage(n + blk);
        ConsumerTurns::wait(wg);
        mbar_wait(&bars.k[st].full, Pos::parity(n + blk));
        mbar_wait(&bars.v[prev].full, Pos::parity(n + blk - 1));
        fence_proxy_async();
        if constexpr (Variant::has_linear_bias) bias.start(s, lo + blk * TILE_KV);
        fence_accumulators(o);
        sm.fence_sums();
        wgmma_fence();
        issue_qk(s, st);
        issue_pv(o, sm.lacc, pa, prev);
        ConsumerTurns::pass(wg);
        wgmma_wait<1>();
        weigh(s, blk, corr);
        wgmma_wait<0>();
        fence_accumulators(o);
        sm.fence_sums();
        mbar_arrive_warp(&bars.v[prev].empty, lane);
        pack_p<T>(s, pa);
        sm.rescale(o, corr);
      }
      // The last PV.
      ConsumerTurns::wait(wg);
      mbar_wait(&bars.v[st].full, Pos::parity(n + nb - 1));
      fence_proxy_async();
      fence_accumulators(o);
      sm.fence_sums();
      wgmma_fence();
      issue_pv(o, sm.lacc, pa, st);
      ConsumerTurns::pass(wg);
      wgmma_wait<0>();
      fence_accumulators(o);
      sm.fence_sums();
      mbar_arrive_warp(&bars.v[st].empty, lane);
      n += nb;
    }
    store_group(p, var, sm, o, warp_row0, it.rows_valid, heads, first_qo_head, it.q_row0, it.partial_row, lane);
  }
}

template <class Variant, class P, int TILE_KV, int STAGES, bool PAGED, bool FMA_EXP2 = false>
__device__ __forceinline__ void prefill_ws_persistent(const P& p, char* smem) {
  using T = typename P::DType;
  using S = PrefillWsShape<P::head_dim, TILE_KV, STAGES, sizeof(T)>;
  __shared__ WsBarriers<STAGES> bars;
  __shared__ WsItem<Variant> handoff[2];
  __shared__ OnesTile<T> ones;
  T* q_smem = reinterpret_cast<T*>(smem);
  auto k_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes); };
  auto v_stage = [&](int s) { return reinterpret_cast<T*>(smem + S::q_bytes + s * S::stage_bytes + S::tile_bytes); };
  const int tid = threadIdx.x;
  if (tid == 0) bars.init();
  if constexpr (kTcRowSum) ones.fill(tid, S::threads);
  PrefillQueue queue;
  queue.init(p);
  __syncthreads();  // the barriers are initialized for everyone

  wait_for_previous_grid();  // programmatic dependent launch, as the other prefill kernels
  allow_next_grid();

  if (tid >= S::consumer_threads) {
    warpgroup_release_registers<S::producer_regs>();
    prefill_ws_produce<Variant, P, TILE_KV, STAGES, PAGED>(p, queue, bars, handoff, q_smem, k_stage, v_stage,
                                                           tid - S::consumer_threads);
  } else {
    warpgroup_claim_registers<S::consumer_regs>();
    prefill_ws_consume<Variant, P, TILE_KV, STAGES, FMA_EXP2>(p, queue, bars, handoff, q_smem, ones, k_stage,
                                                              v_stage, tid);
  }
}

}  // namespace rtattn
