// XOR-swizzled shared-memory tiles of 16-bit rows (q, K, V), shared by the kernel families.
//
// A tile row of HEAD_DIM elements is stored unpadded, so every row starts on a 128-byte line as it
// does in global memory (whole-sector cp.async copies); the 16-byte chunk index is XOR-ed with
// row % 8 inside its line, so the 8 rows one ldmatrix reads hit 8 distinct bank groups.
#pragma once
#include "types.cuh"

namespace rtattn {

template <int HEAD_DIM>
struct SwizzledRows {
  static_assert(HEAD_DIM % 64 == 0, "the swizzle spans 8 chunks of 8 elements: head_dim % 64 == 0");
  // Element offset of 16-byte chunk `chunk` of row `row`.
  static __device__ __forceinline__ int at(int row, int chunk) { return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3); }
  // Shared address of chunk + 2*kk of a row, from addr0 = the address of (row, chunk) with chunk 0
  // or 1: the tile starts on a 128-byte line, so bits 4-6 of addr0 are the swizzled chunk; XOR-ing
  // 2*kk's low bits in and adding its high bits as an immediate costs one instruction, no register.
  static __device__ __forceinline__ uint32_t kstep(uint32_t addr0, int kk) {
    return (addr0 ^ (((2 * kk) & 7) << 4)) + (((2 * kk) & ~7) << 4);
  }
};

// The wgmma canonical 128-byte-swizzle layout of a ROWS x HEAD_DIM tile: stored as
// [HEAD_DIM / 64][ROWS][64], so every 64-column slab is whole 1024-byte atoms of 8 rows x 128 bytes
// (matrix descriptors step 1024 bytes per 8 rows, ROWS * 128 bytes per slab); inside a row the
// 16-byte chunk index is XOR-ed with row % 8, as in SwizzledRows (the tensor cores undo it).
template <int HEAD_DIM, int ROWS>
struct Sw128Tile {
  static_assert(HEAD_DIM % 64 == 0 && ROWS % 8 == 0, "whole 8-row x 64-column atoms");
  static constexpr int slab_bytes = ROWS * 128;
  static __device__ __forceinline__ int at(int row, int chunk) {
    return (chunk >> 3) * (ROWS * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  }
};

// The shared memory of a warpgroup prefill kernel: Q_TILES q tiles of ROWS rows, then STAGES
// stages of a K and a V tile of TILE_KV tokens, each whole 1024-byte swizzle atoms.
template <int HEAD_DIM, int ROWS, int Q_TILES, int TILE_KV, int STAGES, int ELEM_BYTES>
struct Sw128TileStages {
  static constexpr int q_bytes = Q_TILES * ROWS * HEAD_DIM * ELEM_BYTES;
  static constexpr int tile_bytes = TILE_KV * HEAD_DIM * ELEM_BYTES;
  static constexpr int stage_bytes = 2 * tile_bytes;
  static constexpr int smem_bytes = q_bytes + STAGES * stage_bytes;
  static_assert(TILE_KV % 16 == 0 && TILE_KV <= 128, "KV tiles are whole k-steps of PV, at most n128 of QK^T");
  static_assert(STAGES >= 2, "the pipeline needs a stage to compute and one in flight");
  static_assert(q_bytes % 1024 == 0 && tile_bytes % 1024 == 0, "tiles are whole 1024-byte swizzle atoms");
};

}  // namespace rtattn
