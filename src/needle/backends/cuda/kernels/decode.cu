// The decode step's fused projections (numpy_ref/decode.py; docs/kernels.md, "decode"):
//   rmsnorm_gemv_*         out[j] = (W h)[j],                h = rmsnorm(x) * nw, rounded to T
//   rmsnorm_gemv_swiglu_*  out[j] = silu(g) * u,  g = (W h)[j], u = (W h)[p + j], each rounded
//   gemv_add_*             x[j] = x[j] + (W a)[j], in place (the residual stream)
// One token (a single row). W is (rows, k) as checkpoints store it; each warp streams whole
// rows with 16-byte loads that bypass L1, as gemv_t does. What is new is the order of work in
// a group: its weight rows are asked for first (an L2 prefetch of the group's whole slice, and
// the warp's first 8 loads into registers), because they do not depend on the previous
// kernel; only then does the group wait for that kernel (griddepcontrol.wait) and read the
// vector it wrote: the norm's sum of squares and h (into shared memory) overlap the loads.
#include "common.cuh"

struct FusedGemvParams {  // gpu/array.py FUSED_GEMV
  i64 k, p, rows_per_warp;
  float eps;
  int prefetch;  // 1: prefetch the group's weight slice into L2 (sm_90 bulk prefetch)
};

namespace fg {
constexpr int WARPS = 8, THREADS = WARPS * 32, U = 8;

// bytes of W from row `row` on, into L2, asynchronously (one thread)
__device__ __forceinline__ void prefetch_rows(const void* row, u64 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* p = static_cast<const char*>(row);
  while (bytes) {  // the instruction takes a 32-bit size
    const u32 n = bytes > (1u << 30) ? (1u << 30) : (u32)bytes;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
    p += n;
    bytes -= n;
  }
#endif
}

// The warp's dot products of R weight rows with the vector v (16-byte vectors, nv of them;
// v in shared or global memory). `first` holds the rows' first round of loads, issued early.
template <class T, int R>
struct Rows {
  static constexpr int V = 16 / sizeof(T);
  typedef Vec<T, V> Vt;
  Vt w[R][U];

  __device__ __forceinline__ void fetch(const Vt* const (&rows)[R], i64 base, i64 nv) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const i64 q = base + u * 32;
      if (q < nv) {
#pragma unroll
        for (int r = 0; r < R; r++) w[r][u] = ld_stream<T, V>(rows[r] + q);
      }
    }
  }

  // acc[r] = sum over k of rows[r][k] * v[k], summed over the warp (every lane gets it)
  __device__ __forceinline__ void dot(const Vt* const (&rows)[R], const Vt* v, i64 nv,
                                     bool preloaded, float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (i64 base = lane; base < nv; base += 32 * U) {
      if (!(preloaded && base == lane)) fetch(rows, base, nv);
#pragma unroll
      for (int u = 0; u < U; u++) {
        const i64 q = base + u * 32;
        if (q < nv) {
          const Vt x = v[q];
#pragma unroll
          for (int r = 0; r < R; r++)
#pragma unroll
            for (int e = 0; e < V; e++) acc[r] += load(w[r][u].v[e]) * load(x.v[e]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
  }
};

// rows of this warp: [first, first + count) of p outputs
struct Span {
  i64 first, count;
  __device__ Span(const FusedGemvParams& p) {
    const i64 warp = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
    first = warp * p.rows_per_warp;
    const i64 left = p.p - first;
    count = left < 0 ? 0 : (left < p.rows_per_warp ? left : p.rows_per_warp);
  }
};

// the group's rows [g0, g0 + n) of W (and, for SwiGLU, the up rows p + g0, ...) into L2
template <class T>
__device__ __forceinline__ void prefetch_group(const T* W, const FusedGemvParams& p,
                                               bool swiglu) {
  if (!p.prefetch || threadIdx.x != 0) return;
  const i64 per_group = (i64)WARPS * p.rows_per_warp, g0 = (i64)blockIdx.x * per_group;
  const i64 n = p.p - g0 < per_group ? p.p - g0 : per_group;
  if (n <= 0) return;
  const u64 bytes = (u64)n * p.k * sizeof(T);
  prefetch_rows(W + g0 * p.k, bytes);
  if (swiglu) prefetch_rows(W + (p.p + g0) * p.k, bytes);
}

// h = rmsnorm(x) * nw rounded to T, into shared memory; every thread of the group calls it
template <class T>
__device__ __forceinline__ void normed(const T* __restrict__ x, const T* __restrict__ nw, T* h,
                                       float* red, const FusedGemvParams& p) {
  typedef typename Acc<T>::type C;
  constexpr int V = 16 / sizeof(T);
  typedef Vec<T, V> Vt;
  const i64 nv = p.k / V;
  const Vt* xv = reinterpret_cast<const Vt*>(x);
  const Vt* wv = reinterpret_cast<const Vt*>(nw);
  C ss = C(0);
  for (i64 q = threadIdx.x; q < nv; q += THREADS) {
    const Vt a = xv[q];
#pragma unroll
    for (int e = 0; e < V; e++) {
      const C t = load(a.v[e]);
      ss += t * t;
    }
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = (float)ss;
  __syncthreads();
  ss = C(0);
#pragma unroll
  for (int w = 0; w < WARPS; w++) ss += (C)red[w];  // the same order in every thread
  const C rs = C(1) / m_sqrt(ss / (C)p.k + (C)p.eps);
  Vt* hv = reinterpret_cast<Vt*>(h);
  for (i64 q = threadIdx.x; q < nv; q += THREADS) {
    const Vt a = xv[q], g = wv[q];
    Vt o;
#pragma unroll
    for (int e = 0; e < V; e++) o.v[e] = store<T>(load(a.v[e]) * rs * load(g.v[e]));
    hv[q] = o;
  }
  __syncthreads();
}

template <class T, bool SWIGLU>
__device__ __forceinline__ void rmsnorm_gemv(const T* __restrict__ x, const T* __restrict__ nw,
                                             const T* __restrict__ W, T* __restrict__ out,
                                             const FusedGemvParams& p, T* h, float* red) {
  typedef typename Acc<T>::type C;
  constexpr int R = SWIGLU ? 2 : 1, V = 16 / sizeof(T);
  typedef Vec<T, V> Vt;
  const i64 nv = p.k / V;
  const Span span(p);
  prefetch_group(W, p, SWIGLU);
  Rows<T, R> rows;
  const Vt* first[R];
#pragma unroll
  for (int r = 0; r < R; r++)
    first[r] = reinterpret_cast<const Vt*>(W + (span.first + (r ? p.p : 0)) * p.k);
  if (span.count) rows.fetch(first, threadIdx.x & 31, nv);
  pdl_entry();  // x is the previous kernel's output
  normed<T>(x, nw, h, red, p);
  const Vt* hv = reinterpret_cast<const Vt*>(h);
  for (i64 i = 0; i < span.count; i++) {
    const i64 j = span.first + i;
    const Vt* row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = reinterpret_cast<const Vt*>(W + (j + (r ? p.p : 0)) * p.k);
    float acc[R];
    rows.dot(row, hv, nv, i == 0, acc);
    if ((threadIdx.x & 31) == 0) {
      if (SWIGLU) {
        const C g = load(store<T>((C)acc[0])), u = load(store<T>((C)acc[R - 1]));
        out[j] = store<T>(g * (C(0.5) * (m_tanh(C(0.5) * g) + C(1))) * u);  // swiglu's form
      } else {
        out[j] = store<T>((C)acc[0]);
      }
    }
  }
}

template <class T>
__device__ __forceinline__ void gemv_add(const T* __restrict__ a, const T* __restrict__ W,
                                         T* __restrict__ total, const FusedGemvParams& p) {
  typedef typename Acc<T>::type C;
  constexpr int V = 16 / sizeof(T);
  typedef Vec<T, V> Vt;
  const i64 nv = p.k / V;
  const Span span(p);
  prefetch_group(W, p, false);
  Rows<T, 1> rows;
  const Vt* first[1] = {reinterpret_cast<const Vt*>(W + span.first * p.k)};
  if (span.count) rows.fetch(first, threadIdx.x & 31, nv);
  pdl_entry();  // a and total are the previous kernels' outputs
  const Vt* av = reinterpret_cast<const Vt*>(a);
  for (i64 i = 0; i < span.count; i++) {
    const i64 j = span.first + i;
    const Vt* row[1] = {reinterpret_cast<const Vt*>(W + j * p.k)};
    float acc[1];
    rows.dot(row, av, nv, i == 0, acc);
    if ((threadIdx.x & 31) == 0)
      total[j] = store<T>((C)load(total[j]) + (C)load(store<T>((C)acc[0])));
  }
}
}  // namespace fg

// h (k values of T) in dynamic shared memory after the group's WARPS partial sums
#define FUSED_GEMV(SFX, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(fg::THREADS)                                    \
      rmsnorm_gemv_##SFX(const T* __restrict__ x, const T* __restrict__ nw,                    \
                         const T* __restrict__ w, T* __restrict__ out, FusedGemvParams p) {    \
    extern __shared__ __align__(16) float fg_smem[];                                           \
    fg::rmsnorm_gemv<T, false>(x, nw, w, out, p, reinterpret_cast<T*>(fg_smem + 4 * fg::WARPS), \
                               fg_smem);                                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::THREADS)                                    \
      rmsnorm_gemv_swiglu_##SFX(const T* __restrict__ x, const T* __restrict__ nw,             \
                                const T* __restrict__ w, T* __restrict__ out,                  \
                                FusedGemvParams p) {                                           \
    extern __shared__ __align__(16) float fg_smem[];                                           \
    fg::rmsnorm_gemv<T, true>(x, nw, w, out, p, reinterpret_cast<T*>(fg_smem + 4 * fg::WARPS), \
                              fg_smem);                                                        \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::THREADS)                                    \
      gemv_add_##SFX(const T* __restrict__ a, const T* __restrict__ w, T* total,               \
                     FusedGemvParams p) {                                                      \
    fg::gemv_add<T>(a, w, total, p);                                                           \
  }

ONLY(f16, FUSED_GEMV(f16, half_t))
ONLY(bf16, FUSED_GEMV(bf16, bf16_t))
ONLY(f32, FUSED_GEMV(f32, float))
