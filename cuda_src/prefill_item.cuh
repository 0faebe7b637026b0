// One work item of a prefill CTA's queue, the part both prefill kernels (prefill.cuh and
// prefill_sm90.cuh) do alike: its plan fields and visible KV range, its query rows into the
// kernel's swizzled q tile, the KV stream (the first STAGES - 1 tiles, then one per block), the
// KeyTransform of a K tile and whether a block needs the mask. Tile: the kernel's shared layout
// (at(row, chunk)); rows of the q tile are (token r / g, head r % g).
#pragma once
#include "paged_loader.cuh"
#include "query_transform.cuh"

namespace rtattn {

// This CTA's queue of the plan (work_indptr[blockIdx.x] on), walked from the CTA's own offset.
// LPT gives every queue the same shape (costs descending), so CTAs walking them in order reach
// their item prologues (plan reads, page ids, first tiles) together, and the CTA sharing an SM
// (block L + the SM count: the same queue of another KV head) cannot hide them. Items are
// independent: the order changes no result.
struct PrefillQueue {
  int begin, size, first;
  template <class P>
  __device__ __forceinline__ void init(const P& p) {
    begin = p.plan.work_indptr[blockIdx.x];
    size = p.plan.work_indptr[blockIdx.x + 1] - begin;
    first = int(int64_t(blockIdx.x + blockIdx.y * gridDim.x) * size / (gridDim.x * gridDim.y));
  }
  __device__ __forceinline__ int item(int k) const { return begin + (k + first < size ? k + first : k + first - size); }
};

template <class Variant>
struct PrefillItem {
  int b, q_row0, q_tokens, partial_row, lo, hi, page_start, qo_idx0, rows_valid, q_lo, q_hi, num_blocks;
  const int* pages;

  // Item `item`'s fields; var initialized for its request; [lo, hi) clipped to what its queries
  // can see (VisibleKV: causal and window blocks outside are never loaded).
  template <int TILE_KV, class P>
  __device__ __forceinline__ void load(const P& p, int item, int heads, Variant& var) {
    b = p.plan.item_request[item], q_row0 = p.plan.item_qo_start[item];
    q_tokens = p.plan.item_qo_len[item];
    partial_row = p.plan.item_partial[item];
    lo = p.plan.item_kv_start[item], hi = p.plan.item_kv_end[item];
    page_start = p.plan.item_kv_page_start[item];
    pages = p.plan.kv_indices + page_start;
    const int qo_len = p.plan.req_qo_len[b], kv_len = p.plan.req_kv_len[b];
    qo_idx0 = q_row0 - p.plan.req_qo_start[b];
    rows_valid = q_tokens * heads;
    var.init(p, b, qo_len, kv_len);
    q_lo = var.q_pos(qo_idx0), q_hi = var.q_pos(qo_idx0 + q_tokens - 1);
    var.VisibleKV(p, q_lo, q_hi, lo, hi);
    num_blocks = hi > lo ? (hi - lo + TILE_KV - 1) / TILE_KV : 0;
  }

  // Block starting at pos0 needs the mask: the range's tail, or a block the variant's mask cuts.
  template <int TILE_KV, class P>
  __device__ __forceinline__ bool needs_mask(const P& p, const Variant& var, int pos0) const {
    bool need = pos0 + TILE_KV > hi;
    if constexpr (Variant::has_logits_mask) need = need || !var.BlockUnmasked(p, q_lo, q_hi, pos0, pos0 + TILE_KV);
    return need;
  }
};

// Query rows -> the q tile by cp.async; rows past the item are zeros (their results are never
// written). Issued before the KV tiles, they join the first pipeline group: one round trip for q
// and KV together (a register round trip per row waited on each load: several microseconds per
// item).
// row0: the first of the ROWS rows (a warpgroup copying its own rows of a larger tile).
// COMPACT: a rolled loop (a producer warpgroup on few registers: unrolled, each pass's row
// division by the head group is hoisted out of the item loop into a register of its own).
template <class Tile, int ROWS, int THREADS, bool COMPACT = false, class P, class It>
__device__ __forceinline__ void copy_q_rows(const P& p, typename P::DType* q_smem, const It& it, int heads,
                                            int first_qo_head, int tid, int row0 = 0) {
  using T = typename P::DType;
  constexpr int QC = P::head_dim / 8;  // 16-byte chunks per row; a thread keeps one column of chunks
  static_assert(ROWS * QC % THREADS == 0 && THREADS % QC == 0, "whole passes of rows");
  auto pass_copy = [&](int pass) {
    const int r = row0 + (tid + pass * THREADS) / QC, c = tid % QC;
    const bool valid = r < it.rows_valid;
    const T* qp = valid ? p.q + int64_t(it.q_row0 + r / heads) * p.q_stride_tok +
                              int64_t(first_qo_head + r % heads) * p.q_stride_head + c * 8
                        : p.q;
    cp_async_16(q_smem + Tile::at(r, c), qp, valid);
  };
  if constexpr (COMPACT) {
#pragma unroll 1
    for (int pass = 0; pass < ROWS * QC / THREADS; ++pass) pass_copy(pass);
  } else {
#pragma unroll
    for (int pass = 0; pass < ROWS * QC / THREADS; ++pass) pass_copy(pass);
  }
}

// The same rows through registers, with the variant's QueryTransform on the pair d, d + D/2.
template <class Tile, int ROWS, int THREADS, class Variant, class P, class It>
__device__ __forceinline__ void transform_q_rows(const P& p, Variant& var, typename P::DType* q_smem, const It& it,
                                                 int heads, int first_qo_head, int tid) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  constexpr int QV = D / 16;  // 8-element chunks per half row
  for (int i = tid; i < ROWS * QV; i += THREADS) {
    const int r = i / QV, c = (i % QV) * 8;
    uint4 lo4 = make_uint4(0u, 0u, 0u, 0u), hi4 = lo4;
    if (r < it.rows_valid) {
      const T* qp = p.q + int64_t(it.q_row0 + r / heads) * p.q_stride_tok +
                    int64_t(first_qo_head + r % heads) * p.q_stride_head + c;
      lo4 = *reinterpret_cast<const uint4*>(qp);
      hi4 = *reinterpret_cast<const uint4*>(qp + D / 2);
      transform_query_chunks<T>(var, p, lo4, hi4, c, it.qo_idx0 + r / heads, first_qo_head + r % heads);
    }
    *reinterpret_cast<uint4*>(q_smem + Tile::at(r, c / 8)) = lo4;
    *reinterpret_cast<uint4*>(q_smem + Tile::at(r, (c + D / 2) / 8)) = hi4;
  }
}

// The KV stream: STAGES - 1 tiles in flight before the first is computed (start_kv_stream), then
// the copies of tile blk + STAGES - 1 into the stage tile blk - 1 used (next_kv_tile, once
// everyone is past it); one cp.async group per tile. The page ids of the next tile are read
// while the current one is in flight.
template <int STAGES, int TILE_KV, class Loader, class P, class It, class KStage, class VStage>
__device__ __forceinline__ void start_kv_stream(Loader& ld, const P& p, const It& it, KStage k_stage, VStage v_stage) {
  ld.fetch(p, it.pages, it.page_start, it.lo, it.hi);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < it.num_blocks) {
      ld.issue(p, k_stage(s), v_stage(s), it.lo + s * TILE_KV, it.hi);
      ld.fetch(p, it.pages, it.page_start, it.lo + (s + 1) * TILE_KV, it.hi);
    }
    cp_async_commit();
  }
}
template <int STAGES, int TILE_KV, class Loader, class P, class It, class KStage, class VStage>
__device__ __forceinline__ void next_kv_tile(Loader& ld, const P& p, const It& it, KStage k_stage, VStage v_stage,
                                             int blk) {
  const int nb = blk + STAGES - 1, ns = nb % STAGES;
  if (nb < it.num_blocks) {
    ld.issue(p, k_stage(ns), v_stage(ns), it.lo + nb * TILE_KV, it.hi);
    ld.fetch(p, it.pages, it.page_start, it.lo + (nb + 1) * TILE_KV, it.hi);
  }
  cp_async_commit();
}

// L1 prefetches of the plan fields PrefillItem::load reads (no registers held), so that entering
// an item waits on no L2 round trip for them.
__device__ __forceinline__ void prefetch_l1(const int* a) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a)); }
template <class P>
__device__ __forceinline__ void prefetch_item_fields(const P& p, int item) {
  const int* fields[] = {p.plan.item_request, p.plan.item_qo_start, p.plan.item_qo_len, p.plan.item_partial,
                         p.plan.item_kv_start, p.plan.item_kv_end, p.plan.item_kv_page_start};
#pragma unroll
  for (const int* f : fields) prefetch_l1(f + item);
}
template <class P>
__device__ __forceinline__ void prefetch_request_fields(const P& p, int b) {
  prefetch_l1(p.plan.req_qo_start + b);
  prefetch_l1(p.plan.req_qo_len + b);
  prefetch_l1(p.plan.req_kv_len + b);
}
// At queue position k of a per-item KV stream (one thread's work): the item fields two positions
// ahead, and of the next item its request fields and (paged) its first page ids, whose own
// addresses come from fields prefetched one position earlier (L1 hits). So the next item's
// prologue -- item, then request, then page ids, then the first tile -- starts from L1 instead
// of three dependent L2 round trips.
template <bool PAGED, class P>
__device__ __forceinline__ void prefetch_next_items(const P& p, const PrefillQueue& queue, int k) {
  if (k + 2 < queue.size) prefetch_item_fields(p, queue.item(k + 2));
  if (k + 1 < queue.size) {
    const int next = queue.item(k + 1);
    if (k == 0) prefetch_item_fields(p, next);
    prefetch_request_fields(p, p.plan.item_request[next]);
    if constexpr (PAGED) prefetch_l1(p.plan.kv_indices + p.plan.item_kv_page_start[next]);
  }
}

// The KV stream across a CTA's whole queue (the CROSS path): the tiles of its items, in queue
// order, as one stream, so the next item's first tiles are in flight while the current item's
// last blocks compute (no pipeline fill per item). The consumer's block n (counted over the
// queue) computes stream tile n from stage n % STAGES and issues tile n + STAGES - 1 into the
// stage block n - 1 used, one cp.async group per block, as start_kv_stream / next_kv_tile do
// within one item. The cursor reads an item's plan fields with the consumer's own code
// (PrefillItem::load), so both walk the same tiles; items without a KV tile are skipped.
template <class Variant, int TILE_KV>
struct QueueKVStream {
  // The queue position whose tiles are being issued (queue.size: none left), its next tile's first
  // token and its KV end; where its page ids start in kv_indices (paged) or its first tensor row
  // (ragged). Four registers: the cursor is live across the whole KV loop.
  int k, pos, hi, page_start;

  // Moves the cursor to the first item at queue position k or later with a tile, and reads that
  // tile's page ids (the loader issues from them next). Warms L1 for the items after it, so that
  // entering them (here, a block before their first tile is issued) and the consumer's own reads
  // of their fields wait on no L2 round trip: the item fields two positions ahead, and the request
  // fields of the next item (its item_request, prefetched one entry earlier, is an L1 hit).
  template <class Loader, class P>
  __device__ __forceinline__ void enter(Loader& ld, const P& p, const PrefillQueue& queue, int heads) {
    for (; k < queue.size; ++k) {
      Variant var;
      PrefillItem<Variant> it;
      it.template load<TILE_KV>(p, queue.item(k), heads, var);
      if (it.num_blocks > 0) {
        pos = it.lo, hi = it.hi, page_start = it.page_start;
        if (k + 2 < queue.size) prefetch_item_fields(p, queue.item(k + 2));
        if (k + 1 < queue.size) prefetch_request_fields(p, p.plan.item_request[queue.item(k + 1)]);
        ld.fetch(p, p.plan.kv_indices + page_start, page_start, pos, hi);
        return;
      }
    }
  }
  template <class Loader, class P>
  __device__ __forceinline__ void init(Loader& ld, const P& p, const PrefillQueue& queue, int heads) {
    k = 0;
    enter(ld, p, queue, heads);
  }
  // The stream's first STAGES - 1 tiles, one cp.async group each (start_kv_stream's counterpart,
  // at the queue's first item).
  template <int STAGES, class Loader, class P, class KStage, class VStage>
  __device__ __forceinline__ void start(Loader& ld, const P& p, const PrefillQueue& queue, int heads, KStage k_stage,
                                        VStage v_stage) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      issue(ld, p, queue, heads, k_stage(s), v_stage(s));
      cp_async_commit();
    }
  }
  // Issues the stream's next tile into (k_dst, v_dst), uncommitted (the caller commits once per
  // block, after anything else its block adds to the group); nothing once the queue is done.
  template <class Loader, class P, class T>
  __device__ __forceinline__ void issue(Loader& ld, const P& p, const PrefillQueue& queue, int heads, T* k_dst,
                                        T* v_dst) {
    if (k >= queue.size) return;
    ld.issue(p, k_dst, v_dst, pos, hi);
    pos += TILE_KV;
    if (pos < hi) {
      ld.fetch(p, p.plan.kv_indices + page_start, page_start, pos, hi);
    } else {
      ++k;
      enter(ld, p, queue, heads);
    }
  }

};

// The q rows of plan item `item` (what copy_q_rows reads), for the CROSS path's copy
// of the next item's q during the current item's last block.
struct QueryRows {
  int q_row0, rows_valid;
  template <class P>
  __device__ __forceinline__ void load(const P& p, int item, int heads) {
    q_row0 = p.plan.item_qo_start[item];
    rows_valid = p.plan.item_qo_len[item] * heads;
  }
};

// KeyTransform of the K tile at tokens [pos0, pos0 + TILE_KV), in place (the pair d, d + D/2).
template <class Tile, int TILE_KV, int THREADS, class Variant, class P>
__device__ __forceinline__ void transform_k_tile(const P& p, Variant& var, typename P::DType* ks, int pos0, int kv_head,
                                                 int tid) {
  using T = typename P::DType;
  constexpr int D = P::head_dim;
  for (int i = tid; i < TILE_KV * (D / 2); i += THREADS) {
    const int tok = i / (D / 2), d = i % (D / 2);
    const int lo_at = Tile::at(tok, d / 8) + d % 8, hi_at = Tile::at(tok, (d + D / 2) / 8) + d % 8;
    float x = to_float(ks[lo_at]), y = to_float(ks[hi_at]);
    var.KeyTransform(p, x, y, d, pos0 + tok, kv_head);
    ks[lo_at] = from_float<T>(x);
    ks[hi_at] = from_float<T>(y);
  }
}

}  // namespace rtattn
