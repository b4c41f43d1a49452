// mbarriers in shared memory (sm_90+): a phase completes when its expected arrivals (and,
// with expect_tx, its bytes of asynchronous copies) have all come in. Used by the TMA GEMM
// (gemm_tma.cu), the quantized prefill GEMM (quant_gemm.cu) and the persistent decode kernel
// (decode_mega.cu); with the TMA's tensor-tile loads and 1-D bulk copies that complete on
// them.
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

// ---- TMA tile loads (sm_90) ----------------------------------------------------------------
// A CUtensorMap: 128 opaque bytes, 64-byte aligned (NVRTC has no cuda.h).
struct alignas(64) TmaMap { u64 words[16]; };

// the box of `map` at coordinates (c0, c1, c2) (innermost first) into shared memory at dst;
// its bytes count toward the mbarrier `bar`'s expected transaction
__device__ __forceinline__ void tma_load(u32 dst, const TmaMap* map, u32 bar, int c0, int c1,
                                         int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// bytes (a multiple of 16, 16-byte aligned) from global src to shared dst, completing on `bar`
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_prefetch(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
