// Products of one row (decoding) and of a few rows (m <= 8), included by matmul.cu: the
// device functions behind gemv_t_*, gemv_t_norm_*, gemv_t_add_*, gemv_glu*, gemv_n_*,
// gemv_combine_* and matmul_skinny_* (docs/kernels.md, "matmul"). P: matmul.cu's
// MatmulParams.
#pragma once
#include "common.cuh"

// out[j] = sum_k a[k] * B[j][k]: B stored (p, n); a warp per output, 16-byte loads along k.
// Bandwidth-bound (decoding streams every weight once per token), so each lane issues
// GEMV_UNROLL independent 16-byte loads of its row before using any (a 2048-long bf16 row is
// then one round trip), and the weights bypass L1 (ld_stream) so the activation vector stays
// there.
// gemv_glu (a decode step's gate/up projection and SwiGLU in one pass): B has 2p rows, gate
// rows first. Warps pair up: the first of a pair is gemv_t on gate row j, the second on up row
// p + j (the same loads and sums as gemv_t, so twice its warps and the same bytes in flight);
// the second hands its sum over in shared memory and the first writes silu(g) * u, each
// product rounded to T first (projection_out), as matmul then swiglu would.
// NORM (gemv_t_norm, gemv_glu_norm: the decode step's RMSNorm folded into the projection whose
// columns carry the norm's scale): each lane also sums a[k]^2 over the values it already
// loads, so every warp gets the same sum (same lanes, same order) with no pass of its own;
// the dot product is scaled by r = 1 / sqrt(mean(a^2) + eps) at the end: r * (B a), the
// normed vector never rounded. gemv_t_add: out[j] += the rounded product (the residual stream).
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 8
#endif

struct GemvParams { i64 n, p; float eps; };  // cuda/gemv.py GEMV_PARAMS

template <class T, bool NORM>
__device__ __forceinline__ void gemv_row(const T* __restrict__ a, const T* __restrict__ row,
                                         i64 K, typename Acc<T>::type& sum,
                                         typename Acc<T>::type& squares) {
  typedef typename Acc<T>::type Cmp;
  constexpr int V = 16 / sizeof(T), U = GEMV_UNROLL;
  Cmp acc = Cmp(0), sq = Cmp(0);
  i64 k = 0;
  if (aligned16(row) && aligned16(a)) {
    const i64 nv = K / V;
    const Vec<T, V>* rv = reinterpret_cast<const Vec<T, V>*>(row);
    const Vec<T, V>* av = reinterpret_cast<const Vec<T, V>*>(a);
    for (i64 base = threadIdx.x; base < nv; base += 32 * U) {
      Vec<T, V> x[U], y[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const i64 q = base + u * 32;
        if (q < nv) {
          x[u] = ld_stream<T, V>(rv + q);
          y[u] = av[q];
        }
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (base + u * 32 < nv) {
#pragma unroll
          for (int e = 0; e < V; e++) {
            const Cmp yv = load(y[u].v[e]);
            acc += load(x[u].v[e]) * yv;
            if (NORM) sq += yv * yv;
          }
        }
      }
    }
    k = nv * V;
  }
  for (k += threadIdx.x; k < K; k += 32) {
    const Cmp yv = load(a[k]);
    acc += load(row[k]) * yv;
    if (NORM) sq += yv * yv;
  }
  sum = warp_sum(acc);
  if (NORM) squares = warp_sum(sq);
}

// r = 1 / sqrt(mean(a^2) + eps) from a warp's sum of squares (nn.cu's rmsnorm formula)
template <class C> __device__ __forceinline__ C rms_factor(C squares, i64 K, float eps) {
  return C(1) / m_sqrt(squares / (C)K + (C)eps);
}

// KIND 0: out[j] = (B a)[j]; 1 (NORM): r * (B a)[j]; 2 (add): out[j] + (B a)[j] rounded first
template <class T, int KIND>
__device__ __forceinline__ void gemv_t(const T* __restrict__ a, const T* __restrict__ B,
                                       T* __restrict__ out, i64 n, i64 p, float eps) {
  typedef typename Acc<T>::type Cmp;
  const i64 j = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (j >= p) return;
  Cmp acc, squares = Cmp(0);
  gemv_row<T, KIND == 1>(a, B + j * n, n, acc, squares);
  if (threadIdx.x != 0) return;
  if (KIND == 1) acc *= rms_factor(squares, n, eps);
  out[j] = KIND == 2 ? projection_out<T, 2>((float)acc, 0.f, load(out[j])) : store<T>(acc);
}

// blockDim.y even: warps (2i, 2i + 1) of a group compute output blockIdx.x * blockDim.y / 2 + i;
// ACT: projection_out's kind, 1 SwiGLU, 3 GeGLU (gemv_geglu)
template <class T, bool NORM, int ACT = 1>
__device__ __forceinline__ void gemv_glu(const T* __restrict__ a, const T* __restrict__ B,
                                         T* __restrict__ out, i64 n, i64 p, float eps,
                                         float* handed) {
  typedef typename Acc<T>::type Cmp;
  const i64 j = (i64)blockIdx.x * (blockDim.y / 2) + threadIdx.y / 2;
  const bool up = threadIdx.y & 1, live = j < p;
  Cmp acc = Cmp(0), squares = Cmp(0);
  if (live) gemv_row<T, NORM>(a, B + (j + (up ? p : 0)) * n, n, acc, squares);
  if (NORM) acc *= rms_factor(squares, n, eps);  // the same factor in both warps of a pair
  if (up && threadIdx.x == 0) handed[threadIdx.y / 2] = (float)acc;
  __syncthreads();
  if (live && !up && threadIdx.x == 0)
    out[j] = projection_out<T, ACT>((float)acc, handed[threadIdx.y / 2], Cmp(0));
}

// part[s][j] = sum over this split's k of a[k] * B[k][j]: B stored (n, p); lanes over
// 16-byte column groups, warps over k, shared memory to sum the warps.
template <class T, class P>  // P: MatmulParams (matmul.cu)
__device__ __forceinline__ void gemv_n(const T* __restrict__ a, const T* __restrict__ B,
                                       float* __restrict__ part, const P& p,
                                       float* smem) {
  constexpr int V = 16 / sizeof(T);
  const i64 N = p.p, K = p.n;
  const bool vec = aligned16(B) && N % V == 0;
  const i64 j0 = ((i64)blockIdx.x * 32 + threadIdx.x) * V;
  const i64 k_begin = (i64)blockIdx.y * p.chunk;
  const i64 k_end = k_begin + p.chunk < K ? k_begin + p.chunk : K;
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; e++) acc[e] = 0.f;
  if (j0 < N) {
    for (i64 k = k_begin + threadIdx.y; k < k_end; k += blockDim.y) {
      const float ak = (float)load(a[k]);
      if (vec) {
        const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(B + k * N + j0);
#pragma unroll
        for (int e = 0; e < V; e++) acc[e] += ak * (float)load(x.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; e++)
          if (j0 + e < N) acc[e] += ak * (float)load(B[k * N + j0 + e]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; e++) smem[(threadIdx.y * 32 + threadIdx.x) * V + e] = acc[e];
  __syncthreads();
  if (threadIdx.y == 0 && j0 < N) {
    for (int y = 1; y < (int)blockDim.y; y++)
#pragma unroll
      for (int e = 0; e < V; e++) acc[e] += smem[(y * 32 + threadIdx.x) * V + e];
#pragma unroll
    for (int e = 0; e < V; e++)
      if (j0 + e < N) part[blockIdx.y * N + j0 + e] = acc[e];
  }
}

// out[z] = A[z] @ B[z] for m <= 8 rows, A (m, n) and B (n, p) row-major (the decode step's
// probs @ V, n the cache length): bandwidth-bound, B read once. A group of 256 threads owns
// 8 column groups of 16 bytes (lane % 8) and k slice [split*chunk, +chunk) of matrix z
// (blockIdx.y = split, blockIdx.z = z); its 32 rows of threads (tid / 8) take every 32nd k,
// 8 loads in flight each. The 32 partial sums of each output are added by shuffles within a
// warp (lanes l, l^8, l^16, l^24), then across the 8 warps in shared memory. With splits > 1
// the group writes float32 partials to part[(split*batch + z)*m*p + row*p + col] and
// gemv_combine adds the slices (its p = batch*m*p); with one split it writes out.
constexpr int SKINNY_M = 8, SKINNY_CG = 8, SKINNY_THREADS = 256, SKINNY_U = 8;
template <class T, class P>  // P: MatmulParams (matmul.cu)
__device__ __forceinline__ void skinny(const T* __restrict__ A, const T* __restrict__ B,
                                       T* __restrict__ out, float* __restrict__ part,
                                       const P& p, float* red) {
  constexpr int V = 16 / sizeof(T), KL = SKINNY_THREADS / SKINNY_CG, MV = SKINNY_M * V;
  const i64 M = p.m, K = p.n, N = p.p, groups = N / V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 cg = (i64)blockIdx.x * SKINNY_CG + (tid % SKINNY_CG);
  const i64 split = blockIdx.y, z = blockIdx.z;
  const bool live = cg < groups;
  const T* a = A + z * p.stride_a;
  const T* b = B + z * p.stride_b + (live ? cg : 0) * V;
  const i64 k0 = split * p.chunk, k1 = k0 + p.chunk < K ? k0 + p.chunk : K;
  float acc[SKINNY_M][V];
#pragma unroll
  for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
    for (int e = 0; e < V; e++) acc[r][e] = 0.f;
  if (live) {
    for (i64 kb = k0 + tid / SKINNY_CG; kb < k1; kb += KL * SKINNY_U) {
      Vec<T, V> x[SKINNY_U];
#pragma unroll
      for (int u = 0; u < SKINNY_U; u++)
        if (kb + u * KL < k1) x[u] = *reinterpret_cast<const Vec<T, V>*>(b + (kb + u * KL) * N);
#pragma unroll
      for (int u = 0; u < SKINNY_U; u++) {
        const i64 k = kb + u * KL;
        if (k >= k1) continue;
#pragma unroll
        for (int r = 0; r < SKINNY_M; r++) {
          if (r >= M) continue;
          const float ar = (float)load(a[r * K + k]);
#pragma unroll
          for (int e = 0; e < V; e++) acc[r][e] += ar * (float)load(x[u].v[e]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
    for (int e = 0; e < V; e++) {
      float v = acc[r][e];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      acc[r][e] = v;
    }
  // red[warp][column group][row * V + e]
  if (lane < SKINNY_CG) {
#pragma unroll
    for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
      for (int e = 0; e < V; e++) red[(warp * SKINNY_CG + lane) * MV + r * V + e] = acc[r][e];
  }
  __syncthreads();
  for (int i = tid; i < SKINNY_CG * MV; i += SKINNY_THREADS) {
    const int c = i / MV, r = (i % MV) / V, e = i % V;
    const i64 col_group = (i64)blockIdx.x * SKINNY_CG + c;
    if (r >= M || col_group >= groups) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < SKINNY_THREADS / 32; w++) v += red[(w * SKINNY_CG + c) * MV + r * V + e];
    const i64 col = col_group * V + e;
    if (p.splits == 1) {
      out[(z * M + r) * N + col] = store<T>((typename Acc<T>::type)v);
    } else {
      part[((split * p.batch + z) * M + r) * N + col] = v;
    }
  }
}

// out[j] = sum over the splits of part[q * p + j]: 8 independent loads in flight per thread
template <class T, class P>  // P: MatmulParams (matmul.cu)
__device__ __forceinline__ void gemv_combine(const float* __restrict__ part, T* __restrict__ out,
                                             const P& p) {
  const i64 t0 = global_thread(), step = grid_threads();
  for (i64 j = t0; j < p.p; j += step) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    i64 q = 0;
    for (; q + 8 <= p.splits; q += 8) {
#pragma unroll
      for (int u = 0; u < 8; u++) s[u] += part[(q + u) * p.p + j];
    }
    for (; q < p.splits; q++) s[0] += part[q * p.p + j];
    out[j] = store<T>((typename Acc<T>::type)(((s[0] + s[1]) + (s[2] + s[3])) +
                                              ((s[4] + s[5]) + (s[6] + s[7]))));
  }
}
