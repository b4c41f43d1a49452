// Thread-block clusters (sm_90+): the barrier every thread of every group of a cluster
// arrives at, and loads from another group's shared memory (distributed shared memory).
// Used by sample_* (sampling.cu: a row's groups) and the decode attention's cluster kernels
// (decode_tc.cu: a KV head's ranges). Compiled only for sm_90+; callers guard their use.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cl {
// this group's rank in its cluster
__device__ __forceinline__ u32 rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// every thread of every group of the cluster arrives; the shared-memory writes of each are
// visible to all after it
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// shared-memory address `a` (of this group) as the same offset in group `rank`'s
__device__ __forceinline__ u32 map(u32 a, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
// loads at a mapped address
__device__ __forceinline__ u32 ld_u32(u32 a) {
  u32 v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_u64(u32 a) {
  unsigned long long v;
  asm volatile("ld.shared::cluster.u64 %0, [%1];\n" : "=l"(v) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_f4(u32 a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  return v;
}
}  // namespace cl
#endif
