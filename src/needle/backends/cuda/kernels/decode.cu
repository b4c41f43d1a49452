// The decode step's fused projections (numpy_ref/decode.py; docs/kernels.md, "decode"):
//   rmsnorm_gemv_*         out[j] = r * (W (x * nw))[j],      r = 1 / sqrt(mean(x^2) + eps)
//   rmsnorm_gemv_swiglu_*  out[j] = silu(g) * u,  g = r (W (x nw))[j], u = r (W (x nw))[p + j]
//   gemv_add_*             x[j] = x[j] + (W a)[j], in place (the residual stream)
// One token (a single row). W is (rows, k) as checkpoints store it; a warp streams whole rows
// with 16-byte loads that bypass L1 (ld_stream), reading x and nw (L1-cached) in the same
// rounds, so the norm costs no extra pass, synchronization or shared memory: each warp sums
// x^2 along with its dot product (every warp in the same order, so r is the same in all) and
// scales its sums by r at the end. The normed vector stays in float32 (the composed ops round
// it to T first): within the dtype's tolerance of the definition, and closer to float64.
// Option (params.flags): FG_PREFETCH asks for the group's weight rows in L2 before waiting for
// the previous kernel (griddepcontrol.wait), since weights do not depend on it.
#include "common.cuh"

struct FusedGemvParams {  // gpu/array.py FUSED_GEMV
  i64 k, p, rows_per_warp;
  float eps;
  int flags;  // FG_PREFETCH
};
constexpr int FG_PREFETCH = 1;

namespace fg {
// groups of 4 warps; at least 5 groups per SM caps registers at 102 per thread, so that
// 20 warps per SM keep their loads in flight (gemv_t's occupancy; without the cap, v2's
// rounds of 8 vectors of each of w, x and nw took 171-228 registers, 2-3 groups per SM)
constexpr int MAX_THREADS = 128, MIN_GROUPS = 5;

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

// R weight rows of one warp against the vector x (times nw, for a norm), 16-byte vectors.
// A round loads U vectors of each row, of x and of nw together (as gemv_t does), so every
// load of the round is in flight at once; U keeps a round at 16 vectors per lane (gemv_t's
// 8 weight + 8 activation vectors), which with at least 5 groups per SM fits 96 registers.
template <class T, int R, bool NORM>
struct Rows {
  static constexpr int V = 16 / sizeof(T), U = NORM ? 16 / (R + 2) : 7;  // 7: room for the residual
  typedef Vec<T, V> Vt;
  Vt w[R][U], xv[U], gv[U];

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

  __device__ __forceinline__ void fetch_x(const Vt* x, const Vt* nw, i64 base, i64 nv) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const i64 q = base + u * 32;
      if (q < nv) {
        xv[u] = x[q];
        if (NORM) gv[u] = nw[q];
      }
    }
  }

  // acc[r] = sum over k of rows[r][k] * x[k] (* nw[k]), and ss = sum of x[k]^2, summed over
  // the warp
  __device__ __forceinline__ void dot(const Vt* const (&rows)[R], const Vt* x, const Vt* nw,
                                     i64 nv, float (&acc)[R], float& ss) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    ss = 0.f;
    for (i64 base = lane; base < nv; base += 32 * U) {
      fetch(rows, base, nv);
      fetch_x(x, nw, base, nv);
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (base + u * 32 < nv) {
#pragma unroll
          for (int e = 0; e < V; e++) {
            float xe = load(xv[u].v[e]);
            if (NORM) {
              ss += xe * xe;
              xe *= load(gv[u].v[e]);
            }
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += load(w[r][u].v[e]) * xe;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
    if (NORM) ss = warp_sum(ss);
  }
};

// rows of this warp: [first, first + count) of p outputs
struct Span {
  i64 first, count;
  __device__ Span(const FusedGemvParams& p) {
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    first = warp * p.rows_per_warp;
    const i64 left = p.p - first;
    count = left < 0 ? 0 : (left < p.rows_per_warp ? left : p.rows_per_warp);
  }
};

// the group's rows [g0, g0 + n) of W (and, for SwiGLU, the up rows p + g0, ...) into L2
template <class T>
__device__ __forceinline__ void prefetch_group(const T* W, const FusedGemvParams& p,
                                               bool swiglu) {
  if (!(p.flags & FG_PREFETCH) || threadIdx.x != 0) return;
  const i64 per_group = (i64)(blockDim.x / 32) * p.rows_per_warp, g0 = blockIdx.x * per_group;
  const i64 n = p.p - g0 < per_group ? p.p - g0 : per_group;
  if (n <= 0) return;
  const u64 bytes = (u64)n * p.k * sizeof(T);
  prefetch_rows(W + g0 * p.k, bytes);
  if (swiglu) prefetch_rows(W + (p.p + g0) * p.k, bytes);
}

// KIND 0: rmsnorm_gemv, 1: rmsnorm_gemv_swiglu, 2: gemv_add (x is then a, and out total)
template <class T, int KIND>
__device__ __forceinline__ void fused_gemv(const T* __restrict__ x, const T* __restrict__ nw,
                                           const T* __restrict__ W, T* out,
                                           const FusedGemvParams& p) {
  typedef typename Acc<T>::type C;
  constexpr int R = KIND == 1 ? 2 : 1, V = 16 / sizeof(T);
  constexpr bool NORM = KIND != 2;
  typedef Vec<T, V> Vt;
  const i64 nv = p.k / V;
  const Span span(p);
  prefetch_group(W, p, KIND == 1);
  Rows<T, R, NORM> rows;
  pdl_entry();  // x (and total) are the previous kernels' outputs
  const Vt* xv = reinterpret_cast<const Vt*>(x);
  const Vt* gv = reinterpret_cast<const Vt*>(nw);
  for (i64 i = 0; i < span.count; i++) {
    const i64 j = span.first + i;
    const Vt* row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = reinterpret_cast<const Vt*>(W + (j + (r ? p.p : 0)) * p.k);
    // the residual's old value, asked for now so that its latency hides behind the dot
    const C before = KIND == 2 && (threadIdx.x & 31) == 0 ? (C)load(out[j]) : C(0);
    float acc[R], ss;
    rows.dot(row, xv, gv, nv, acc, ss);
    if ((threadIdx.x & 31) != 0) continue;
    if (KIND == 2) {
      out[j] = store<T>(before + (C)load(store<T>((C)acc[0])));
      continue;
    }
    const C rs = C(1) / m_sqrt((C)ss / (C)p.k + (C)p.eps);
    if (KIND == 1) {
      const C g = load(store<T>((C)acc[0] * rs)), u = load(store<T>((C)acc[R - 1] * rs));
      out[j] = store<T>(g * (C(0.5) * (m_tanh(C(0.5) * g) + C(1))) * u);  // swiglu's form
    } else {
      out[j] = store<T>((C)acc[0] * rs);
    }
  }
}
}  // namespace fg

#define FUSED_GEMV(SFX, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      rmsnorm_gemv_##SFX(const T* __restrict__ x, const T* __restrict__ nw,                    \
                         const T* __restrict__ w, T* __restrict__ out, FusedGemvParams p) {    \
    fg::fused_gemv<T, 0>(x, nw, w, out, p);                                                    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      rmsnorm_gemv_swiglu_##SFX(const T* __restrict__ x, const T* __restrict__ nw,             \
                                const T* __restrict__ w, T* __restrict__ out,                  \
                                FusedGemvParams p) {                                           \
    fg::fused_gemv<T, 1>(x, nw, w, out, p);                                                    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      gemv_add_##SFX(const T* __restrict__ a, const T* __restrict__ w, T* total,               \
                     FusedGemvParams p) {                                                      \
    fg::fused_gemv<T, 2>(a, a, w, total, p);                                                   \
  }

ONLY(f16, FUSED_GEMV(f16, half_t))
ONLY(bf16, FUSED_GEMV(bf16, bf16_t))
ONLY(f32, FUSED_GEMV(f32, float))
