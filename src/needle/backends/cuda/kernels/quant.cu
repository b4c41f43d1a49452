// Weight-only quantized matrices (docs/quantization.md; numpy_ref/quant.py is the reference).
//  * qmv{8,4}_{f16,bf16,f32}: out (m, n) = x (m, k) @ W.T for small m (decoding), one warp per
//    QMV_ROWS rows of W. Bandwidth-bound: each lane issues QMV_UNROLL x QMV_ROWS independent
//    16-byte loads of packed weights (bypassing L1, so x stays there) before using any; values
//    become floats in registers (a byte_perm into the mantissa of 2^23, minus 2^23), are dotted
//    with x, and each 16-byte chunk's dot is scaled once (chunks never straddle a group).
//  * dequant{8,4}_{f16,bf16,f32}: W (n, k) in the activation dtype, for prefill products
//    (the generic GPU backend then runs the dtype's GEMM).
#include "common.cuh"

#ifndef QMV_ROWS
#define QMV_ROWS 2
#endif
#ifndef QMV_UNROLL
#define QMV_UNROLL 4
#endif

struct QuantParams { i64 m, n, k, words, groups, group, has_offsets; };

// Byte j (0..3) of `v` as a float: the byte placed in the low mantissa bits of 2^23.
template <int J> __device__ __forceinline__ float byte_f(u32 v) {
  return __uint_as_float(__byte_perm(v, 0x4B00u, 0x5440u | J)) - 8388608.0f;
}

// The stored value of element j of a row (slow path: any k and group).
template <int BITS> __device__ __forceinline__ float value_at(const u32* row, i64 j) {
  if (BITS == 8) return (float)(signed char)((row[j >> 2] >> ((j & 3) * 8)) & 0xFFu);
  return (float)((row[j >> 3] >> ((j & 7) * 4)) & 15u);
}

template <class T, int E> __device__ __forceinline__ void load_x(const T* x, float (&xf)[E]) {
  constexpr int V = 16 / sizeof(T);
  const Vec<T, V>* xv = reinterpret_cast<const Vec<T, V>*>(x);
#pragma unroll
  for (int i = 0; i < E / V; i++) {
    const Vec<T, V> v = xv[i];
#pragma unroll
    for (int e = 0; e < V; e++) xf[i * V + e] = load(v.v[e]);
  }
}

// sum_e x[e] * stored value e of a 16-byte chunk (int4: nibbles 0..15; int8: signed bytes).
template <int BITS, int E>
__device__ __forceinline__ float chunk_dot(const uint4& w, const float (&xf)[E]) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
  float d0 = 0.f, d1 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if (BITS == 4) {
      const u32 lo = words[i] & 0x0F0F0F0Fu, hi = (words[i] >> 4) & 0x0F0F0F0Fu;
      const float* xs = xf + 8 * i;  // element 8i + 2j is lo byte j, 8i + 2j + 1 hi byte j
      d0 = fmaf(xs[0], byte_f<0>(lo), d0); d1 = fmaf(xs[1], byte_f<0>(hi), d1);
      d0 = fmaf(xs[2], byte_f<1>(lo), d0); d1 = fmaf(xs[3], byte_f<1>(hi), d1);
      d0 = fmaf(xs[4], byte_f<2>(lo), d0); d1 = fmaf(xs[5], byte_f<2>(hi), d1);
      d0 = fmaf(xs[6], byte_f<3>(lo), d0); d1 = fmaf(xs[7], byte_f<3>(hi), d1);
    } else {
      const u32 u = words[i] ^ 0x80808080u;  // signed byte q -> q + 128
      const float* xs = xf + 4 * i;
      d0 = fmaf(xs[0], byte_f<0>(u) - 128.0f, d0); d1 = fmaf(xs[1], byte_f<1>(u) - 128.0f, d1);
      d0 = fmaf(xs[2], byte_f<2>(u) - 128.0f, d0); d1 = fmaf(xs[3], byte_f<3>(u) - 128.0f, d1);
    }
  }
  return d0 + d1;
}

// A chunk's dot and x-sum -> its contribution: s * dot (+ b * xsum), int4 symmetric
// s * (dot - 8 * xsum).
template <int BITS>
__device__ __forceinline__ float scaled(float dot, float xsum, float s, const float* b, i64 at) {
  if (b) return fmaf(s, dot, b[at] * xsum);
  return BITS == 4 ? s * fmaf(-8.0f, xsum, dot) : s * dot;
}

template <class T, int BITS>
__device__ __forceinline__ void qmv(const T* __restrict__ x, const u32* __restrict__ q,
                                    const float* __restrict__ s, const float* __restrict__ b,
                                    T* __restrict__ out, const QuantParams& p) {
  constexpr int R = QMV_ROWS, U = QMV_UNROLL, E = 128 / BITS;  // E: elements per chunk
  const i64 row0 = ((i64)blockIdx.x * blockDim.y + threadIdx.y) * R;
  if (row0 >= p.n) return;
  const int lane = threadIdx.x;
  x += (i64)blockIdx.y * p.k;
  out += (i64)blockIdx.y * p.n;
  if (!p.has_offsets) b = nullptr;
  i64 rows[R];
#pragma unroll
  for (int i = 0; i < R; i++) rows[i] = row0 + i < p.n ? row0 + i : row0;  // dup: no write
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) acc[i] = 0.f;
  const bool vec = p.k % E == 0 && p.group % E == 0 && aligned16(q) && aligned16(x);
  if (vec) {
    const i64 chunks = p.k / E, per_row = p.words / 4;
    const uint4* qv = reinterpret_cast<const uint4*>(q);
    for (i64 c0 = lane; c0 < chunks; c0 += 32 * U) {
      uint4 w[U][R];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const i64 c = c0 + 32 * u;
#pragma unroll
        for (int i = 0; i < R; i++) {
          if (c < chunks) {
            const uint4* ptr = qv + rows[i] * per_row + c;
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(w[u][i].x), "=r"(w[u][i].y), "=r"(w[u][i].z), "=r"(w[u][i].w)
                         : "l"(ptr));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const i64 c = c0 + 32 * u;
        if (c >= chunks) break;
        float xf[E];
        load_x<T, E>(x + c * E, xf);
        float xsum = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) xsum += xf[e];
        const i64 g = c * E / p.group;
#pragma unroll
        for (int i = 0; i < R; i++) {
          const i64 at = rows[i] * p.groups + g;
          acc[i] += scaled<BITS>(chunk_dot<BITS, E>(w[u][i], xf), xsum, s[at], b, at);
        }
      }
    }
  } else {
    for (i64 j = lane; j < p.k; j += 32) {
      const float xj = load(x[j]);
      const i64 g = j / p.group;
#pragma unroll
      for (int i = 0; i < R; i++) {
        const i64 at = rows[i] * p.groups + g;
        const float v = value_at<BITS>(q + rows[i] * p.words, j);
        const float w = b ? fmaf(v, s[at], b[at]) : (BITS == 4 ? v - 8.0f : v) * s[at];
        acc[i] = fmaf(xj, w, acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; i++) {
    const float total = warp_sum(acc[i]);
    if (lane == 0 && row0 + i < p.n) out[row0 + i] = store<T>(total);
  }
}

// One thread per packed word: its 4 (int8) or 8 (int4) elements of W, in out's dtype.
template <class T, int BITS>
__device__ __forceinline__ void dequant(const u32* __restrict__ q, const float* __restrict__ s,
                                        const float* __restrict__ b, T* __restrict__ out,
                                        const QuantParams& p) {
  constexpr int PER = 32 / BITS;
  if (!p.has_offsets) b = nullptr;
  const i64 total = p.n * p.words;
  for (i64 t = global_thread(); t < total; t += grid_threads()) {
    const i64 r = t / p.words, j0 = (t - r * p.words) * PER;
    const u32 word = q[t];
#pragma unroll
    for (int e = 0; e < PER; e++) {
      const i64 j = j0 + e;
      if (j >= p.k) break;
      const i64 at = r * p.groups + j / p.group;
      const u32 bitsv = (word >> (e * BITS)) & ((1u << BITS) - 1u);
      const float v = BITS == 8 ? (float)(signed char)bitsv : (float)bitsv;
      const float w = b ? fmaf(v, s[at], b[at]) : (BITS == 4 ? v - 8.0f : v) * s[at];
      out[r * p.k + j] = store<T>(w);
    }
  }
}

#define QUANT(SFX, T, BITS)                                                                     \
  extern "C" __global__ void qmv##BITS##_##SFX(const T* __restrict__ x, const u32* __restrict__ q, \
                                              const float* __restrict__ s,                      \
                                              const float* __restrict__ b, T* __restrict__ out, \
                                              QuantParams p) {                                  \
    pdl_entry();                                                                                \
    qmv<T, BITS>(x, q, s, b, out, p);                                                           \
  }                                                                                             \
  extern "C" __global__ void dequant##BITS##_##SFX(const u32* __restrict__ q,                   \
                                                  const float* __restrict__ s,                  \
                                                  const float* __restrict__ b,                  \
                                                  T* __restrict__ out, QuantParams p) {         \
    pdl_entry();                                                                                \
    dequant<T, BITS>(q, s, b, out, p);                                                          \
  }

ONLY(f16, QUANT(f16, half_t, 8) QUANT(f16, half_t, 4))
ONLY(bf16, QUANT(bf16, bf16_t, 8) QUANT(bf16, bf16_t, 4))
ONLY(f32, QUANT(f32, float, 8) QUANT(f32, float, 4))
