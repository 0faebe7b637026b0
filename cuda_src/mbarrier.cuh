// Shared-memory mbarriers and per-warpgroup register budgets (sm_90): the handshakes of the
// warp-specialized prefill kernel (prefill_ws.cuh), where a producer warpgroup fills pipeline
// stages that consumer warpgroups read, and neither side waits at a CTA-wide barrier.
//
// A barrier completes a phase when its expected count of arrivals is in; waiters name the phase
// by its parity (0, 1, 0, ...). A fresh barrier counts as having completed the phase before its
// first, so a producer waiting for "stage empty" with parity 1 passes on its first round.
#pragma once
#include "ptx.cuh"

namespace rtattn {

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// One arrival (release: this thread's earlier shared-memory accesses happen before the phase ends).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival once every cp.async this thread issued so far has landed (noinc: it counts against
// the barrier's expected count, like mbar_arrive).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Until the phase of `parity` has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "MBAR_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra MBAR_WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// A warp's arrival: every lane is done (its wgmma reads waited for), then one lane arrives.
__device__ __forceinline__ void mbar_arrive_warp(uint64_t* bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

// The warpgroup's registers per thread from here on (a multiple of 8, 24-256; every thread of the
// warpgroup executes it): the producer gives registers back, the consumers take them.
template <int REGS>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace rtattn
