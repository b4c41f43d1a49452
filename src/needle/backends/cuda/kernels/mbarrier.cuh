// mbarriers in shared memory (sm_90+): a phase completes when its expected arrivals (and,
// with expect_tx, its bytes of asynchronous copies) have all come in. Used by the TMA GEMM
// (gemm_tma.cu) and the persistent decode kernel (decode_mega.cu).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// true once the phase of parity `parity` has completed
__device__ __forceinline__ bool bar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
  while (!bar_try_wait(bar, parity)) {
  }
}
