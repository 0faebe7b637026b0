// Warpgroup MMA (sm_90a wgmma.mma_async) for the prefill kernels: shared-memory matrix
// descriptors of 128-byte-swizzled tiles and the two m64nNk16 products attention needs (f32
// accumulate, bf16/fp16 in): S = Q K^T with both operands in shared memory (WgmmaSS, B = K
// K-major) and O += P V with P from registers (WgmmaRS, B = V N-major). Inline asm takes no
// arrays, so each shape spells out its accumulator operands. An m64nN accumulator of one thread
// is N/8 chunks of 4 floats in the mma.sync m16n8 C layout (rows lane/4 and lane/4 + 8 of its
// warp's 16 rows), held as float[N/8][4]; the register A operand is the m16n8k16 A fragment.
#pragma once
#include "ptx.cuh"

namespace rtattn {

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte
// units), layout (bits 62-63: 0 no swizzle, 1 the 128-byte swizzle).
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                              uint32_t layout) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(sbo_bytes >> 4) << 32) | (uint64_t(layout) << 62);
}
// A tile in the canonical 128-byte swizzle (8 rows of 128 bytes per 1024-byte atom, the 16-byte
// chunk index XOR row % 8, atoms 1024-byte aligned).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return smem_desc(smem_byte_addr, lbo_bytes, sbo_bytes, 1);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Ordinary shared-memory writes (cp.async, st.shared) made visible to the tensor cores' (async
// proxy) reads: each writing thread fences, then the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D (+)= A B: A (64 x 16) and B (16 x N, K-major) by descriptor; accumulate = false overwrites D.
template <typename T, int N> struct WgmmaSS;
// D += A B: A (64 x 16) from registers, B (16 x N, N-major) by descriptor.
template <typename T, int N> struct WgmmaRS;


// One specialization per shape, spelled for both 16-bit types (T, its PTX name TY).

#define RTATTN_WGMMA_SS_32(T, TY)                                                                  \
  template <> struct WgmmaSS<T, 32> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[4][4], uint64_t a, uint64_t b, bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                        \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])                                                                  \
                   : "l"(a), "l"(b), "r"(int(accumulate)));                                          \
    }                                                                                                \
  };

#define RTATTN_WGMMA_SS_64(T, TY)                                                                  \
  template <> struct WgmmaSS<T, 64> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[8][4], uint64_t a, uint64_t b, bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                        \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                                  \
                   : "l"(a), "l"(b), "r"(int(accumulate)));                                          \
    }                                                                                                \
  };

#define RTATTN_WGMMA_SS_128(T, TY)                                                                  \
  template <> struct WgmmaSS<T, 128> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[16][4], uint64_t a, uint64_t b, bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                  \
                   : "l"(a), "l"(b), "r"(int(accumulate)));                                          \
    }                                                                                                \
  };

#define RTATTN_WGMMA_RS_64(T, TY)                                                                  \
  template <> struct WgmmaRS<T, 64> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {     \
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
    }                                                                                                \
  };

#define RTATTN_WGMMA_RS_128(T, TY)                                                                  \
  template <> struct WgmmaRS<T, 128> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {     \
      asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
    }                                                                                                \
  };

#define RTATTN_WGMMA_RS_256(T, TY)                                                                  \
  template <> struct WgmmaRS<T, 256> {                                                                 \
    __device__ __forceinline__ static void run(float (&d)[32][4], const uint32_t (&a)[4], uint64_t b) {     \
      asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
    }                                                                                                \
  };

#define RTATTN_WGMMA_RS_8(T, TY)                                                                   \
  template <> struct WgmmaRS<T, 8> {                                                                  \
    __device__ __forceinline__ static void run(float (&d)[1][4], const uint32_t (&a)[4], uint64_t b) {      \
      asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32." TY "." TY " {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, 1, 1;\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
    }                                                                                                \
  };

RTATTN_WGMMA_RS_8(__nv_bfloat16, "bf16")
RTATTN_WGMMA_RS_8(__half, "f16")
#undef RTATTN_WGMMA_RS_8
RTATTN_WGMMA_SS_32(__nv_bfloat16, "bf16")
RTATTN_WGMMA_SS_32(__half, "f16")
#undef RTATTN_WGMMA_SS_32
RTATTN_WGMMA_SS_64(__nv_bfloat16, "bf16")
RTATTN_WGMMA_SS_64(__half, "f16")
#undef RTATTN_WGMMA_SS_64
RTATTN_WGMMA_SS_128(__nv_bfloat16, "bf16")
RTATTN_WGMMA_SS_128(__half, "f16")
#undef RTATTN_WGMMA_SS_128
RTATTN_WGMMA_RS_64(__nv_bfloat16, "bf16")
RTATTN_WGMMA_RS_64(__half, "f16")
#undef RTATTN_WGMMA_RS_64
RTATTN_WGMMA_RS_128(__nv_bfloat16, "bf16")
RTATTN_WGMMA_RS_128(__half, "f16")
#undef RTATTN_WGMMA_RS_128
RTATTN_WGMMA_RS_256(__nv_bfloat16, "bf16")
RTATTN_WGMMA_RS_256(__half, "f16")
#undef RTATTN_WGMMA_RS_256


// The products of one 64-row warpgroup's KV block, as the prefill kernels issue them (uncommitted).
// Operands in the canonical 128-byte swizzle (Sw128Tile): q and K K-major, the descriptor of k-step
// kk (16 elements) 32 B apart inside a 64-column slab, slabs slab_bytes apart, 8-row groups 1024 B
// apart; V N-major, d slabs v_slab apart (leading), 8-token groups 1024 B apart (stride), a k-step
// 16 tokens = 2048 B.
//
// A k-step's descriptor is its tile's plus the step's offset in the start-address field (bits
// 0-13, 16-byte units): shared-memory addresses stay below 2^18 bytes, so the field never carries
// into the next, and the sum is the descriptor of base + offset. The tile's descriptor is built
// once per product and each k-step adds a constant (rebuilt per step, it took ~10 instructions
// between consecutive wgmmas; docs/perf-log.md "prefill v8").
__device__ __forceinline__ uint64_t desc_step(uint64_t tile_desc, int offset_bytes) {
  const uint32_t lo = uint32_t(tile_desc) + uint32_t(offset_bytes >> 4), hi = uint32_t(tile_desc >> 32);
  return (uint64_t(hi) << 32) | lo;   // (a 32-bit add: the constant upper half stays a constant)
}
__device__ __forceinline__ int kmajor_offset(int slab_bytes, int kk) { return (kk / 4) * slab_bytes + (kk % 4) * 32; }
// S (+)= Q K^T over head_dim D: q's 64 rows at q_base, K's N tokens at k_base; accumulate keeps S's
// start (a linear bias) from the first k-step on, else that k-step overwrites S.
template <typename T, int N, int D>
__device__ __forceinline__ void wgmma_qk(float (&s)[N / 8][4], uint32_t q_base, int q_slab, uint32_t k_base,
                                         int k_slab, bool accumulate) {
  const uint64_t qd = sw128_desc(q_base, 16, 1024), kd = sw128_desc(k_base, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    WgmmaSS<T, N>::run(s, desc_step(qd, kmajor_offset(q_slab, kk)), desc_step(kd, kmajor_offset(k_slab, kk)),
                       kk > 0 || accumulate);
}
// O += P V: P's N / 16 k-steps from registers, V's N tokens at v_base.
template <typename T, int N, int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 8][4], const uint32_t (&pa)[N / 16][4], uint32_t v_base,
                                         int v_slab) {
  const uint64_t vd = sw128_desc(v_base, v_slab, 1024);
#pragma unroll
  for (int j = 0; j < N / 16; ++j) WgmmaRS<T, D>::run(o, pa[j], desc_step(vd, j * 2048));
}

// Row sums on the tensor cores (the RTATTN_TC_ROWSUM build of the wgmma kernels, online_softmax.cuh's
// TC_SUM): P (64 x N) times a 16 x 8 block of ones, beside PV, adds each row's
// weights into an m64n8 accumulator (every column the row's total; the FADDs and the quad's
// shuffles leave the softmax). The ones sit in 512 B of shared memory (no swizzle, both byte
// offsets 128: whatever layout the hardware reads there, it reads ones).
#ifdef RTATTN_TC_ROWSUM
constexpr bool kTcRowSum = true;
#else
constexpr bool kTcRowSum = false;
#endif
template <typename T>
struct OnesTile {
  alignas(128) T v[256];
  // Every thread of the CTA; the CTA's next barrier publishes the ones to the tensor cores.
  __device__ __forceinline__ void fill(int tid, int threads) {
    for (int i = tid; i < 256; i += threads) v[i] = from_float<T>(1.f);
    fence_proxy_async();
  }
  __device__ __forceinline__ uint64_t desc() const { return smem_desc(smem_addr(v), 128, 128, 0); }
};
template <typename T, int N>
__device__ __forceinline__ void wgmma_rowsum(float (&l)[1][4], const uint32_t (&pa)[N / 16][4], uint64_t ones) {
#pragma unroll
  for (int j = 0; j < N / 16; ++j) WgmmaRS<T, 8>::run(l, pa[j], ones);
}

}  // namespace rtattn
