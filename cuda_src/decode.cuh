// Persistent paged-KV decode attention on tensor cores (mma.sync m16n8k16).
//
// Grid (num_ctas, num_kv_heads), fixed for the life of a wrapper so a CUDA graph stays valid
// while plans change. CTA (c, y) walks work queue c of the plan; each item is (request, up to
// tile_q query tokens, KV token range). Head-group fusion: the g query heads that share KV head
// y are folded into the row axis (rows = tokens x heads, at most 16*M_TILES), so each K/V byte
// is loaded once for all of them. Each warp owns 16 of the block's tokens and keeps its own
// online-softmax state; the warps' states are combined with the merge operator at the end of
// the item, then written as final O (writethrough) or a float32 partial row that the merge
// kernel (merge.cuh) folds in the plan's fixed order.
//
// The KV loads form one stream over all of the CTA's items: the loader runs STAGES-1 blocks
// ahead of the compute and crosses item boundaries, so the next item's first blocks are in
// flight while this item is combined and written. The page ids of the loader's next block are
// read one block ahead, so issuing a block never waits on an L2 round trip.
#pragma once
#include "fp8.cuh"
#include "merge.cuh"
#include "online_softmax.cuh"
#include "ptx.cuh"
#include "query_transform.cuh"
#include "state_fold.cuh"
#include "swizzle.cuh"

namespace rtattn {

// Batch-invariant kernels keep an item's folded state after DecodeShape's smem_bytes: o [rows][D],
// then the (m, l) of rows twice (the chunk being folded reads one, writes the other: no race
// between rows). A function, not a DecodeShape member: a new static member would move the other kernels'
// constant-bank slots, and their SASS is to stay byte-identical.
__host__ __device__ constexpr int fold_state_bytes(int rows, int head_dim) { return rows * (head_dim + 4) * 4; }

template <int HEAD_DIM, int M_TILES, int NUM_WARPS, int STAGES, int KV_BYTES>
struct DecodeShape : SwizzledRows<HEAD_DIM> {  // at(), kstep(): the 16-bit q/K/V tiles' swizzle
  static constexpr int rows = 16 * M_TILES;
  static constexpr int threads = NUM_WARPS * 32;
  static constexpr int block_tokens = NUM_WARPS * 16;
  static constexpr int kv_chunk = 16 / KV_BYTES;                    // KV elements per 16-byte chunk
  static constexpr int vecs_per_row = HEAD_DIM / kv_chunk;          // 16-byte chunks per KV row
  static constexpr int token_step = threads / vecs_per_row;         // threads per 16-byte column
  static constexpr int load_iters = block_tokens / token_step;      // consecutive tokens a thread copies per block
  static constexpr int stage_elems = block_tokens * HEAD_DIM;       // K, then V, of one block
  static constexpr int combine_bytes = NUM_WARPS * 16 * (HEAD_DIM + 2) * 4;  // one 16-row tile
  // A stage also holds the warps' combine at an item's end: 512 bytes more than 16-bit K and V.
  static constexpr int stage_bytes = combine_bytes > 2 * stage_elems * KV_BYTES ? combine_bytes : 2 * stage_elems * KV_BYTES;
  static constexpr int kv_bytes = STAGES * stage_bytes;
  static constexpr int q_bytes = rows * HEAD_DIM * 2;               // q is 16-bit
  // fp8 K widened for a KeyTransform lives after the stage's fp8 K and V (the combine's room).
  static constexpr int widened_k_offset = 2 * stage_elems * KV_BYTES;
  static constexpr int smem_bytes = q_bytes + kv_bytes;

  // The 16-bit tiles use SwizzledRows unchanged (unpadded rows keep a warp's cp.async on whole
  // 32-byte sectors: padded rows cost 1.5x the L2 sector traffic on the H200, docs/perf-log.md v4).
  // kv_at: the same swizzle for the KV tiles, in KV elements. fp8 rows of 64 bytes (d64) hold only 4
  // chunks: unswizzled (two rows share a line; the K reads below stay conflict-free, the V reads
  // are 4-way: d64 moves the fewest bytes).
  static constexpr int kv_swizzle = vecs_per_row >= 8 ? 7 : 0;
  static __device__ __forceinline__ int kv_at(int row, int chunk) {
    return row * HEAD_DIM + (chunk ^ (row & kv_swizzle)) * kv_chunk;
  }
  // fp8 fragments are read from the tiles with 16-byte loads, not ldmatrix, in a column order
  // that the products do not see (see decode_persistent). K: thread t (lane % 4) of a row holds
  // the D/4 elements of its chunks k_chunk(t, c) (two adjacent chunks per 128-byte line), whose
  // 4-byte words are the fragments of k-steps 4c .. 4c+3. V: lane/4 = n reads chunk(s) v_chunk(n,
  // s) of rows 2t, 2t+1, 2t+8, 2t+9; byte j is output n-tile 16s + j, so O's column n of n-tile
  // dn is element o_col(dn, n) (d64: 8 bytes per row, n-tile j, column 8n + j).
  static __device__ __forceinline__ int k_chunk(int t, int c) {
    return HEAD_DIM == 64 ? t : (c / 2) * 8 + 2 * t + c % 2;
  }
  static __device__ __forceinline__ int o_col(int dn, int n) {
    return HEAD_DIM == 64 ? n * 8 + dn : (dn / 16) * 128 + n * 16 + dn % 16;
  }

  static_assert((load_iters & (load_iters - 1)) == 0, "a loader run is a power of two of rows (its swizzle)");
  static_assert(threads % vecs_per_row == 0 && block_tokens % token_step == 0, "threads must cover whole rows");
  static_assert(STAGES >= 2, "the pipeline needs a stage to compute and one in flight");
  static_assert(stage_bytes % 128 == 0 && q_bytes % 128 == 0, "tiles start on 128-byte lines");
  static_assert(KV_BYTES == 2 || widened_k_offset + stage_elems * 2 <= stage_bytes, "widened K fits the stage");
};

// Merges the rows of split tile `entry0` (entries entry0 .. + q_tokens - 1) for query heads
// [head0, head0 + heads): four columns per (row, head, column group) unit; when units are fewer
// than threads, S consecutive lanes share a unit, each folding every S-th partial (StateFold, as
// the merge kernel), then fold each other's states in a butterfly. Writes O (and LSE).
// Batch-invariant (INVARIANT): a unit per thread, its partials folded in order (fold_partials).
template <class Variant, class P, bool INVARIANT>
__device__ __forceinline__ void merge_tile(const P& p, Variant& var, int entry0, int q_tokens, int head0, int heads,
                                           int tid) {
  using O = typename P::OType;
  constexpr int D = P::head_dim, C4 = D / 4, KU = 16;
  const int H = p.num_qo_heads, units = q_tokens * heads * C4;
  if constexpr (INVARIANT) {
    for (int u = tid; u < units; u += blockDim.x) {
      const int c = u % C4 * 4, head = head0 + u / C4 % heads, e = entry0 + u / C4 / heads;
      const int first = p.plan.merge_indptr[e], n = p.plan.merge_indptr[e + 1] - first;
      float o[4], m, l;
      fold_partials<4, 8, true>(p, p.plan.merge_partial_start[e], p.plan.merge_partial_stride[e], n, head, c, o, m, l);
      write_folded<Variant, P, 4>(p, var, p.plan.merge_qo_row[e], head, c, o, m, l);
    }
    return;
  }
  int S = 1;
  while (S < 8 && 2 * S * units <= int(blockDim.x)) S *= 2;
  for (int i0 = 0; i0 < units * S; i0 += blockDim.x) {  // uniform trip count: every lane shuffles
    const int i = i0 + tid, part = i % S;
    const bool active = i < units * S;
    const int u = active ? i / S : 0;
    const int c = u % C4 * 4, head = head0 + u / C4 % heads, e = entry0 + u / C4 / heads;
    const int first = p.plan.merge_indptr[e], n = active ? p.plan.merge_indptr[e + 1] - first : 0;
    const int start = p.plan.merge_partial_start[e], step = p.plan.merge_partial_stride[e];
    StateFold<Variant::use_softmax, 4> fold;
    for (int k0 = part; k0 < n; k0 += KU * S) {
      float l[KU], v[KU][4];
#pragma unroll
      for (int k = 0; k < KU; ++k) {
        const bool ok = k0 + k * S < n;
        const int64_t prow = ok ? int64_t(start + (k0 + k * S) * step) * H + head : 0;
        const float4 o4 = ok ? __ldcg(reinterpret_cast<const float4*>(p.partial_o + prow * D + c))
                             : make_float4(0.f, 0.f, 0.f, 0.f);
        l[k] = ok ? __ldcg(p.partial_lse + prow) : -INFINITY;
        v[k][0] = o4.x, v[k][1] = o4.y, v[k][2] = o4.z, v[k][3] = o4.w;
      }
      fold.round(l, v);
    }
    for (int mask = 1; mask < S; mask *= 2) fold.fold_lanes(mask);
    if (!active || part != 0) continue;
    if constexpr (Variant::has_sink) fold.add_sink(var.SinkLogit(p, head));  // once per row: here
    const int q_row = p.plan.merge_qo_row[e];
    O* op = p.o + int64_t(q_row) * p.o_stride_tok + int64_t(head) * p.o_stride_head + c;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float x = fold.out(j);
      if constexpr (Variant::has_output_transform) x = var.OutputTransform(p, x, head, c + j);
      op[j] = from_float<O>(x);
    }
    if (p.lse != nullptr && c == 0) p.lse[int64_t(q_row) * H + head] = fold.lse();
  }
}

#ifdef RTATTN_LEVEL_JOIN
// RTATTN_LEVEL_JOIN (a cascade's decode build, codegen spec `level_join`; with
// RTATTN_INDEPENDENT_LEVEL): a writethrough item of the last level with a merge entry joins its
// rows' earlier-level states -- the previous grid's (the prefill level's), rows start + k * step
// of the partial states for entry e -- before writing: their fold (level, KV order), then the
// row's own state last, so no fold kernel follows. Two columns per thread, as the combine's.
// Rounds of 17 states: a shared level of 8 query tiles split over the 264-CTA grid gives a row 33
// (two rounds, not three of 16). H200, p32768x16: 50.0 us at 8 a round, 48.4 at 16, 47.2 at 17,
// 47.3 at 33 -- which cost p1024x64 and p8192x64 4 us; 17 costs them 0.7 (docs/perf-log.md).
#ifndef RTATTN_DEV_JOIN_KU
#define RTATTN_DEV_JOIN_KU 17
#endif
template <bool SOFTMAX, class P>
__device__ __forceinline__ void join_levels(const P& p, int e, int head, int d, float& o0, float& o1, float& lse) {
  constexpr int D = P::head_dim, KU = RTATTN_DEV_JOIN_KU;
  const int H = p.num_qo_heads;
  const int n = p.plan.merge_indptr[e + 1] - p.plan.merge_indptr[e];
  const int start = p.plan.merge_partial_start[e], step = p.plan.merge_partial_stride[e];
  wait_for_previous_grid();  // the states are complete and visible; returns at once after the first time
  StateFold<SOFTMAX, 2> fold;
  for (int k0 = 0; k0 < n; k0 += KU) {
    float l[KU], v[KU][2];
#pragma unroll
    for (int k = 0; k < KU; ++k) {
      const bool ok = k0 + k < n;
      const int64_t prow = ok ? int64_t(start + (k0 + k) * step) * H + head : 0;
      const float2 x = ok ? __ldcg(reinterpret_cast<const float2*>(p.partial_o + prow * D + d)) : make_float2(0.f, 0.f);
      l[k] = ok ? __ldcg(p.partial_lse + prow) : -INFINITY;  // (another grid's writes: through L2)
      v[k][0] = x.x, v[k][1] = x.y;
    }
    fold.round(l, v);
  }
  const float l_own[1] = {lse};
  const float v_own[1][2] = {{o0, o1}};
  fold.round(l_own, v_own);
  o0 = fold.out(0), o1 = fold.out(1), lse = fold.lse();
}
#endif

// RTATTN_INDEPENDENT_LEVEL (defined by a cascade's decode build, codegen spec `independent`): the
// kernel reads nothing the previous grid writes -- that grid is another cascade level, launched
// first, which waited for the step's inputs before letting this one launch -- so it starts at
// once and waits for that grid only before exiting: the two levels run concurrently, and the
// fold's wait for this grid still covers both. Undefined, the code is as before (same SASS).
// INVARIANT (batch-invariant plans, plan_info chunk_tokens C): an item is a run of C-token chunks
// (items start on chunk boundaries, C is a multiple of BT, so blocks are chunk aligned). Each
// chunk starts a fresh online softmax; its warps' combine gives the chunk's unnormalized state; a
// writethrough item folds the states left to right (fold_weights, fold_acc: in shared memory,
// fold_state_bytes) and normalizes once, a split item writes one partial row per chunk for the
// merge to fold the same way. So a row's bits are its chunks', whatever the batch. With INVARIANT
// false none of it is compiled (the auto kernels' SASS is unchanged).
template <class Variant, class P, int M_TILES, int NUM_WARPS, int STAGES, bool INVARIANT = false>
__device__ __forceinline__ void decode_persistent(const P& p, char* smem) {
  using T = typename P::DType;    // q
  using KV = typename P::KVType;  // the cache: T, or an fp8 tag
  using M = typename MmaType<T, KV>::type;  // tensor-core operands (fp16 for an fp8 cache)
  constexpr int D = P::head_dim;
  using S = DecodeShape<D, M_TILES, NUM_WARPS, STAGES, sizeof(KV)>;
  constexpr int KT = D / 16;  // k-steps of the QK product, also 16-wide column pairs of PV
  constexpr int BT = S::block_tokens;
  // An fp8 cache is widened in registers from 16-byte shared loads (K fragments, V fragments).
  // A KeyTransform needs K in 16-bit first: that block is widened in shared memory instead.
  constexpr bool kFp8 = IsFp8<KV>::value;
  constexpr bool kFp8K = kFp8 && !Variant::has_key_transform;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y;
  const int heads = p.group_size;  // query heads sharing this KV head, fused into rows
  const int first_qo_head = kv_head * heads;

  T* q_smem = reinterpret_cast<T*>(smem);
  auto stage_at = [&](int stage) { return reinterpret_cast<KV*>(smem + S::q_bytes + stage * S::stage_bytes); };

  // Programmatic dependent launch: the plan (written by a host-to-device copy, which every
  // kernel waits for in full) may be read before the previous kernel finishes; q, the KV cache
  // and the workspace only after wait_for_previous_grid().
  const int item_begin = p.plan.work_indptr[blockIdx.x];
  const int item_end = p.plan.work_indptr[blockIdx.x + 1];
#ifdef RTATTN_INDEPENDENT_LEVEL
  // A CTA with no items leaves at once instead of holding its SM slot until the previous grid
  // ends: where that grid leaves slots free, the CTAs with items take them and run beside it.
  // CTA (0, 0) stays for the wait at the exit, so this grid still completes after that one.
  if (item_begin == item_end && (blockIdx.x | blockIdx.y) != 0) return;
#endif

  // ---- KV load stream. Block k of the stream goes to stage k % STAGES. The loader's item
  // fields are read one item ahead (nx_*), its page ids one block ahead (ld_page).
  // Thread (ld_row, ld_vec) copies 16-byte chunk ld_vec of the block's RUN consecutive tokens
  // from ld_row * RUN. Items start on page boundaries, so when a page holds RUN tokens or more
  // (page_runs, uniform) the run shares one page id and its addresses step by the token stride;
  // smaller pages take a page id per token.
  constexpr int RUN = S::load_iters;
  const bool page_runs = (1 << p.page_shift) >= RUN;
  const int slot_mask = (1 << p.page_shift) - 1;
  int ld_item = item_begin, ld_blk = 0, ld_nblk = 0, ld_kv0 = 0, ld_kv1 = 0;
  int nx_kv0 = 0, nx_kv1 = 0, nx_pages = 0;
  const int* ld_pages = p.plan.kv_indices;
  int ld_page[RUN];
  const int ld_vec = tid % S::vecs_per_row, ld_row = tid / S::vecs_per_row * RUN;
  const KV* k_head = p.k_cache + kv_head * p.k_stride_head + ld_vec * S::kv_chunk;
  const KV* v_head = p.v_cache + kv_head * p.v_stride_head + ld_vec * S::kv_chunk;
  // Offset of the run's first row in a tile; row ld_row + i is at (that ^ (i % 8) * chunk) + i
  // rows (ld_row is a multiple of RUN, so row % 8 == (ld_row % 8) ^ (i % 8): the swizzle of kv_at()).
  const int ld_dst = S::kv_at(ld_row, ld_vec);
  const uint64_t kv_policy = evict_first_policy();
  // This lane's ldmatrix rows in a stage at k-step 0: matrix lane/8 of K's x4 is (rows +8*(m/2),
  // chunk m%2) (two n-tiles x two k-halves); of V's transposed x4, (rows +8*(m%2), chunk m/2).
  const uint32_t k_lane = S::at(warp * 16 + (lane / 16) * 8 + lane % 8, lane / 8 % 2) * sizeof(T);
  const uint32_t v_lane = S::at(warp * 16 + (lane / 8 % 2) * 8 + lane % 8, lane / 16) * sizeof(T);

  auto peek_item = [&](int it) {
    if (it < item_end) {
      nx_kv0 = p.plan.item_kv_start[it];
      nx_kv1 = p.plan.item_kv_end[it];
      nx_pages = p.plan.item_kv_page_start[it];
    }
  };
  auto enter_item = [&]() {  // ld_item <- first item at or after it with KV (empty ones have no blocks)
    for (; ld_item < item_end; ++ld_item) {
      ld_kv0 = nx_kv0;
      ld_kv1 = nx_kv1;
      ld_pages = p.plan.kv_indices + nx_pages;
      peek_item(ld_item + 1);
      if (ld_kv1 > ld_kv0) break;
    }
    ld_blk = 0;
    ld_nblk = (ld_kv1 - ld_kv0 + BT - 1) / BT;
  };
  auto fetch_pages = [&]() {
    const int pos0 = ld_kv0 + ld_blk * BT + ld_row;
    if (page_runs) {
      ld_page[0] = (ld_item < item_end && pos0 < ld_kv1) ? ld_pages[pos0 >> p.page_shift] : 0;
    } else {
#pragma unroll
      for (int i = 0; i < RUN; ++i)
        ld_page[i] = (ld_item < item_end && pos0 + i < ld_kv1) ? ld_pages[(pos0 + i) >> p.page_shift] : 0;
    }
  };
  auto copy_token = [&](KV* ks, int i, const KV* kp, const KV* vp, bool valid) {
    KV* dst = ks + ((ld_dst ^ ((i & S::kv_swizzle) * S::kv_chunk)) + i * D);
    if constexpr (kFp8) {  // see cp_async_16_generic: the 32-bit form miscompiles for 1-byte tiles
      cp_async_16_generic(dst, kp, valid, kv_policy);
      cp_async_16_generic(dst + S::stage_elems, vp, valid, kv_policy);
    } else {
      cp_async_16(dst, kp, valid, kv_policy);
      cp_async_16(dst + S::stage_elems, vp, valid, kv_policy);
    }
  };
  auto issue_block = [&](int stage) {  // one commit group per call, empty once the stream ends
    if (ld_item < item_end) {
      KV* ks = stage_at(stage);
      const int pos0 = ld_kv0 + ld_blk * BT + ld_row;
      if (page_runs) {
        const int64_t page = ld_page[0], slot = pos0 & slot_mask;
        const KV* kp = k_head + page * p.k_stride_page + slot * p.k_stride_tok;
        const KV* vp = v_head + page * p.v_stride_page + slot * p.v_stride_tok;
#pragma unroll
        for (int i = 0; i < RUN; ++i) copy_token(ks, i, kp + i * p.k_stride_tok, vp + i * p.v_stride_tok, pos0 + i < ld_kv1);
      } else {
#pragma unroll
        for (int i = 0; i < RUN; ++i) {
          const int64_t page = ld_page[i], slot = (pos0 + i) & slot_mask;
          copy_token(ks, i, k_head + page * p.k_stride_page + slot * p.k_stride_tok,
                     v_head + page * p.v_stride_page + slot * p.v_stride_tok, pos0 + i < ld_kv1);
        }
      }
      if (++ld_blk == ld_nblk) {
        ++ld_item;
        enter_item();
      }
      fetch_pages();
    }
    cp_async_commit();
  };

  // ---- The compute side reads its item fields, and the item's query rows, one item ahead too
  // (where the registers allow: d128 with one row tile; elsewhere it spilled or cost d64 its
  // third CTA per SM): both are in flight while the previous item computes, so an item starts
  // without a round trip.
  constexpr bool kPrefetch = D == 128 && M_TILES == 1;
  struct ItemFields { int b, q_row0, q_tokens, kv_begin, kv_end, partial_row, merge_entry; };
  auto read_item = [&](int it) {
    return ItemFields{p.plan.item_request[it], p.plan.item_qo_start[it], p.plan.item_qo_len[it],
                      p.plan.item_kv_start[it], p.plan.item_kv_end[it], p.plan.item_partial[it],
                      p.plan.item_merge[it]};
  };
  // Query rows (token t, head j) -> row t*heads + j. Each thread loads 8-wide column chunks at d
  // and d + D/2 (the pair a RoPE-style QueryTransform rotates together) as 16-byte vectors.
  constexpr int QV = D / 16;  // chunks per half row
  constexpr int Q_ITERS = (S::rows * QV + S::threads - 1) / S::threads;
  uint4 q_lo[Q_ITERS], q_hi[Q_ITERS];
  auto load_q = [&](const ItemFields& x) {
#pragma unroll
    for (int k = 0; k < Q_ITERS; ++k) {
      const int i = tid + k * S::threads, r = i / QV, c = (i % QV) * 8;
      q_lo[k] = q_hi[k] = make_uint4(0u, 0u, 0u, 0u);
      if (i < S::rows * QV && r < x.q_tokens * heads) {
        const T* qp = p.q + int64_t(x.q_row0 + r / heads) * p.q_stride_tok +
                      int64_t(first_qo_head + r % heads) * p.q_stride_head + c;
        q_lo[k] = *reinterpret_cast<const uint4*>(qp);
        q_hi[k] = *reinterpret_cast<const uint4*>(qp + D / 2);
      }
    }
  };

  ItemFields next_item{};
  if (kPrefetch && item_begin < item_end) next_item = read_item(item_begin);
  peek_item(ld_item);
  enter_item();
  fetch_pages();
#ifndef RTATTN_INDEPENDENT_LEVEL
  wait_for_previous_grid();
#endif
  allow_next_grid();  // a dependent kernel waits for this grid's completion anyway: launch it now
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_block(s);
  // fp8 scales (per tensor, or this CTA's KV head): k_scale folds into the logits' scale (into K
  // itself where a KeyTransform widens K first), v_scale into O at the warps' combine.
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kFp8) {
    k_scale = p.k_scale_f * (p.k_scale != nullptr ? p.k_scale[kv_head * p.k_scale_stride] : 1.f);
    v_scale = p.v_scale_f * (p.v_scale != nullptr ? p.v_scale[kv_head * p.v_scale_stride] : 1.f);
  }
  const float logit_fold = kFp8K ? k_scale : 1.f;
  const float sm_scale = p.sm_scale * logit_fold, sm_scale_log2 = p.sm_scale_log2 * logit_fold;
  if (kPrefetch && item_begin < item_end) load_q(next_item);
  int blocks_done = 0;  // compute position in the stream: stage blocks_done % STAGES is next
  // Batch-invariant: blocks per chunk (C is a multiple of BT: the planner's grain), the fold state.
  const int fold_chunk = INVARIANT ? p.plan.plan_info[RTATTN_PLAN_INFO_CHUNK_TOKENS] : 0;
  const int chunk_blocks = fold_chunk >= BT ? fold_chunk / BT : (1 << 30);
  float* fold_o = reinterpret_cast<float*>(smem + S::smem_bytes);
  float2* fold_ml = reinterpret_cast<float2*>(fold_o + S::rows * D);

  for (int item = item_begin; item < item_end; ++item) {
    const ItemFields cur = kPrefetch ? next_item : read_item(item);
    if (kPrefetch && item + 1 < item_end) next_item = read_item(item + 1);
    if (!kPrefetch) load_q(cur);
    const int b = cur.b, q_row0 = cur.q_row0, q_tokens = cur.q_tokens;
    const int kv_begin = cur.kv_begin, kv_end = cur.kv_end, partial_row = cur.partial_row;
    const int merge_entry = cur.merge_entry;  // the tile's first merge entry (split items)
    const int merge_fan_in = p.fused_merge && merge_entry >= 0
                                 ? p.plan.merge_indptr[merge_entry + 1] - p.plan.merge_indptr[merge_entry] : 0;
    // Per-request values; loads the variant does not use are dead code and vanish.
    const int qo_len = p.plan.req_qo_len[b];
    const int kv_len = p.plan.req_kv_len[b];
    const int qo_idx0 = q_row0 - p.plan.req_qo_start[b];
    const int rows_valid = q_tokens * heads;
    const int num_blocks = (kv_end - kv_begin + BT - 1) / BT;

    Variant var;
    var.init(p, b, qo_len, kv_len);

    // ---- Query rows (loaded one item ahead) -> the q tile, through the QueryTransform hook.
#pragma unroll
    for (int k = 0; k < Q_ITERS; ++k) {
      const int i = tid + k * S::threads, r = i / QV, c = (i % QV) * 8;
      if (i < S::rows * QV) {
        if constexpr (Variant::has_query_transform) {
          if (r < rows_valid)
            transform_query_chunks<T>(var, p, q_lo[k], q_hi[k], c, qo_idx0 + r / heads, first_qo_head + r % heads);
        }
        *reinterpret_cast<uint4*>(q_smem + S::at(r, c / 8)) = q_lo[k];
        *reinterpret_cast<uint4*>(q_smem + S::at(r, (c + D / 2) / 8)) = q_hi[k];
      }
    }
    __syncthreads();
    // One row tile keeps its q fragments in registers for the whole item; two read them from the
    // q tile at every k-step (in registers, their 64 spilled the accumulators: 88 B of stack).
    // (Batch-invariant d256: from the q tile too -- in registers, 200 B of stack in the block loop.)
    constexpr bool kQInRegs = (M_TILES == 1 && !(INVARIANT && D > 128)) || kFp8K;  // fp8: q in the K fragments' column order
    uint32_t q_base[M_TILES];
    uint32_t qa[M_TILES][KT][4];  // (unused, and gone, with two tiles)
#pragma unroll
    for (int mi = 0; mi < M_TILES; ++mi) {
      q_base[mi] = smem_addr(q_smem) + S::at(mi * 16 + (lane / 8 % 2) * 8 + lane % 8, lane / 16) * sizeof(T);
      if constexpr (kFp8K) {  // q in the fp8 K fragments' column order (DecodeShape::k_chunk)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            const int r = mi * 16 + lane / 4 + 8 * h, ch = 2 * S::k_chunk(lane % 4, c);
            const uint4 lo = *reinterpret_cast<const uint4*>(q_smem + S::at(r, ch));
            const uint4 hi = *reinterpret_cast<const uint4*>(q_smem + S::at(r, ch + 1));
            const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              qa[mi][4 * c + j][h] = to_half2<T>(w[2 * j]);
              qa[mi][4 * c + j][h + 2] = to_half2<T>(w[2 * j + 1]);
            }
          }
      } else if constexpr (kQInRegs) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          ldmatrix_x4(qa[mi][kk], S::kstep(q_base[mi], kk));
          if constexpr (!SameType<M, T>::value)
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mi][kk][e] = to_half2<T>(qa[mi][kk][e]);
        }
      }
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
    auto fresh_state = [&] {  // an empty online softmax: the item's start (and each invariant chunk's)
#pragma unroll
      for (int mi = 0; mi < M_TILES; ++mi) {
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mi][dn][e] = 0.f;
        m_run[mi][0] = m_run[mi][1] = -INFINITY;
        l_run[mi][0] = l_run[mi][1] = 0.f;
      }
    };
    fresh_state();
    int chunk = 0;  // batch-invariant: chunks of this item combined so far

    // ---- Batch-invariant chunk end, after the warps' states are in `combine`: a unit is (row, 4
    // columns), so a thread has one unit per chunk at d128 g = 4 (d256: two), not two dependent
    // ones, and a row's max, its warps' weights and the fold weights serve 4 columns (H200, v6: 3 %
    // faster than 2 columns a unit on b16-heavy-kv8 and d256 soft-cap). The chunk's unnormalized
    // state (m, l, o) (state_fold.cuh; sigmoid: m = 0) is a split item's partial row for this
    // chunk, or folds into a writethrough item's state (fold_o, fold_ml: this thread's units are
    // the same at every chunk), and the last chunk's fold is final.
    auto fold_chunk_quads = [&](const float* combine, int mi, int tile_rows, bool last) {
      for (int i = tid; i < tile_rows * (D / 4); i += S::threads) {
        const int r16 = i / (D / 4), c = (i % (D / 4)) * 4;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, combine[(w * 16 + r16) * (D + 2) + D]);
        const float base = m == -INFINITY ? 0.f : m;
        float l = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
          const float* src = combine + (w * 16 + r16) * (D + 2);
          const float f = Variant::use_softmax ? fast_exp2(src[D] - base) : 1.f;
          const float2 lo = *reinterpret_cast<const float2*>(src + c), hi = *reinterpret_cast<const float2*>(src + c + 2);
          l += f * src[D + 1];
          o[0] += f * lo.x;
          o[1] += f * lo.y;
          o[2] += f * hi.x;
          o[3] += f * hi.y;
        }
        const int r = mi * 16 + r16, t = r / heads, qo_head = first_qo_head + r % heads;
        if (partial_row >= 0) {
          const int64_t prow = int64_t(partial_row + chunk * q_tokens + t) * p.num_qo_heads + qo_head;
          *reinterpret_cast<float4*>(p.partial_o + prow * D + c) = make_float4(o[0], o[1], o[2], o[3]);
          if (c == 0) reinterpret_cast<float2*>(p.partial_lse)[prow] = make_float2(m, l);
          continue;
        }
        float4* fo = reinterpret_cast<float4*>(fold_o + r * D + c);
        float2 run_ml = make_float2(m, l);
        if (chunk > 0) {
          const float4 prev = *fo;
          const float2 prev_ml = fold_ml[((chunk - 1) & 1) * S::rows + r];
          const FoldWeights w = fold_weights(prev_ml.x, m);
          run_ml = make_float2(w.m, fold_acc(prev_ml.y, l, w));
          o[0] = fold_acc(prev.x, o[0], w);
          o[1] = fold_acc(prev.y, o[1], w);
          o[2] = fold_acc(prev.z, o[2], w);
          o[3] = fold_acc(prev.w, o[3], w);
        }
        if (!last) {
          *fo = make_float4(o[0], o[1], o[2], o[3]);
          if (c == 0) fold_ml[(chunk & 1) * S::rows + r] = run_ml;
          continue;
        }
        write_folded<Variant, P, 4>(p, var, q_row0 + t, qo_head, c, o, run_ml.x, run_ml.y);
      }
    };

    // ---- Combine the warps, one 16-row tile at a time, in the stage of the last block computed:
    // the loader refills it only after the next block's __syncthreads, and the stages that hold
    // the next item's blocks are not touched. combine[w][row][0..D) = O, [D] = m (log2), [D+1] = l.
    // Batch-invariant: `last` says whether the chunk is the item's last.
    auto combine_warps = [&](float* combine, bool last) {
#pragma unroll
      for (int mi = 0; mi < M_TILES; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float l = l_run[mi][h];
          l += __shfl_xor_sync(0xffffffff, l, 1);
          l += __shfl_xor_sync(0xffffffff, l, 2);
          if (INVARIANT && mi * 16 + lane / 4 + 8 * h >= rows_valid) continue;  // (no reader)
          float* dst = combine + (warp * 16 + lane / 4 + 8 * h) * (D + 2);
#pragma unroll
          for (int dn = 0; dn < D / 8; ++dn) {
            if constexpr (kFp8) {  // fp8 V fragments permute O's columns (DecodeShape::o_col)
              dst[S::o_col(dn, (lane % 4) * 2)] = o[mi][dn][2 * h] * v_scale;
              dst[S::o_col(dn, (lane % 4) * 2 + 1)] = o[mi][dn][2 * h + 1] * v_scale;
            } else if constexpr (INVARIANT) {  // (chunk ends: one base, the columns immediate offsets;
              // dst[d] let LICM keep D/4 addresses live across the item: d256 soft-cap spilled 32 B)
              float* lane_dst = dst + (lane % 4) * 2;
              lane_dst[dn * 8] = o[mi][dn][2 * h];
              lane_dst[dn * 8 + 1] = o[mi][dn][2 * h + 1];
            } else {
              const int d = dn * 8 + (lane % 4) * 2;
              dst[d] = o[mi][dn][2 * h];
              dst[d + 1] = o[mi][dn][2 * h + 1];
            }
          }
          if (lane % 4 == 0) {
            dst[D] = Variant::use_softmax ? m_run[mi][h] : 0.f;
            dst[D + 1] = l;
          }
        }
        __syncthreads();

        const int tile_rows = min(16, rows_valid - mi * 16);
        if constexpr (INVARIANT) fold_chunk_quads(combine, mi, tile_rows, last); else
        for (int i = tid; i < tile_rows * (D / 2); i += S::threads) {
          const int r16 = i / (D / 2), d = (i % (D / 2)) * 2;
          float m_max = -INFINITY;
#pragma unroll
          for (int w = 0; w < NUM_WARPS; ++w) m_max = fmaxf(m_max, combine[(w * 16 + r16) * (D + 2) + D]);
          const float base = m_max == -INFINITY ? 0.f : m_max;
          float l = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
          for (int w = 0; w < NUM_WARPS; ++w) {
            const float* src = combine + (w * 16 + r16) * (D + 2);
            const float f = Variant::use_softmax ? fast_exp2(src[D] - base) : 1.f;
            l += f * src[D + 1];
            o0 += f * src[d];
            o1 += f * src[d + 1];
          }
          const int r = mi * 16 + r16;
          const int t = r / heads, qo_head = first_qo_head + r % heads;
          float top = base;
          if constexpr (Variant::has_sink) {
            if (partial_row < 0) {  // the row's final state: its sink joins once, here (split rows: the merge)
              const SinkJoin j = join_sink(base, l, var.SinkLogit(p, qo_head) * kLog2e);
              top = j.top;
              l = j.l;
              o0 *= j.scale;
              o1 *= j.scale;
            }
          }
          // Natural-log LSE of the total weight; softmax O is normalized, sigmoid O is a plain sum.
          const float lse = l > 0.f ? (top + __log2f(l)) * kLn2 : -INFINITY;
          if (Variant::use_softmax) {
            const float inv = l > 0.f ? 1.f / l : 0.f;
            o0 *= inv;
            o1 *= inv;
          }
#ifdef RTATTN_LEVEL_JOIN
          float lse_row = lse;  // a writethrough row of the last level: the earlier levels' states join
          if (partial_row < 0 && merge_entry >= 0) join_levels<Variant::use_softmax>(p, merge_entry + t, qo_head, d,
                                                                                     o0, o1, lse_row);
#else
          const float lse_row = lse;
#endif
          if (partial_row < 0) {
            if constexpr (Variant::has_output_transform) {
              o0 = var.OutputTransform(p, o0, qo_head, d);
              o1 = var.OutputTransform(p, o1, qo_head, d + 1);
            }
            using O = typename P::OType;
            O* op = p.o + int64_t(q_row0 + t) * p.o_stride_tok + int64_t(qo_head) * p.o_stride_head + d;
            op[0] = from_float<O>(o0);
            op[1] = from_float<O>(o1);
            if (p.lse != nullptr && d == 0) p.lse[int64_t(q_row0 + t) * p.num_qo_heads + qo_head] = lse_row;
          } else {
            const int64_t prow = int64_t(partial_row + t) * p.num_qo_heads + qo_head;
            p.partial_o[prow * D + d] = o0;
            p.partial_o[prow * D + d + 1] = o1;
            if (d == 0) p.partial_lse[prow] = lse;
          }
        }
        // The combine area is refilled by the loader (or the next tile's combine). Batch-invariant
        // chunks: the loader refills it only after the next block's __syncthreads (or the next
        // item's q-tile one), so only a second row tile needs this barrier.
        if (!INVARIANT || mi + 1 < M_TILES) __syncthreads();
      }
    };

    for (int blk = 0; blk < num_blocks; ++blk, ++blocks_done) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // block blocks_done landed for everyone; everyone is past the previous one
      issue_block((blocks_done + STAGES - 1) % STAGES);
      KV* ks = stage_at(blocks_done % STAGES);
      KV* vs = ks + S::stage_elems;
      // K as 16-bit elements in the at() layout: the tile itself, or (fp8) its widened copy.
      M* k16;
      if constexpr (kFp8) k16 = reinterpret_cast<M*>(reinterpret_cast<char*>(ks) + S::widened_k_offset);
      else k16 = ks;
      const int blk_pos0 = kv_begin + blk * BT;
      if constexpr (Variant::has_key_transform) {
        for (int i = tid; i < BT * (D / 2); i += S::threads) {
          const int tok = i / (D / 2), d = i % (D / 2);
          const int lo_at = S::at(tok, d / 8) + d % 8, hi_at = S::at(tok, (d + D / 2) / 8) + d % 8;
          float lo, hi;
          if constexpr (kFp8) {  // dequantized, so the transform sees the true K
            const int c = S::kv_chunk;
            lo = fp8_to_float(ks[S::kv_at(tok, d / c) + d % c]) * k_scale;
            hi = fp8_to_float(ks[S::kv_at(tok, (d + D / 2) / c) + d % c]) * k_scale;
          } else {
            lo = to_float(ks[lo_at]);
            hi = to_float(ks[hi_at]);
          }
          var.KeyTransform(p, lo, hi, d, blk_pos0 + tok, kv_head);
          k16[lo_at] = from_float<M>(lo);
          k16[hi_at] = from_float<M>(hi);
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
      if constexpr (kFp8K) {  // rows of the warp's tokens 0-7 and 8-15: four k-steps per 16-byte load
#pragma unroll
        for (int c = 0; c < D / 64; ++c) {
          const int r = warp * 16 + lane / 4, ch = S::k_chunk(lane % 4, c);
          const uint4 n0 = *reinterpret_cast<const uint4*>(ks + S::kv_at(r, ch));
          const uint4 n1 = *reinterpret_cast<const uint4*>(ks + S::kv_at(r + 8, ch));
          const uint32_t w0[4] = {n0.x, n0.y, n0.z, n0.w}, w1[4] = {n1.x, n1.y, n1.z, n1.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t kb[4];
            fp8x4_to_half<KV>(w0[j], kb[0], kb[1]);
            fp8x4_to_half<KV>(w1[j], kb[2], kb[3]);
#pragma unroll
            for (int mi = 0; mi < M_TILES; ++mi) {
              MmaOp<M>::run(s[mi][0], qa[mi][4 * c + j], kb[0], kb[1]);
              MmaOp<M>::run(s[mi][1], qa[mi][4 * c + j], kb[2], kb[3]);
            }
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          uint32_t kb[4];
          ldmatrix_x4(kb, S::kstep(smem_addr(k16) + k_lane, kk));
#pragma unroll
          for (int mi = 0; mi < M_TILES; ++mi) {
            uint32_t qf[4];
            if constexpr (!kQInRegs) {
              ldmatrix_x4(qf, S::kstep(q_base[mi], kk));
              if constexpr (!SameType<M, T>::value)
#pragma unroll
                for (int e = 0; e < 4; ++e) qf[e] = to_half2<T>(qf[e]);
            }
            const uint32_t (&a)[4] = kQInRegs ? qa[mi][kk] : qf;
            MmaOp<M>::run(s[mi][0], a, kb[0], kb[1]);
            MmaOp<M>::run(s[mi][1], a, kb[2], kb[3]);
          }
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
            if constexpr (transforms_logits<Variant>()) {
              x = transform_logit(var, p, x * sm_scale, row_qo_idx[mi][h], kv_pos, row_qo_head[mi][h], kv_head) * kLog2e;
            } else {
              x *= sm_scale_log2;
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
        pa[mi][0] = pack2<M>(s[mi][0][0], s[mi][0][1]);
        pa[mi][1] = pack2<M>(s[mi][0][2], s[mi][0][3]);
        pa[mi][2] = pack2<M>(s[mi][1][0], s[mi][1][1]);
        pa[mi][3] = pack2<M>(s[mi][1][2], s[mi][1][3]);
      }

      // O += P V for this warp's 16 tokens.
      if constexpr (kFp8) {  // B fragments of rows 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1), byte by byte
        constexpr int SEGS = D == 64 ? 1 : D / 128, WORDS = D == 64 ? 2 : 4;
        const int r = warp * 16 + 2 * (lane % 4), n = lane / 4;
#pragma unroll
        for (int sg = 0; sg < SEGS; ++sg) {
          uint32_t w[4][WORDS];  // rows r, r + 1, r + 8, r + 9
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int row = r + (k & 1) + (k & 2) * 4;
            if constexpr (D == 64) {
              const uint2 x = *reinterpret_cast<const uint2*>(vs + S::kv_at(row, 0) + n * 8);
              w[k][0] = x.x, w[k][1] = x.y;
            } else {
              const uint4 x = *reinterpret_cast<const uint4*>(vs + S::kv_at(row, sg * 8 + n));
              w[k][0] = x.x, w[k][1] = x.y, w[k][2] = x.z, w[k][3] = x.w;
            }
          }
#pragma unroll
          for (int j = 0; j < WORDS; ++j)
#pragma unroll
            for (int hb = 0; hb < 2; ++hb) {  // bytes 2hb, 2hb + 1 of word j: n-tiles 16sg + 4j + 2hb + e
              const uint32_t sel = hb ? 0x7362u : 0x5140u;  // interleave two rows' bytes into pairs
              uint32_t b0[2], b1[2];
              fp8x4_to_half<KV>(prmt(w[0][j], w[1][j], sel), b0[0], b0[1]);
              fp8x4_to_half<KV>(prmt(w[2][j], w[3][j], sel), b1[0], b1[1]);
#pragma unroll
              for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int mi = 0; mi < M_TILES; ++mi) MmaOp<M>::run(o[mi][sg * 16 + 4 * j + 2 * hb + e], pa[mi], b0[e], b1[e]);
            }
        }
      } else {
#pragma unroll
        for (int dp = 0; dp < KT; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, S::kstep(smem_addr(vs) + v_lane, dp));
#pragma unroll
          for (int mi = 0; mi < M_TILES; ++mi) {
            MmaOp<M>::run(o[mi][2 * dp], pa[mi], vb[0], vb[1]);
            MmaOp<M>::run(o[mi][2 * dp + 1], pa[mi], vb[2], vb[3]);
          }
        }
      }
      if constexpr (INVARIANT) {  // a chunk ends: its state is combined and folded, the next starts fresh
        const bool last = blk + 1 == num_blocks;
        if (last || (blk + 1) % chunk_blocks == 0) {
          if (kPrefetch && last && item + 1 < item_end) load_q(next_item);  // in flight over the combine
          __syncthreads();  // every warp is done with this block's stage
          combine_warps(reinterpret_cast<float*>(stage_at(blocks_done % STAGES)), last);
          ++chunk;
          fresh_state();
        }
      }
    }
    if constexpr (!INVARIANT) {
      if (kPrefetch && item + 1 < item_end) load_q(next_item);  // in flight over the combine
      __syncthreads();  // every warp is done with the last block's stage
      combine_warps(reinterpret_cast<float*>(stage_at((blocks_done + STAGES - 1) % STAGES)), true);
    } else if (num_blocks == 0) {  // empty KV: its (0, -inf) state, as auto writes it
      if (kPrefetch && item + 1 < item_end) load_q(next_item);
      __syncthreads();
      combine_warps(reinterpret_cast<float*>(stage_at((blocks_done + STAGES - 1) % STAGES)), true);
    }

    // ---- Fused merge: the CTA that writes a split tile's last partial (for this KV head) merges
    // the tile's rows. Release: every thread fences its partial stores before one atomic counts
    // the arrival; acquire: the last arriver fences, then reads the partials through L2 (this
    // SM's L1 may hold lines of an earlier kernel's partials). It resets the counter: all the
    // tile's arrivals are in, so the workspace is ready for the next kernel.
    if (merge_fan_in > 0) {
      __threadfence();
      __syncthreads();
      volatile int* is_last = reinterpret_cast<volatile int*>(q_smem);  // q is reloaded next item
      if (tid == 0) {
        int* counter = p.merge_counters + int64_t(merge_entry) * p.num_qo_heads + kv_head;
        const int arrivals = INVARIANT ? chunk : 1;  // batch-invariant: one partial row per chunk
        const bool last = atomicAdd(counter, arrivals) == merge_fan_in - arrivals;
        if (last) *counter = 0;
        *is_last = last;
      }
      __syncthreads();
      if (*is_last) {
        __threadfence();
        merge_tile<Variant, P, INVARIANT>(p, var, merge_entry, q_tokens, first_qo_head, heads, tid);
      }
      __syncthreads();  // is_last is read before the next item's q overwrites it
    }
  }
  cp_async_wait<0>();  // only empty groups remain: the stream ended with the last item
#if defined(RTATTN_INDEPENDENT_LEVEL) && defined(RTATTN_LEAVE_EARLY)
  // RTATTN_LEAVE_EARLY (codegen spec `leave_early`): a CTA that wrote its items' states leaves,
  // freeing its SM slot for the grid's later CTAs while the previous grid still runs; CTA (0, 0)
  // alone waits, so this grid still completes after that one (as for the CTAs without items).
  if ((blockIdx.x | blockIdx.y) == 0) wait_for_previous_grid();
#elif defined(RTATTN_INDEPENDENT_LEVEL)
  wait_for_previous_grid();  // complete only after the previous grid: the next kernel's wait covers both
#endif
}

}  // namespace rtattn
