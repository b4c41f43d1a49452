// nn.cu's attention_decode_fused (one token against the cache in one launch, by chunks of
// the cache merged by the last group); included by nn.cu only.
#pragma once
#include "common.cuh"
#include "attention.cuh"

// ---- attention_decode: one token against the cache, position read from device memory ------
// CUDA implements it as one launch (feature "decode_fused"; the two-kernel form of the
// common ABI is Metal's). Group (KV head h, chunk s) of 128 threads. Latency is what counts
// (a chunk is 16 KiB of keys and values), so the dependent memory round trips are few: after
// the position, the chunk's cached keys and values (positions before p) are loaded into
// registers with 16-byte loads, all in flight together with the queries' loads; the roped
// queries go to shared memory, the group whose chunk holds p writes the roped key and the
// value both to the cache and straight into its staged tile, then the registers are stored
// to the tile. Threads over (head, position) score, a warp per head takes the chunk's max
// and sum of exp, and threads over (head, column) sum p·V. Partials per (query head, chunk)
// are merged by the group that finishes last.
namespace dec {
// row stride of the staged key/value tiles: rows of 2-byte values padded to an odd number of
// 4-byte words, others by one element, so the lanes of a warp (a position each) read
// different banks
template <class T> __host__ __device__ constexpr int tile_stride(int d) {
  return d + (sizeof(T) == 2 ? 2 : 1);
}
constexpr int STAGE_VECS = 8;  // 16-byte vectors of K (and of V) a thread holds in flight

// shared memory: Q (G, D) and S (G, chunk) in C, then the chunk's keys and values (T)
template <class T, class C>
__device__ __forceinline__ void split(const T* __restrict__ qkv, const T* __restrict__ cs,
                                      const T* __restrict__ sn, const int* __restrict__ position,
                                      T* keys, T* values, C* part_o, C* part_ml,
                                      const DecodeParams& p, unsigned char* smem_raw) {
  const i64 pos = position[0];
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) return;  // combine writes NaN
  const i64 h = blockIdx.x, s = blockIdx.y, start = s * p.chunk;
  const i64 lo = window_start(pos, p.window);  // positions before lo score -inf
  if (start > pos || start + p.chunk <= lo) return;
  const int D = (int)p.head_dim, half = D / 2, G = (int)(p.q_heads / p.kv_heads);
  const int n = (int)((start + p.chunk < pos + 1 ? start + p.chunk : pos + 1) - start);
  const bool holds = pos < start + p.chunk;  // row n - 1 is the new position
  const int cached = holds ? n - 1 : n;      // rows already in the cache
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32;
  const int KS = tile_stride<T>(D), chunk = (int)p.chunk;
  C* Q = reinterpret_cast<C*>(smem_raw);  // (G, D) roped queries
  C* S = Q + G * D;                       // (G, chunk) scores, then exp(score - max)
  T* Kt = reinterpret_cast<T*>(S + G * chunk);  // (chunk, KS) keys of the chunk
  T* Vt = Kt + chunk * KS;                      // (chunk, KS) values
  T* kc = keys + h * p.capacity * D;
  T* vc = values + h * p.capacity * D;
  const T* kbase = kc + start * D;
  const T* vbase = vc + start * D;
  // 1. the cached rows' loads, issued first (16-byte vectors into registers)
  constexpr int V = 16 / sizeof(T);
  const bool vec = D % V == 0 && aligned16(kc) && aligned16(vc);
  const int per_row = D / V, total = vec ? cached * per_row : 0;
  Vec<T, V> kreg[STAGE_VECS], vreg[STAGE_VECS];
#pragma unroll
  for (int u = 0; u < STAGE_VECS; u++) {
    const int idx = tid + u * nt;
    if (idx < total) {
      const int t = idx / per_row, d = (idx % per_row) * V;
      kreg[u] = *reinterpret_cast<const Vec<T, V>*>(kbase + t * D + d);
      vreg[u] = *reinterpret_cast<const Vec<T, V>*>(vbase + t * D + d);
    }
  }
  // 2. roped queries, meanwhile
  const T* c_row = cs + pos * half;
  const T* s_row = sn + pos * half;
  for (int idx = tid; idx < G * half; idx += nt) {
    const int g = idx / half, i = idx % half;
    const T* qh = qkv + (h * G + g) * D;
    const C x1 = load(qh[i]), x2 = load(qh[i + half]);
    const C c = load(c_row[i]), sv = load(s_row[i]);
    Q[g * D + i] = (C)load(store<T>(x1 * c - x2 * sv));  // rounded as rope's output is
    Q[g * D + i + half] = (C)load(store<T>(x2 * c + x1 * sv));
  }
  // 3. the new position's key (roped) and value: to the cache and to the tile's last row
  if (holds) {
    const T* kh = qkv + (p.q_heads + h) * D;
    const T* vh = qkv + (p.q_heads + p.kv_heads + h) * D;
    T* krow = Kt + (n - 1) * KS;
    T* vrow = Vt + (n - 1) * KS;
    for (int i = tid; i < half; i += nt) {
      const C x1 = load(kh[i]), x2 = load(kh[i + half]);
      const C c = load(c_row[i]), sv = load(s_row[i]);
      const T k1 = store<T>(x1 * c - x2 * sv), k2 = store<T>(x2 * c + x1 * sv);
      kc[pos * D + i] = krow[i] = k1;
      kc[pos * D + i + half] = krow[i + half] = k2;
    }
    for (int i = tid; i < D; i += nt) vc[pos * D + i] = vrow[i] = vh[i];
  }
  // 4. the cached rows into the tile: from the registers, or (unaligned or odd head sizes,
  // or more rows than the registers hold) element by element
  auto put = [&](int idx, const Vec<T, V>& kv, const Vec<T, V>& vv) {  // vector idx -> tile
    const int t = idx / per_row, d = (idx % per_row) * V;
#pragma unroll
    for (int e = 0; e < V; e++) {
      Kt[t * KS + d + e] = kv.v[e];
      Vt[t * KS + d + e] = vv.v[e];
    }
  };
#pragma unroll
  for (int u = 0; u < STAGE_VECS; u++)
    if (tid + u * nt < total) put(tid + u * nt, kreg[u], vreg[u]);
  if (vec) {
    for (int idx = tid + STAGE_VECS * nt; idx < total; idx += nt) {
      const int t = idx / per_row, d = (idx % per_row) * V;
      put(idx, *reinterpret_cast<const Vec<T, V>*>(kbase + t * D + d),
          *reinterpret_cast<const Vec<T, V>*>(vbase + t * D + d));
    }
  } else {
    for (int idx = tid; idx < cached * D; idx += nt) {
      const int t = idx / D, d = idx % D;
      Kt[t * KS + d] = kbase[t * D + d];
      Vt[t * KS + d] = vbase[t * D + d];
    }
  }
  __syncthreads();
  const C scale = (C)p.scale + (C)p.scale_lo;
  for (int idx = tid; idx < G * n; idx += nt) {  // a warp: 32 positions of one head
    const int g = idx / n, t = idx % n;
    const C* qg = Q + g * D;
    const T* kr = Kt + t * KS;
    C acc = C(0);
#pragma unroll 8
    for (int d = 0; d < D; d++) acc += qg[d] * (C)load(kr[d]);
    S[g * chunk + t] = start + t < lo ? neg_inf<C>() : soft_cap(acc * scale, p.softcap);
  }
  __syncthreads();
  for (int g = warp; g < G; g += nt / 32) {  // a warp per head: max, exp, sum
    C* sg = S + g * chunk;
    C m = neg_inf<C>();
    for (int t = lane; t < n; t += 32) m = nan_max(m, sg[t]);
    m = warp_max(m);
    C l = C(0);
    for (int t = lane; t < n; t += 32) {
      const C e = m_exp(sg[t] - m);
      sg[t] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      const i64 slot = (h * G + g) * p.splits + s;
      part_ml[slot * 2] = m;
      part_ml[slot * 2 + 1] = l;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += nt) {  // a warp: 32 columns of one head
    const int g = idx / D, j = idx % D;
    const C* sg = S + g * chunk;
    const T* vcol = Vt + j;
    C acc = C(0);
#pragma unroll 8
    for (int t = 0; t < n; t++) acc += sg[t] * (C)load(vcol[t * KS]);
    part_o[((h * G + g) * p.splits + s) * D + j] = acc;
  }
}

// split() and then, in the group that finishes last for its KV head (a counter per KV head,
// reset by that group), the merge of the group's query heads: one launch instead of two.
// Partials written by other groups are read with ld.cg (L2), after their __threadfence.
// Extra shared memory after split's: weights (G, splits) and sums (G) in C.
template <class T, class C>
__device__ __forceinline__ void fused(const T* __restrict__ qkv, const T* __restrict__ cs,
                                      const T* __restrict__ sn, const int* __restrict__ position,
                                      T* keys, T* values, C* part_o, C* part_ml,
                                      T* __restrict__ out, unsigned* counters,
                                      const DecodeParams& p, unsigned char* smem_raw) {
  const i64 pos = position[0];
  const int D = (int)p.head_dim, G = (int)(p.q_heads / p.kv_heads);
  const i64 h = blockIdx.x;
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) {
    if (blockIdx.y == 0)
      for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x)
        out[h * G * D + idx] = store<T>(C(0) / C(0));
    return;
  }
  // chunks first..used-1 hold positions the step attends to: the others are not counted
  const int first = (int)(window_start(pos, p.window) / p.chunk), used = (int)(pos / p.chunk + 1);
  if ((int)blockIdx.y < first || (i64)blockIdx.y * p.chunk > pos) return;
  split<T, C>(qkv, cs, sn, position, keys, values, part_o, part_ml, p, smem_raw);
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(counters + h, 1u) == (unsigned)(used - first - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int chunk = (int)p.chunk, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t tiles = (size_t)G * (D + chunk) * sizeof(C) +
                       2 * (size_t)chunk * tile_stride<T>(D) * sizeof(T);
  C* W = reinterpret_cast<C*>(smem_raw + (tiles + 15) / 16 * 16);  // (G, splits) weights
  C* L = W + G * p.splits;                                          // (G) sums
  for (int g = warp; g < G; g += blockDim.x / 32) {  // a warp per head: weights of the splits
    const C* ml = part_ml + (h * G + g) * p.splits * 2;
    C m = neg_inf<C>(), lsum = C(0);
    if (used - first <= 32) {  // the common case: one (max, sum) pair per lane, loaded once
      const int s = first + lane;
      const C mi = s < used ? __ldcg(ml + s * 2) : neg_inf<C>();
      const C li = s < used ? __ldcg(ml + s * 2 + 1) : C(0);
      m = warp_max(nan_max(m, mi));
      const C w = s < used ? m_exp(mi - m) : C(0);
      if (s < used) W[g * p.splits + s] = w;
      lsum = li * w;
    } else {
      for (int s = first + lane; s < used; s += 32) m = nan_max(m, __ldcg(ml + s * 2));
      m = warp_max(m);
      for (int s = first + lane; s < used; s += 32) {
        const C w = m_exp(__ldcg(ml + s * 2) - m);
        W[g * p.splits + s] = w;
        lsum += __ldcg(ml + s * 2 + 1) * w;
      }
    }
    lsum = warp_sum(lsum);
    if (lane == 0) L[g] = lsum;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, j = idx % D;
    const i64 hq = h * G + g;
    const C* po = part_o + hq * p.splits * D + j;
    const C* wg = W + g * p.splits;
    C o = C(0);
#pragma unroll 8  // eight partial rows in flight per thread
    for (int s = first; s < used; s++) o += __ldcg(po + (i64)s * D) * wg[s];
    out[hq * D + j] = store<T>(o / L[g]);
  }
  if (threadIdx.x == 0) counters[h] = 0u;  // ready for the next launch
}

}  // namespace dec
