// A grid-wide barrier for persistent kernels whose groups are all resident at once: one
// 64-bit count of arrivals that only grows (no reset, so no second word and no last-arriver
// step). Thread 0 of each group arrives with a release reduction (cumulative: it publishes
// what its group wrote before the group's own sync) and polls the count with acquire loads
// until it reaches this barrier's multiple of the group count: ~1.1 us a barrier on an H100
// against 2.15 for a reset-and-release barrier (scripts/probe_stream.py, cuda_notes v24).
// The caller syncs its group before and after grid_count_wait.
#pragma once

// The count's base for this launch: every barrier of earlier launches is complete, and none
// of this launch's can be before every group has read the count, so the count is a multiple
// of gridDim.x plus the first barrier's early arrivals.
__device__ __forceinline__ unsigned long long grid_count_base(const void* count) {
  const unsigned long long v = *reinterpret_cast<const volatile unsigned long long*>(count);
  return v - v % gridDim.x;
}

// thread 0 of a group: arrive, then wait until the count reaches `target`
__device__ __forceinline__ void grid_count_wait(void* count, unsigned long long target) {
  asm volatile("red.release.gpu.global.add.u64 [%0], 1;\n" ::"l"(count) : "memory");
  unsigned long long v;
  do {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(count) : "memory");
  } while (v < target);
}
