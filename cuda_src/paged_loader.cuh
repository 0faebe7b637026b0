// Paged (or ragged) KV tile loader: TILE_KV consecutive tokens of one KV head, K and V, into
// swizzled shared tiles with cp.async. Thread t copies 16-byte chunk t % (HEAD_DIM/8) of rows
// t / (HEAD_DIM/8) + i * ROWS_PER_PASS; each row looks up its own page, so a tile may start at
// any token (window and causal bounds need not be page aligned). The page ids of the next tile
// are read while the current one is in flight (fetch after issue), so issuing never waits on an
// L2 round trip. Tokens at or past `end` are zero-filled and never read.
// PAGED = false: ragged KV, token `pos` of a request is row `base + pos` of a [tokens, H, D]
// tensor (base = the request's kv_indptr entry; stride_page is the token stride).
#pragma once
#include "ptx.cuh"
#include "swizzle.cuh"

namespace rtattn {

// RTATTN_PREFILL_KV_EVICT_FIRST (PrefillTile.kv_evict_first: a cascade's shared level, whose plan
// reads each KV block once): the prefill kernels' KV copies under decode's evict-first L2 policy.
// Under the normal policy the shared level streamed 134 MB at ~3.3 TB/s (p32768x16, H200, session 11).
#ifdef RTATTN_PREFILL_KV_EVICT_FIRST
constexpr bool kPrefillKvEvictFirst = true;
#else
constexpr bool kPrefillKvEvictFirst = false;
#endif

// Tile: the shared layout's at(row, chunk) (SwizzledRows; Sw128Tile for the wgmma kernel).
template <typename T, int HEAD_DIM, int TILE_KV, int THREADS, bool PAGED, bool EVICT_FIRST = false,
          class Tile = SwizzledRows<HEAD_DIM>>
struct KVTileLoader {
  static constexpr int VECS = HEAD_DIM / 8;  // 16-byte chunks per row
  static_assert(THREADS % VECS == 0, "threads must cover whole rows");
  static constexpr int ROWS_PER_PASS = THREADS / VECS;
  static_assert(TILE_KV % ROWS_PER_PASS == 0, "a tile is a whole number of passes");
  static constexpr int PASSES = TILE_KV / ROWS_PER_PASS;

  const T* k_head;
  const T* v_head;
  int row0;
  uint64_t policy = 0;
  int page[PASSES];  // page id (PAGED) or tensor row (ragged) of each of this thread's rows

  template <class P>
  __device__ __forceinline__ void init(const P& p, int kv_head, int tid) {
    const int vec = tid % VECS;
    row0 = tid / VECS;
    k_head = p.k_cache + int64_t(kv_head) * p.k_stride_head + vec * 8;
    v_head = p.v_cache + int64_t(kv_head) * p.v_stride_head + vec * 8;
    if constexpr (EVICT_FIRST) policy = evict_first_policy();
  }
  // Page ids of the tile at tokens [pos0, pos0 + TILE_KV); `pages` = the request's kv_indices
  // (PAGED) or `base` its first tensor row (ragged).
  template <class P>
  __device__ __forceinline__ void fetch(const P& p, const int* pages, int base, int pos0, int end) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int pos = pos0 + row0 + i * ROWS_PER_PASS;
      if constexpr (PAGED) {
        page[i] = pos < end ? __ldg(pages + (pos >> p.page_shift)) : 0;
      } else {
        page[i] = base + (pos < end ? pos : 0);
      }
    }
  }
  // Prefill re-reads a request's KV once per query tile: L2 keeps it by its normal policy (the
  // evict-first hint decode uses for its read-once stream would send those re-reads to HBM).
  __device__ __forceinline__ void copy(void* dst, const void* src, bool valid) const {
    if constexpr (EVICT_FIRST) {
      cp_async_16(dst, src, valid, policy);
    } else {
      cp_async_16(dst, src, valid);
    }
  }
  // Strides are read from the params (constant bank) at each use: no registers held for them.
  // Byte offsets are 32 x 32 -> 64-bit products added to the 64-bit head pointer, one
  // IMAD.WIDE.U32 each: the wrappers refuse a KV stride of 2^32 bytes or more, and page ids and
  // token rows are non-negative int32.
  // LOAD_K / LOAD_V: which of the two (a producer with separate K and V slots issues them apart,
  // on the same page ids).
  template <bool LOAD_K = true, bool LOAD_V = true, class P>
  __device__ __forceinline__ void issue(const P& p, T* k_dst, T* v_dst, int pos0, int end) const {
    const int vec = threadIdx.x % VECS;
    const uint32_t slot_mask = PAGED ? (1u << p.page_shift) - 1u : 0u;
    const uint32_t kp = uint32_t(p.k_stride_page) * sizeof(T), kt = uint32_t(p.k_stride_tok) * sizeof(T);
    const uint32_t vp = uint32_t(p.v_stride_page) * sizeof(T), vt = uint32_t(p.v_stride_tok) * sizeof(T);
    const char* kb = reinterpret_cast<const char*>(k_head);
    const char* vb = reinterpret_cast<const char*>(v_head);
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int row = row0 + i * ROWS_PER_PASS, pos = pos0 + row;
      const int dst = Tile::at(row, vec);
      const uint32_t slot = uint32_t(pos) & slot_mask, pg = uint32_t(page[i]);
      const bool valid = pos < end;
      if constexpr (LOAD_K) copy(k_dst + dst, kb + uint64_t(pg) * kp + uint64_t(slot) * kt, valid);
      if constexpr (LOAD_V) copy(v_dst + dst, vb + uint64_t(pg) * vp + uint64_t(slot) * vt, valid);
    }
  }
};

}  // namespace rtattn
