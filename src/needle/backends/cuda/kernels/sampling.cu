// Token sampling on the device (capability "sampling"; reference: numpy_ref/sampling.py).
//
// sample_{dt}: one group of SAMPLE_THREADS threads per row of logits. The filters keep
// tokens by value thresholds found without sorting: top-k by a radix select of the k-th
// largest order-preserving key (four passes of 8-bit digits, counting), top-p by the same
// select weighted by probability mass, min-p by comparing with the largest probability. The
// draw is the first token, in vocabulary order, whose running kept mass exceeds u times the
// total, u from a 32-bit hash of (seed, position): each thread sums a contiguous chunk, a
// group-wide scan finds the chunk, and its thread walks it. Temperature 0 takes the first
// maximum. When the row's scaled logits fit in shared memory they are computed once and
// every later pass reads them there. No host sync: a captured decode step samples in place.
#include "common.cuh"

struct SampleParams { i64 rows, vocab, cached; };

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

// order-preserving key of a float: larger floats give larger unsigned keys
__device__ __forceinline__ u32 order_key(float z) {
  u32 u = __float_as_uint(z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float uniform24(u32 seed, u32 position) {
  u32 x = seed * 0x9E3779B9u + position * 0x85EBCA6Bu + 0x632BE5ABu;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return (float)(x >> 8) * (1.0f / 16777216.0f);
}

struct SampleShared {
  float red[SAMPLE_WARPS];
  int redi[SAMPLE_WARPS];
  u32 count[256];
  float mass[256];
  float scan[SAMPLE_THREADS];
  u32 digit;
  float need;
  u32 remaining;
  int token;
  int last_kept;
};

__device__ __forceinline__ float block_sum(float v, SampleShared& s) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) s.red[warp] = v;
  __syncthreads();
  float t = lane < SAMPLE_WARPS ? s.red[lane] : 0.f;
  return warp_sum(t);  // every warp computes the same total
}

__device__ __forceinline__ float block_max(float v, SampleShared& s) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) s.red[warp] = v;
  __syncthreads();
  float t = lane < SAMPLE_WARPS ? s.red[lane] : neg_inf<float>();
  return warp_max(t);
}

// the first index of the largest value (ties and the whole block: the smallest index)
__device__ __forceinline__ int block_argmax(float v, int i, SampleShared& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { s.red[warp] = v; s.redi[warp] = i; }
  __syncthreads();
  v = lane < SAMPLE_WARPS ? s.red[lane] : neg_inf<float>();
  i = lane < SAMPLE_WARPS ? s.redi[lane] : 0x7fffffff;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  return i;
}

// One row's scaled, penalized logits: z_i = penalized(logit_i) / temperature.
template <class T> struct Row {
  const T* logits;
  b8* seen;
  float penalty, temperature;
  const float* cache;  // the z values in shared memory, or null
  __device__ __forceinline__ float raw(int i) const {
    float l = (float)load(logits[i]);
    if (penalty != 1.f && seen[i]) l = l > 0.f ? l / penalty : l * penalty;
    return l;
  }
  __device__ __forceinline__ float z(int i) const { return cache ? cache[i] : raw(i) / temperature; }
};

// The key of the k-th largest z (radix select, 8 bits a pass).
template <class T>
__device__ __forceinline__ u32 kth_key(const Row<T>& row, int vocab, u32 k, SampleShared& s) {
  u32 prefix = 0, mask = 0;
  if (threadIdx.x == 0) s.remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (threadIdx.x < 256) s.count[threadIdx.x] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
      u32 key = order_key(row.z(i));
      if ((key & mask) == prefix) atomicAdd(&s.count[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u32 left = s.remaining, d = 0;
      for (int b = 255; b >= 0; b--) {
        if (s.count[b] >= left) { d = (u32)b; break; }
        left -= s.count[b];
      }
      s.digit = d;
      s.remaining = left;
    }
    __syncthreads();
    prefix |= s.digit << shift;
    mask |= 255u << shift;
  }
  return prefix;
}

// The largest key t with mass(key >= t, key >= floor_key) >= need: top-p's cut.
template <class T>
__device__ __forceinline__ u32 mass_key(const Row<T>& row, int vocab, float zmax, u32 floor_key, float need,
                        SampleShared& s) {
  u32 prefix = 0, mask = 0;
  if (threadIdx.x == 0) s.need = need;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (threadIdx.x < 256) s.mass[threadIdx.x] = 0.f;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
      float z = row.z(i);
      u32 key = order_key(z);
      if (key >= floor_key && (key & mask) == prefix)
        atomicAdd(&s.mass[(key >> shift) & 255u], expf(z - zmax));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float left = s.need, acc = 0.f;
      int d = -1, lowest = 0;
      for (int b = 255; b >= 0; b--) {
        if (s.mass[b] <= 0.f) continue;
        lowest = b;
        if (acc + s.mass[b] >= left) { d = b; break; }
        acc += s.mass[b];
      }
      if (d < 0) d = lowest;  // rounding left the target unmet: keep down to the last bin
      s.digit = (u32)d;
      s.need = left - acc;
    }
    __syncthreads();
    prefix |= s.digit << shift;
    mask |= 255u << shift;
  }
  return prefix;
}

template <class T>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits, const float* __restrict__ prm,
                           const int* __restrict__ seeds, const int* __restrict__ positions,
                           b8* __restrict__ seen, int* __restrict__ out, const SampleParams& p,
                           float* zcache) {
  __shared__ SampleShared s;
  const i64 r = blockIdx.x;
  const int vocab = (int)p.vocab;
  const float* q = prm + r * 5;
  Row<T> row{logits + r * p.vocab, seen + r * p.vocab, q[4], q[0], nullptr};
  if (row.temperature == 0.f) {  // greedy on the (penalized) logits
    float best = neg_inf<float>();
    int at = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
      float l = row.raw(i);
      if (l > best || (l == best && i < at)) { best = l; at = i; }
    }
    at = block_argmax(best, at, s);
    if (threadIdx.x == 0) {
      out[r] = at;
      row.seen[at] = 1;
    }
    return;
  }
  float zmax = neg_inf<float>();
  for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
    float z = row.raw(i) / row.temperature;
    if (p.cached) zcache[i] = z;
    zmax = fmaxf(zmax, z);
  }
  zmax = block_max(zmax, s);  // (its barriers also publish the cache)
  if (p.cached) row.cache = zcache;
  const u32 k = (u32)q[1];
  const float top_p = q[2], min_p = q[3];
  u32 cut = 0;
  if (k > 0 && k < (u32)vocab) cut = kth_key(row, vocab, k, s);
  if (top_p < 1.f) {
    float total = 0.f;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
      float z = row.z(i);
      if (order_key(z) >= cut) total += expf(z - zmax);
    }
    total = block_sum(total, s);
    cut = mass_key(row, vocab, zmax, cut, top_p * total, s);
  }
  // each thread's contiguous chunk: its kept mass, then a scan over the group
  const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
  const int begin = min(vocab, (int)threadIdx.x * chunk), end = min(vocab, begin + chunk);
  float mine = 0.f;
  int last = -1;
  for (int i = begin; i < end; i++) {
    float z = row.z(i), w = expf(z - zmax);
    if (order_key(z) >= cut && w >= min_p) { mine += w; last = i; }
  }
  if (threadIdx.x == 0) { s.token = 0x7fffffff; s.last_kept = -1; }
  s.scan[threadIdx.x] = mine;
  __syncthreads();
  if (last >= 0) atomicMax(&s.last_kept, last);
  for (int o = 1; o < SAMPLE_THREADS; o <<= 1) {  // inclusive scan (Hillis-Steele)
    float add = threadIdx.x >= o ? s.scan[threadIdx.x - o] : 0.f;
    __syncthreads();
    s.scan[threadIdx.x] += add;
    __syncthreads();
  }
  const float total = s.scan[SAMPLE_THREADS - 1];
  const float target = uniform24((u32)seeds[r], (u32)positions[r]) * total;
  const float before = s.scan[threadIdx.x] - mine;
  if (mine > 0.f && before <= target && target < before + mine) {
    float run = before;
    int found = last;
    for (int i = begin; i < end; i++) {
      float z = row.z(i), w = expf(z - zmax);
      if (order_key(z) >= cut && w >= min_p) {
        run += w;
        if (run > target) { found = i; break; }
      }
    }
    atomicMin(&s.token, found);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int token = s.token != 0x7fffffff ? s.token : s.last_kept;  // rounding: the last kept
    out[r] = token;
    row.seen[token] = 1;
  }
}

#define SAMPLE(SFX, T)                                                                         \
  extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_##SFX(                   \
      const T* __restrict__ logits, const float* __restrict__ prm,                             \
      const int* __restrict__ seeds, const int* __restrict__ positions, b8* __restrict__ seen, \
      int* __restrict__ out, SampleParams p) {                                                 \
    pdl_entry();                                                                               \
    extern __shared__ float zcache[];                                                          \
    sample_row<T>(logits, prm, seeds, positions, seen, out, p, zcache);                        \
  }

ONLY(f16, SAMPLE(f16, half_t))
ONLY(bf16, SAMPLE(bf16, bf16_t))
ONLY(f32, SAMPLE(f32, float))
ONLY(f64, SAMPLE(f64, double))
