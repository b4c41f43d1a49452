// Token sampling on the device (capability "sampling"; reference: numpy_ref/sampling.py).
//
// sample_{dt}: one cluster of SAMPLE_CLUSTER groups of SAMPLE_THREADS threads per row of
// logits (8 groups on sm_90+, which reach each other's shared memory; one group before), each
// group taking a contiguous slice of the vocabulary. The filters keep tokens by value
// thresholds found without sorting: top-k by a radix select of the k-th largest
// order-preserving key (four passes of 8-bit digits, counting), top-p by the same select
// weighted by probability mass, min-p by comparing with the largest probability. Masses are
// fixed point (probability relative to the largest, times 2^24, in integers), so sums are
// exact and the same in every run, however the row is split. The draw is the first token, in
// vocabulary order, whose running kept mass exceeds u times the total, u from a 32-bit hash
// of (seed, position): each thread sums a contiguous chunk of its group's slice, a scan over
// the group and the groups before it finds the chunk, and its thread walks it. Temperature 0
// takes the first maximum.
//
// Why a cluster: one group per row ran every pass over all 32k values of a Llama row on one
// multiprocessor (a top-p select: 88 us on an H100); the groups of a cluster share each
// pass's 256 bins through distributed shared memory, one cluster barrier a pass.
//
// Histogram updates are aggregated per warp (__match_any_sync, then one update per distinct
// bin): the first digit of float keys is the sign and exponent, which most of a vocabulary
// shares, and plain atomics on one bin serialized a 32k-token row (0.28 ms per token on an
// H100, docs/cuda_notes.md), and where shared memory has room each warp adds into bins of
// its own, merged once a pass: the few bins most values share were hot spots for the 32
// warps' atomics (a 32k-token top-p select: 102 -> 88 us). When a slice's scaled logits fit
// in shared memory they are computed once and kept there, padded one word in 32 so that a
// thread's contiguous chunk meets no bank conflicts. No host sync: a captured decode step
// samples in place.
#include "cluster.cuh"
#include "common.cuh"
#include "tensor_core.cuh"

// cached: the slice's z values are kept in shared memory; warp_bins_at: where (in floats
// from the start of the dynamic shared memory) the warps' own bins start, or -1 (none)
struct SampleParams { i64 rows, vocab, cached, warp_bins_at; };

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define FIXED_ONE 16777216.0f  // 2^24: probability 1 (the largest) in fixed point
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SAMPLE_CLUSTER 8  // groups a row (the host reads it back from the kernel)
#else
#define SAMPLE_CLUSTER 1
#endif

typedef unsigned long long u64s;  // what atomicAdd and the shuffles take for 64 bits

// order-preserving key of a float: larger floats give larger unsigned keys
__device__ __forceinline__ u32 order_key(float z) {
  u32 u = __float_as_uint(z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u32 uniform24(u32 seed, u32 position) {
  u32 x = seed * 0x9E3779B9u + position * 0x85EBCA6Bu + 0x632BE5ABu;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 8;
}

__device__ __forceinline__ u32 fixed(float w) { return (u32)(w * FIXED_ONE + 0.5f); }
__device__ __forceinline__ int padded(int i) { return i + (i >> 5); }

struct SampleShared {
  float redf[SAMPLE_WARPS];
  int redi[SAMPLE_WARPS];
  u64s red64[SAMPLE_WARPS];
  u64s bins[2][256];  // this group's bins of a pass (the other groups read them), by parity
  u64s sum[256];      // the cluster's bins of the pass
  u64s need;
  u32 digit;
  int token, last_kept;
  // what each group publishes once for the others (written before a cluster barrier)
  float group_max, group_best;
  int group_at, group_token, group_last;
  u64s group_total, group_kept;
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

// ---- the cluster: a row's groups and their shared memory (cluster.cuh; one group: its own)
__device__ __forceinline__ u32 cluster_rank() {
#if SAMPLE_CLUSTER > 1
  return cl::rank();
#else
  return 0;
#endif
}

// Every thread of every group of the cluster arrives; the shared-memory writes of each are
// visible to all after it. (One group: __syncthreads.)
__device__ __forceinline__ void cluster_barrier() {
#if SAMPLE_CLUSTER > 1
  cl::sync();
#else
  __syncthreads();
#endif
}

// a 4- or 8-byte shared variable of group ``rank`` (one group: this one's); U is u32 or u64s
template <class U> __device__ __forceinline__ U remote_bits(const void* p, u32 rank) {
#if SAMPLE_CLUSTER > 1
  const u32 a = cl::map(tc::smem_u32(p), rank);
  if constexpr (sizeof(U) == 8)
    return cl::ld_u64(a);
  else
    return cl::ld_u32(a);
#else
  return *reinterpret_cast<const U*>(p);
#endif
}

__device__ __forceinline__ u32 remote32(const void* p, u32 rank) { return remote_bits<u32>(p, rank); }
__device__ __forceinline__ u64s remote(const u64s* p, u32 rank) { return remote_bits<u64s>(p, rank); }

__device__ __forceinline__ float remote(const float* p, u32 rank) {
  return __uint_as_float(remote32(p, rank));
}

__device__ __forceinline__ int remote(const int* p, u32 rank) { return (int)remote32(p, rank); }

__device__ __forceinline__ float block_max(float v, SampleShared& s) {
  v = warp_max(v);
  __syncthreads();
  if (lane_id() == 0) s.redf[warp_id()] = v;
  __syncthreads();
  float t = lane_id() < SAMPLE_WARPS ? s.redf[lane_id()] : neg_inf<float>();
  return warp_max(t);  // every warp computes the same result
}

__device__ __forceinline__ u64s warp_sum64(u64s v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ u64s block_sum64(u64s v, SampleShared& s) {
  v = warp_sum64(v);
  __syncthreads();
  if (lane_id() == 0) s.red64[warp_id()] = v;
  __syncthreads();
  return warp_sum64(lane_id() < SAMPLE_WARPS ? s.red64[lane_id()] : 0ull);
}

// inclusive prefix sum over the group, in thread order
__device__ __forceinline__ u64s block_inclusive_scan64(u64s v, SampleShared& s) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    u64s up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane_id() >= o) v += up;
  }
  __syncthreads();
  if (lane_id() == 31) s.red64[warp_id()] = v;
  __syncthreads();
  if (warp_id() == 0) {
    u64s t = lane_id() < SAMPLE_WARPS ? s.red64[lane_id()] : 0ull;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      u64s up = __shfl_up_sync(0xffffffffu, t, o);
      if (lane_id() >= o) t += up;
    }
    if (lane_id() < SAMPLE_WARPS) s.red64[lane_id()] = t;
  }
  __syncthreads();
  return v + (warp_id() > 0 ? s.red64[warp_id() - 1] : 0ull);
}

// the warp's largest (best, at), ties to the smallest index, in every lane (on copies: the
// code is then the same as the loop written in place)
__device__ __forceinline__ void warp_argmax(float& best, int& at) {
  float v = best;
  int i = at;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  best = v;
  at = i;
}

// the first index of the largest value (ties and the whole group: the smallest index); v
// becomes the largest value
__device__ __forceinline__ int block_argmax(float& v, int i, SampleShared& s) {
  warp_argmax(v, i);
  __syncthreads();
  if (lane_id() == 0) { s.redf[warp_id()] = v; s.redi[warp_id()] = i; }
  __syncthreads();
  v = lane_id() < SAMPLE_WARPS ? s.redf[lane_id()] : neg_inf<float>();
  i = lane_id() < SAMPLE_WARPS ? s.redi[lane_id()] : 0x7fffffff;
  warp_argmax(v, i);
  return i;
}

// bins[bin] += amount for the lanes with ``active``, one update per distinct bin of a warp.
// Every lane of the warp must call it (the loops below give all lanes the same trip count).
// With ``own`` the bins are this warp's alone: its lanes of one bin add up first, so one
// plain update a bin (no atomic); otherwise one atomic per distinct bin.
__device__ __forceinline__ void bin_add(u64s* bins, u32 bin, u32 amount, bool active,
                                        bool own) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(lanes, bin);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const u32 sum = __reduce_add_sync(peers, amount);  // <= 32 * 2^24: fits 32 bits
  if (lane_id() == __ffs(peers) - 1) {
    if (own)
      bins[bin] += sum;
    else
      atomicAdd(&bins[bin], (u64s)sum);
  }
#else
  atomicAdd(&bins[bin], (u64s)amount);
#endif
}

// Warp 0 finds the digit d, from the top, where the running sum of the cluster's bins
// (s.sum) reaches s.need, and leaves in s.need what is still needed inside bin d.
__device__ __forceinline__ void select_digit(SampleShared& s) {
  if (warp_id() != 0) return;
  const int lane = lane_id();
  u64s local = 0;
#pragma unroll
  for (int j = 0; j < 8; j++) local += s.sum[255 - 8 * lane - j];  // lane 0: the top bins
  u64s incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    u64s up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  const u64s before = incl - local, need = s.need;
  const unsigned reach = __ballot_sync(0xffffffffu, incl >= need);
  const int first = reach ? __ffs(reach) - 1 : 31;  // need beyond the total: the last bins
  if (lane == first) {
    u64s acc = before;
    int d = 255 - 8 * lane - 7;
    for (int j = 0; j < 8; j++) {
      const int b = 255 - 8 * lane - j;
      if (acc + s.sum[b] >= need) { d = b; break; }
      acc += s.sum[b];
    }
    s.digit = (u32)d;
    s.need = need > acc ? need - acc : 1;
  }
}

// One row's scaled, penalized logits, z_i = penalized(logit_i) / temperature, and the slice
// [begin, end) of it that this group takes.
template <class T> struct Row {
  const T* logits;
  b8* seen;
  float penalty, temperature;
  int begin, end;
  const float* cache;  // the slice's z values in shared memory (padded), or null
  __device__ __forceinline__ float raw(int i) const {
    float l = (float)load(logits[i]);
    if (penalty != 1.f && seen[i]) l = l > 0.f ? l / penalty : l * penalty;
    return l;
  }
  __device__ __forceinline__ float z(int i) const {
    return cache ? cache[padded(i - begin)] : raw(i) / temperature;
  }
};

// The key of the cut: of the k-th largest z (by counts), or the largest key whose z and the
// larger ones hold at least s.need of fixed-point mass (by mass); keys below ``floor_key``
// take no part. ``pass`` counts the cluster's passes (its parity picks s.bins' half: a group
// may still read the other groups' bins of the previous pass while this one fills).
template <class T, bool BY_MASS>
__device__ __forceinline__ u32 radix_select(const Row<T>& row, float zmax, u32 floor_key,
                                            u64s* warp_bins, int& pass, SampleShared& s) {
  u32 prefix = 0, mask = 0;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const bool own = warp_bins != nullptr;
#else
  const bool own = false;  // (bin_add adds lane by lane there: atomics)
#endif
  for (int shift = 24; shift >= 0; shift -= 8) {
    u64s* group_bins = s.bins[pass++ & 1];
    // the warps' own bins ([warp][256], summed into group_bins after the pass) or the group's
    u64s* bins = own ? warp_bins + warp_id() * 256 : group_bins;
    if (own)
      for (int i = threadIdx.x; i < SAMPLE_WARPS * 256; i += SAMPLE_THREADS) warp_bins[i] = 0;
    else if (threadIdx.x < 256)
      group_bins[threadIdx.x] = 0;
    __syncthreads();
    for (int i0 = row.begin; i0 < row.end; i0 += SAMPLE_THREADS) {  // same trips in a warp
      const int i = i0 + threadIdx.x;
      const float z = i < row.end ? row.z(i) : neg_inf<float>();
      const u32 key = order_key(z);
      const bool take = i < row.end && key >= floor_key && (key & mask) == prefix;
      bin_add(bins, (key >> shift) & 255u, BY_MASS ? fixed(expf(z - zmax)) : 1u, take, own);
    }
    __syncthreads();
    if (own && threadIdx.x < 256) {  // the warps' bins, summed in warp order
      u64s total = 0;
      for (int w = 0; w < SAMPLE_WARPS; w++) total += warp_bins[w * 256 + threadIdx.x];
      group_bins[threadIdx.x] = total;
    }
    cluster_barrier();
    if (threadIdx.x < 256) {  // the cluster's bins, summed in group order
      u64s total = 0;
      for (u32 g = 0; g < SAMPLE_CLUSTER; g++) total += remote(group_bins + threadIdx.x, g);
      s.sum[threadIdx.x] = total;
    }
    __syncthreads();
    select_digit(s);
    __syncthreads();
    prefix |= s.digit << shift;
    mask |= 255u << shift;
  }
  return prefix;
}

// Every warp's lanes below SAMPLE_CLUSTER read a value each group published; the warp's max,
// sum, or sum over the groups before this one.
__device__ __forceinline__ float cluster_max(const float* mine) {
  const int g = lane_id();
  return warp_max(g < SAMPLE_CLUSTER ? remote(mine, g) : neg_inf<float>());
}
__device__ __forceinline__ u64s cluster_sum(const u64s* mine, u32 below = SAMPLE_CLUSTER) {
  const u32 g = lane_id();
  return warp_sum64(g < SAMPLE_CLUSTER && g < below ? remote(mine, g) : 0ull);
}

// temperature 0: the first maximum of the (penalized) logits
template <class T>
__device__ __forceinline__ void greedy_row(const Row<T>& row, int* out_row, u32 rank,
                                           SampleShared& s) {
  float best = neg_inf<float>();
  int at = 0x7fffffff;
  for (int i = row.begin + threadIdx.x; i < row.end; i += SAMPLE_THREADS) {
    float l = row.raw(i);
    if (l > best || (l == best && i < at)) { best = l; at = i; }
  }
  at = block_argmax(best, at, s);
  if (threadIdx.x == 0) { s.group_best = best; s.group_at = at; }
  cluster_barrier();
  if (rank == 0 && warp_id() == 0) {  // the groups' slices are in vocabulary order
    const int g = lane_id();
    float v = g < SAMPLE_CLUSTER ? remote(&s.group_best, g) : neg_inf<float>();
    int i = g < SAMPLE_CLUSTER ? remote(&s.group_at, g) : 0x7fffffff;
    warp_argmax(v, i);
    if (g == 0) {
      *out_row = i;
      row.seen[i] = 1;
    }
  }
}

template <class T>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits,
                                           const float* __restrict__ prm,
                                           const int* __restrict__ seeds,
                                           const int* __restrict__ positions,
                                           b8* __restrict__ seen, int* __restrict__ out,
                                           const SampleParams& p, float* zcache) {
  __shared__ SampleShared s;
  const u32 rank = cluster_rank();
  const i64 r = blockIdx.x / SAMPLE_CLUSTER;
  const int vocab = (int)p.vocab;
  const int slice = (vocab + SAMPLE_CLUSTER - 1) / SAMPLE_CLUSTER;
  const int begin = min(vocab, (int)rank * slice), end = min(vocab, begin + slice);
  const float* q = prm + r * 5;
  Row<T> row{logits + r * p.vocab, seen + r * p.vocab, q[4], q[0], begin, end, nullptr};
  if (row.temperature == 0.f) {
    greedy_row(row, out + r, rank, s);
    cluster_barrier();  // no group leaves while rank 0 may still read its shared memory
    return;
  }
  float zmax = neg_inf<float>();
  for (int i = begin + threadIdx.x; i < end; i += SAMPLE_THREADS) {
    float z = row.raw(i) / row.temperature;
    if (p.cached) zcache[padded(i - begin)] = z;
    zmax = fmaxf(zmax, z);
  }
  zmax = block_max(zmax, s);  // (its barriers also publish the cache)
  if (threadIdx.x == 0) s.group_max = zmax;
  cluster_barrier();
  zmax = cluster_max(&s.group_max);
  if (p.cached) row.cache = zcache;
  u64s* warp_bins = p.warp_bins_at >= 0 ? reinterpret_cast<u64s*>(zcache + p.warp_bins_at)
                                        : nullptr;
  const u32 k = (u32)q[1];
  const float top_p = q[2], min_p = q[3];
  u32 cut = 0;
  int pass = 0;
  if (k > 0 && k < (u32)vocab) {
    if (threadIdx.x == 0) s.need = k;
    cut = radix_select<T, false>(row, zmax, 0u, warp_bins, pass, s);
  }
  if (top_p < 1.f) {
    u64s total = 0;
    for (int i = begin + threadIdx.x; i < end; i += SAMPLE_THREADS) {
      float z = row.z(i);
      if (order_key(z) >= cut) total += fixed(expf(z - zmax));
    }
    total = block_sum64(total, s);
    if (threadIdx.x == 0) s.group_total = total;
    cluster_barrier();
    total = cluster_sum(&s.group_total);
    if (threadIdx.x == 0) s.need = (u64s)ceil((double)top_p * (double)total);
    cut = radix_select<T, true>(row, zmax, cut, warp_bins, pass, s);
  }
  // each thread's contiguous chunk of the slice: its kept mass, then a scan over the group
  // and the groups before it
  const int chunk = (end - begin + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
  const int first = min(end, begin + (int)threadIdx.x * chunk), stop = min(end, first + chunk);
  u64s mine = 0;
  int last = -1;
  for (int i = first; i < stop; i++) {
    float z = row.z(i), w = expf(z - zmax);
    if (order_key(z) >= cut && w >= min_p) { mine += fixed(w); last = i; }
  }
  if (threadIdx.x == 0) { s.token = 0x7fffffff; s.last_kept = -1; }
  __syncthreads();
  if (last >= 0) atomicMax(&s.last_kept, last);
  const u64s incl = block_inclusive_scan64(mine, s);
  if (threadIdx.x == SAMPLE_THREADS - 1) s.group_kept = incl;
  cluster_barrier();
  const u64s total = cluster_sum(&s.group_kept), earlier = cluster_sum(&s.group_kept, rank);
  const double target = (double)uniform24((u32)seeds[r], (u32)positions[r]) *
                        (1.0 / 16777216.0) * (double)total;
  const u64s before = earlier + incl - mine;
  if (mine > 0 && (double)before <= target && target < (double)(before + mine)) {
    u64s run = before;
    int found = last;
    for (int i = first; i < stop; i++) {
      float z = row.z(i), w = expf(z - zmax);
      if (order_key(z) >= cut && w >= min_p) {
        run += fixed(w);
        if ((double)run > target) { found = i; break; }
      }
    }
    atomicMin(&s.token, found);
  }
  __syncthreads();
  if (threadIdx.x == 0) { s.group_token = s.token; s.group_last = s.last_kept; }
  cluster_barrier();
  if (rank == 0 && warp_id() == 0) {  // the drawn token, or (rounding) the last kept one
    const int g = lane_id();
    int token = g < SAMPLE_CLUSTER ? remote(&s.group_token, g) : 0x7fffffff;
    int last_kept = g < SAMPLE_CLUSTER ? remote(&s.group_last, g) : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      token = min(token, __shfl_xor_sync(0xffffffffu, token, o));
      last_kept = max(last_kept, __shfl_xor_sync(0xffffffffu, last_kept, o));
    }
    if (g == 0) {
      token = token != 0x7fffffff ? token : last_kept;
      out[r] = token;
      row.seen[token] = 1;
    }
  }
  cluster_barrier();  // no group leaves while rank 0 may still read its shared memory
}

#if SAMPLE_CLUSTER > 1
#define CLUSTER_DIMS __cluster_dims__(SAMPLE_CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS
#endif

#define SAMPLE(SFX, T)                                                                         \
  extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(SAMPLE_THREADS) sample_##SFX(      \
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
