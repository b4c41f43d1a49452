// Packed weight values as floats, shared by quant.cu (qmv) and quant_decode.cu (the decode
// step's fused quantized projections). Layout: docs/quantization.md.
#pragma once
#include "common.cuh"

// the decode step's fused quantized projections (quant_decode.cu)
struct QDecodeParams {  // cuda/quant_decode.py QDECODE
  i64 k, p, words, groups, rows_per_warp, group_shift, per_group;
  float eps;  // (offsets or not: the kernel's name, suffix o)
};

// the scale group of 16-byte chunk c of a row: a shift where the chunks a group are a power of
// two (group_shift 30: one group a row), else a division
__device__ __forceinline__ int scale_group(int c, const QDecodeParams& p) {
  return p.group_shift >= 0 ? c >> p.group_shift : c / (int)p.per_group;
}

// The six kernels of one bit width and dtype of a family of these projections (quant_decode.cu,
// quant_stream.cu), each without offsets and with them (suffix o: int4 with zero points):
// NORM(name, SFX, T, BITS, KIND, NR, OFF, O) defines the norm (KIND 0, NR 2 outputs a step)
// and SwiGLU (KIND 1, one gate and up pair a step) kernels, ADD(SFX, T, BITS, OFF, O) the
// residual one.
#define QPROJECTIONS(NORM, ADD, NORM_NAME, SWIGLU_NAME, SFX, T, BITS)                          \
  NORM(NORM_NAME, SFX, T, BITS, 0, 2, false, )                                                \
  NORM(NORM_NAME, SFX, T, BITS, 0, 2, true, o)                                                \
  NORM(SWIGLU_NAME, SFX, T, BITS, 1, 1, false, )                                              \
  NORM(SWIGLU_NAME, SFX, T, BITS, 1, 1, true, o)                                              \
  ADD(SFX, T, BITS, false, )                                                                  \
  ADD(SFX, T, BITS, true, o)

// the float subtracted from a byte placed in 2^23's mantissa (byte_f) to get the value:
// int8 (stored q xor 0x80 = q + 128), int4 symmetric (u - 8), int4 with offsets (u)
template <int BITS> __device__ __forceinline__ float value_magic(bool offsets) {
  return BITS == 8 ? 8388736.0f : (offsets ? 8388608.0f : 8388616.0f);
}

// Byte j (0..3) of `v` as a float minus `bias`: the byte placed in the low mantissa bits of
// 2^23, then one subtraction of 2^23 + bias (exact: both are integers below 2^24).
template <int J> __device__ __forceinline__ float byte_f(u32 v, float magic) {
  return __uint_as_float(__byte_perm(v, 0x4B00u, 0x5440u | J)) - magic;
}

// sum_e x[e] * value e of a 16-byte chunk, x[e] read from the staged layout (float4 j of the
// chunk at xs[j * stride]). Values: int8 q; int4 u - 8 (symmetric) or u (with offsets).
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4& w, const float4* xs, int stride,
                                           float magic) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
  float d0 = 0.f, d1 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if (BITS == 4) {  // word i: elements 8i..8i+7; element 8i + 2j in lo byte j, +1 in hi byte j
      const u32 lo = words[i] & 0x0F0F0F0Fu, hi = (words[i] >> 4) & 0x0F0F0F0Fu;
      const float4 a = xs[(2 * i) * stride], c = xs[(2 * i + 1) * stride];
      d0 = fmaf(a.x, byte_f<0>(lo, magic), d0); d1 = fmaf(a.y, byte_f<0>(hi, magic), d1);
      d0 = fmaf(a.z, byte_f<1>(lo, magic), d0); d1 = fmaf(a.w, byte_f<1>(hi, magic), d1);
      d0 = fmaf(c.x, byte_f<2>(lo, magic), d0); d1 = fmaf(c.y, byte_f<2>(hi, magic), d1);
      d0 = fmaf(c.z, byte_f<3>(lo, magic), d0); d1 = fmaf(c.w, byte_f<3>(hi, magic), d1);
    } else {
      const u32 u = words[i] ^ 0x80808080u;  // signed byte q -> q + 128
      const float4 a = xs[i * stride];
      d0 = fmaf(a.x, byte_f<0>(u, magic), d0); d1 = fmaf(a.y, byte_f<1>(u, magic), d1);
      d0 = fmaf(a.z, byte_f<2>(u, magic), d0); d1 = fmaf(a.w, byte_f<3>(u, magic), d1);
    }
  }
  return d0 + d1;
}

// ---- x staged as float by a whole group (quant.cu's qmv, quant_decode.cu) --------------------
// A thread's 16-byte loads are issued QS at a time before any is used: a loop of dependent
// scalar loads (one round trip each) cost microseconds per group before the first dot product.
constexpr int QS = 4;

// sum of x^2 over the group's `threads` (tid: this one's index; k a multiple of 16 bytes of
// T), every thread gets it; red: threads / 32 floats of shared memory
template <class T>
__device__ __forceinline__ float group_sum_squares(const T* x, int k, float* red, int tid,
                                                   int threads) {
  constexpr int V = 16 / sizeof(T);
  const Vec<T, V>* xv = reinterpret_cast<const Vec<T, V>*>(x);
  const int nv = k / V;
  float ss = 0.f;
  for (int i0 = tid; i0 < nv; i0 += QS * threads) {
    Vec<T, V> a[QS];
#pragma unroll
    for (int u = 0; u < QS; u++)
      if (i0 + u * threads < nv) a[u] = xv[i0 + u * threads];
#pragma unroll
    for (int u = 0; u < QS; u++) {
      if (i0 + u * threads >= nv) break;
#pragma unroll
      for (int e = 0; e < V; e++) {
        const float t = load(a[u].v[e]);
        ss = fmaf(t, t, ss);
      }
    }
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < threads / 32; w++) total += red[w];  // every thread in the same order
  return total;
}

// h = x, or x * rs * nw rounded to T (rmsnorm's rounding, NORM), as float into the layout
// chunk_dot reads: float4 j of chunk c (E values a chunk) at float4 index j * chunks + c, so
// that the 32 lanes of a warp, reading 32 neighbouring chunks, touch 32 consecutive float4s
// (no bank conflicts); k a multiple of E, x and nw 16-byte aligned; by `threads` threads
template <class T, int E, bool NORM>
__device__ __forceinline__ void stage_x(const T* x, const T* nw, float rs, int k, float* smem,
                                        int tid, int threads) {
  constexpr int V = 16 / sizeof(T);
  static_assert(E % V == 0, "a 16-byte vector of x lies within one chunk");
  typedef Vec<T, V> Vt;
  const Vt* xv = reinterpret_cast<const Vt*>(x);
  const Vt* gv = reinterpret_cast<const Vt*>(nw);
  float4* s4 = reinterpret_cast<float4*>(smem);
  const int nv = k / V, chunks = k / E;
  for (int i0 = tid; i0 < nv; i0 += QS * threads) {
    Vt a[QS], g[QS];
#pragma unroll
    for (int u = 0; u < QS; u++) {
      if (i0 + u * threads < nv) {
        a[u] = xv[i0 + u * threads];
        if (NORM) g[u] = gv[i0 + u * threads];
      }
    }
#pragma unroll
    for (int u = 0; u < QS; u++) {
      const int i = i0 + u * threads;
      if (i >= nv) break;
      const int c = i * V / E, j0 = (i * V - c * E) / 4;  // chunk, first float4 in it
#pragma unroll
      for (int f = 0; f < V / 4; f++) {
        float h[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          h[e] = load(a[u].v[4 * f + e]);
          if (NORM) h[e] = load(store<T>(h[e] * rs * load(g[u].v[4 * f + e])));
        }
        s4[(j0 + f) * chunks + c] = make_float4(h[0], h[1], h[2], h[3]);
      }
    }
  }
}

// each chunk's sum of the staged h (with offsets the product is scale * dot + offset * sum(h)),
// into xsum; after stage_x and a barrier
template <int E>
__device__ __forceinline__ void chunk_sums(const float* smem, int k, float* xsum, int tid,
                                           int threads) {
  const int chunks = k / E;
  const float4* xs = reinterpret_cast<const float4*>(smem);
  for (int c = tid; c < chunks; c += threads) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < E / 4; j++) {
      const float4 v = xs[j * chunks + c];
      t += (v.x + v.y) + (v.z + v.w);
    }
    xsum[c] = t;
  }
}
