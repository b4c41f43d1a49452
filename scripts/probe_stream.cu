// Read-only streams over a model's weight arrays, for scripts/probe_stream.py: which access
// pattern reaches which bandwidth (docs/cuda_notes.md v24). Not a library kernel.
//
// stream{U}(table, out, {count, mode, chunk}): every array of `table` read once, 16 bytes a lane
// and U loads in flight a lane; `mode` says who reads what:
//   0 flat: the whole grid over one array, then the next (one launch's ideal)
//   1 slice: group g reads the contiguous g-th of each array, its threads interleaved
//   2 warp slice: as 1, and each warp takes a contiguous part of the group's slice
//   3 chunks: each array in chunks of (threads x U) 16-byte units, dealt to the groups in
//     turn (group g: chunks g, g + G, ...)
//   4-7 as 2, with the group's threads meeting after each array (4, 5: __syncthreads; 6, 7:
//     a grid barrier as decode_mega.cu's), without (4, 6) or with (5, 7) each warp's first
//     U loads of the next array issued before the meeting: what a stage boundary costs a
//     stream, and whether prefetching across it hides that
//   10 as 6, each warp asking L2 to prefetch its whole slice of the next array before the
//     barrier (prefetch.global.L2, one per 128-byte line); 11 the 6's barriers alone (no
//     reads): their own cost
//   12, 13 as 11 and 6 with a lighter grid barrier: one 64-bit counter that only grows
//     (each group adds 1 with a release reduction, then polls it with acquire loads until
//     this barrier's multiple of the group count), no last-arriver reset and release
//   8, 9 a grid barrier an array, and the arrays' 16-byte units handed out on demand:
//     each warp claims `chunk` units at a time from the array's counter (one claim ahead
//     of its reads); 9 also claims and loads its first chunk of the next array before
//     the barrier
// The XOR of everything read is stored only if it equals a value it never has, so the
// loads stay and nothing is written.
#include "common.cuh"
#include "grid_count.cuh"

struct Array16 {
  const uint4* p;
  i64 n;  // 16-byte units
};

// units [lo, hi) of p, read by `lanes` threads of which this is `lane`
template <int U>
__device__ __forceinline__ u32 read_run(const uint4* p, i64 lo, i64 hi, i64 lane, i64 lanes) {
  u32 acc = 0;
  i64 i = lo + lane;
  for (; i + (U - 1) * lanes < hi; i += U * lanes) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; u++) v[u] = ld_stream16(p + i + u * lanes);
#pragma unroll
    for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < hi; i += lanes) {
    uint4 v = ld_stream16(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

__device__ __forceinline__ u32 ld_acquire(const unsigned* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(unsigned* p, u32 v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// every thread of every group waits for all (sync[0] counts arrivals, sync[1] generations)
__device__ __forceinline__ void grid_barrier(unsigned* sync, u32& gen) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(sync, 1u) == gridDim.x - 1) {
      atomicExch(sync, 0u);
      __threadfence();
      st_release(sync + 1, gen + 1);
    } else {
      while (ld_acquire(sync + 1) == gen) {
      }
    }
  }
  gen++;
  __syncthreads();
}

// modes 12, 13: grid_count.cuh's barrier
__device__ __forceinline__ void grid_barrier_counted(u64* counter, u64& target) {
  __syncthreads();
  target += gridDim.x;
  if (threadIdx.x == 0) grid_count_wait(counter, target);
  __syncthreads();
}

// this warp's sub-slice [lo, hi) of array a (mode 2's split)
__device__ __forceinline__ void warp_slice(const Array16& arr, i64& lo, i64& hi) {
  const i64 G = gridDim.x, g = blockIdx.x, W = blockDim.x / 32, w = threadIdx.x / 32;
  const i64 n = arr.n, glo = g * n / G, ghi = (g + 1) * n / G;
  lo = glo + w * (ghi - glo) / W;
  hi = glo + (w + 1) * (ghi - glo) / W;
}

// U loads a lane of units [lo, hi) of p (zeros past hi): a warp's first batch
template <int U>
__device__ __forceinline__ void loads(const uint4* p, i64 lo, i64 hi, uint4 (&v)[U]) {
  const i64 l = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < U; u++)
    v[u] = lo + l + u * 32 < hi ? ld_stream16(p + lo + l + u * 32) : make_uint4(0, 0, 0, 0);
}

// the first batch of this warp's slice of an array (modes 5, 7)
template <int U>
__device__ __forceinline__ void first_loads(const Array16& arr, uint4 (&v)[U]) {
  i64 lo, hi;
  warp_slice(arr, lo, hi);
  loads<U>(arr.p, lo, hi, v);
}

// L2 prefetches of this warp's slice of an array, one 128-byte line a lane at a time
__device__ __forceinline__ void prefetch_slice(const Array16& arr) {
  i64 lo, hi;
  warp_slice(arr, lo, hi);
  for (i64 i = (lo / 8 + threadIdx.x % 32) * 8; i < hi; i += 32 * 8)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(arr.p + i));
}

// modes 4-7, 10, 11
template <int U>
__device__ __forceinline__ u32 staged(const Array16* table, int count, bool grid, bool ahead,
                                      unsigned* sync, int mode) {
  u32 acc = 0, gen = *reinterpret_cast<volatile unsigned*>(sync + 1);
  uint4 v[U];
  u64* counter = reinterpret_cast<u64*>(sync + 2);  // 8-byte aligned: sync is
  u64 target = mode >= 12 ? grid_count_base(counter) : 0;
  if (mode == 11 || mode == 12) {
    for (int a = 0; a < count; a++) {
      if (mode == 11) grid_barrier(sync, gen);
      else grid_barrier_counted(counter, target);
    }
    return 0;
  }
  if (ahead) first_loads<U>(table[0], v);
  for (int a = 0; a < count; a++) {
    if (!ahead) first_loads<U>(table[a], v);
#pragma unroll
    for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    i64 lo, hi;
    warp_slice(table[a], lo, hi);
    acc ^= read_run<U>(table[a].p, lo + U * 32, hi, threadIdx.x % 32, 32);
    if (ahead && a + 1 < count) first_loads<U>(table[a + 1], v);
    if (mode == 10 && a + 1 < count) prefetch_slice(table[a + 1]);
    if (mode == 13) grid_barrier_counted(counter, target);
    else if (grid) grid_barrier(sync, gen);
    else __syncthreads();
  }
  return acc;
}

// lane 0 claims `chunk` units of a counter; the caller broadcasts the result later
__device__ __forceinline__ u32 claim(unsigned* counter, i64 chunk) {
  return threadIdx.x % 32 == 0 ? atomicAdd(counter, static_cast<u32>(chunk)) : 0u;
}

// modes 8, 9 (counters: ctr[a], zero at launch; group 0 zeroes each after its barrier)
template <int U>
__device__ __forceinline__ u32 dynamic(const Array16* table, int count, bool ahead,
                                       unsigned* sync, unsigned* ctr, i64 chunk) {
  const unsigned full = 0xffffffffu;
  u32 acc = 0, gen = *reinterpret_cast<volatile unsigned*>(sync + 1);
  const i64 l = threadIdx.x % 32;
  uint4 v[U];
  i64 pos = 0;
  if (ahead) {
    pos = __shfl_sync(full, claim(ctr, chunk), 0);
    loads<U>(table[0].p, pos, pos + chunk < table[0].n ? pos + chunk : table[0].n, v);
  }
  for (int a = 0; a < count; a++) {
    const uint4* p = table[a].p;
    const i64 n = table[a].n;
    bool first = ahead;
    if (!ahead) pos = __shfl_sync(full, claim(ctr + a, chunk), 0);
    while (pos < n) {
      const u32 mine = claim(ctr + a, chunk);  // the next chunk, claimed before this one's reads
      const i64 hi = pos + chunk < n ? pos + chunk : n;
      if (first) {
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        acc ^= read_run<U>(p, pos + U * 32, hi, l, 32);
        first = false;
      } else {
        acc ^= read_run<U>(p, pos, hi, l, 32);
      }
      pos = __shfl_sync(full, mine, 0);
    }
    if (first) {  // claimed ahead past the end: the loads were guarded to nothing
#pragma unroll
      for (int u = 0; u < U; u++) acc ^= v[u].x;
    }
    if (ahead && a + 1 < count) {
      const i64 n1 = table[a + 1].n;
      pos = __shfl_sync(full, claim(ctr + a + 1, chunk), 0);
      loads<U>(table[a + 1].p, pos, pos + chunk < n1 ? pos + chunk : n1, v);
    }
    grid_barrier(sync, gen);
    if (blockIdx.x == 0 && threadIdx.x == 0) ctr[a] = 0;  // every claim on it is done
  }
  return acc;
}

template <int U>
__device__ __forceinline__ void stream(const Array16* table, int count, int mode, i64 chunk,
                                       u32* out) {
  const i64 G = gridDim.x, g = blockIdx.x, T = blockDim.x, t = threadIdx.x;
  const i64 W = T / 32, w = t / 32, l = t % 32;
  u32 acc = 0;
  if (mode >= 4) {  // out[0:2] the grid barrier's words, [2:4] mode 12's, [4:...] counters
    acc = mode == 8 || mode == 9 ? dynamic<U>(table, count, mode & 1, out, out + 4, chunk)
                    : staged<U>(table, count, mode >= 6, mode < 8 && (mode & 1), out, mode);
    if (acc == 0x9e3779b9u) out[256 + g * T + t] = acc;
    return;
  }
  for (int a = 0; a < count; a++) {
    const uint4* p = table[a].p;
    const i64 n = table[a].n;
    if (mode == 0) {
      acc ^= read_run<U>(p, 0, n, g * T + t, G * T);
    } else if (mode == 1 || mode == 2) {
      const i64 lo = g * n / G, hi = (g + 1) * n / G;
      if (mode == 1) {
        acc ^= read_run<U>(p, lo, hi, t, T);
      } else {
        const i64 wl = lo + w * (hi - lo) / W, wh = lo + (w + 1) * (hi - lo) / W;
        acc ^= read_run<U>(p, wl, wh, l, 32);
      }
    } else {
      const i64 chunk = T * U;
      for (i64 c = g * chunk; c < n; c += G * chunk)
        acc ^= read_run<U>(p, c, c + chunk < n ? c + chunk : n, t, T);
    }
  }
  if (acc == 0x9e3779b9u) out[256 + g * T + t] = acc;
}

struct StreamParams { int count, mode; i64 chunk; };

extern "C" __global__ void __launch_bounds__(1024) stream4(const Array16* table, u32* out,
                                                           StreamParams p) {
  stream<4>(table, p.count, p.mode, p.chunk, out);
}
extern "C" __global__ void __launch_bounds__(1024) stream8(const Array16* table, u32* out,
                                                           StreamParams p) {
  stream<8>(table, p.count, p.mode, p.chunk, out);
}
