// x staged as 16-bit integers for integer dot products with packed weights (quant_decode.cu,
// bf16 and f16 activations; docs/quantization.md).
//
// Why: the float form (quant.cuh's chunk_dot) spends ~3.5 dependent instructions a weight
// value (a byte permute, a subtraction, an FMA), and at the occupancy its registers allow the
// decode projections were bound by that issue (docs/cuda_notes.md v12, v19). dp4a multiplies
// four byte pairs and adds them to an int32 in one instruction, so x is split into bytes:
//
//   each 16-byte chunk of weights (16 int8 or 32 int4 values) has its x values as integers
//   q = h * 2^-s with one power of two 2^s a chunk, |q| < 2^15: h is a bf16 / f16 value
//   (<= 11 significant bits), so the largest |h| of the chunk keeps all its bits and the
//   others are rounded at 2^s, finer than T's rounding of any value within 2^4 of the
//   largest. q = 256 hi + lo with hi = q >> 8 (signed byte) and lo = q & 255 (unsigned), and
//   sum w q = 256 sum w hi + sum w lo: two dp4a a word of weights, the sums exact in int32.
//
// A chunk whose x holds an infinity or a NaN gets the scale NaN, so its products are NaN
// (the float form gives +-inf or NaN there).
//
// Staged layout, P planes of `chunks` uint4 (plane-major, so a warp reading 32 neighbouring
// chunks reads 32 consecutive uint4), then each chunk's scale 2^s (float) and sum of q (int):
//   int8 (P = 2): plane 0 hi, plane 1 lo; byte b of word i: element 4i + b
//   int4 (P = 4): planes even-hi, odd-hi, even-lo, odd-lo; byte j of word i: element
//                 8i + 2j (even) or 8i + 2j + 1 (odd), matching the nibbles of packed word i
#pragma once
#include "quant.cuh"

template <int BITS> struct IntX {
  static constexpr int E = 128 / BITS, P = BITS == 8 ? 2 : 4;
};

// bytes of `w` (signed) times bytes of `x` (signed: s, unsigned: u), added to c
__device__ __forceinline__ int dp4a_ss(u32 w, u32 x, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(x), "r"(c));
  return d;
}
__device__ __forceinline__ int dp4a_su(u32 w, u32 x, int c) {
  int d;
  asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(x), "r"(c));
  return d;
}

__device__ __forceinline__ float pow2f(int j) {  // 2^j for -126 <= j <= 127
  return __int_as_float((j + 127) << 23);
}

// chunk c of h (x, or x * rs * nw rounded to T with NORM; a, g: its loaded vectors of x and
// nw) as the chunk's planes, scale and sum. h is formed twice (for the largest |h|, then for
// the integers) rather than held in 32 more registers.
template <class T, int BITS, bool NORM, int L>
__device__ __forceinline__ void stage_loaded(const Vec<T, 16 / sizeof(T)> (&a)[L],
                                             const Vec<T, 16 / sizeof(T)> (&g)[L], float rs,
                                             int c, int chunks, uint4* planes, float* sx,
                                             int* xsum) {
  constexpr int E = IntX<BITS>::E, P = IntX<BITS>::P, V = 16 / sizeof(T);
  auto h = [&](int e) {
    const float v = load(a[e / V].v[e % V]);
    return NORM ? load(store<T>(v * rs * load(g[e / V].v[e % V]))) : v;
  };
  u32 mb = 0;  // the largest |h| as bits: integer order is float order below NaN
#pragma unroll
  for (int e = 0; e < E; e++) mb = max(mb, __float_as_uint(h(e)) & 0x7fffffffu);
  const int em = max((int)(mb >> 23), 1);  // |h| < 2^(em - 126)
  const int k = 141 - em;                    // q = h * 2^k, |q| < 2^15; -113 <= k <= 140
  const float f1 = pow2f(k / 2), f2 = pow2f(k - k / 2);  // 2^k in two exact steps
  u32 words[P][4] = {};
  int total = 0;
#pragma unroll
  for (int e = 0; e < E; e++) {
    const int q = __float2int_rn(h(e) * f1 * f2);
    total += q;
    const int word = BITS == 8 ? e / 4 : e / 8, byte = BITS == 8 ? e % 4 : (e % 8) / 2;
    const int hi = BITS == 8 ? 0 : e % 2, lo = BITS == 8 ? 1 : 2 + e % 2;
    words[hi][word] |= ((u32)(q >> 8) & 0xffu) << (8 * byte);
    words[lo][word] |= ((u32)q & 0xffu) << (8 * byte);
  }
#pragma unroll
  for (int p = 0; p < P; p++)
    planes[p * chunks + c] = make_uint4(words[p][0], words[p][1], words[p][2], words[p][3]);
  // 2^-k: a normal float from em = 15 up, below it a subnormal's single bit
  sx[c] = mb >= 0x7f800000u ? __int_as_float(0x7fc00000)
                            : (em >= 15 ? pow2f(-k) : __int_as_float(1 << (em + 8)));
  xsum[c] = total;
}

// h (x, or x * rs * nw rounded to T with NORM) staged as integers by `threads` threads, a
// chunk a thread; k a multiple of E, x and nw 16-byte aligned. (Reading x once for the norm's
// sum of squares and the staging, instead of group_sum_squares first, was no faster.)
template <class T, int BITS, bool NORM>
__device__ __forceinline__ void stage_x_int(const T* x, const T* nw, float rs, int k,
                                            uint4* planes, float* sx, int* xsum, int tid,
                                            int threads) {
  constexpr int E = IntX<BITS>::E, V = 16 / sizeof(T), L = E / V;
  static_assert(sizeof(T) == 2, "16-bit activations");
  typedef Vec<T, V> Vt;
  const Vt* xv = reinterpret_cast<const Vt*>(x);
  const Vt* gv = reinterpret_cast<const Vt*>(nw);
  const int chunks = k / E;
  // one chunk a round: two chunks of int8 at once (4 vectors of x, 4 of nw) spilled at the
  // decode kernels' register caps
  for (int c = tid; c < chunks; c += threads) {
    Vt a[L], g[L];
#pragma unroll
    for (int l = 0; l < L; l++) {
      a[l] = xv[c * L + l];
      if (NORM) g[l] = gv[c * L + l];
    }
    stage_loaded<T, BITS, NORM, L>(a, g, rs, c, chunks, planes, sx, xsum);
  }
}

// sum over the chunk of value * q, value the stored int8 q, or the int4 nibble u (0..15);
// xp: the chunk's P staged uint4s
template <int BITS>
__device__ __forceinline__ int chunk_dot_int(const uint4& w, const uint4 (&xp)[IntX<BITS>::P]) {
  const u32 ws[4] = {w.x, w.y, w.z, w.w};
  u32 xw[IntX<BITS>::P][4];
#pragma unroll
  for (int p = 0; p < IntX<BITS>::P; p++) {
    xw[p][0] = xp[p].x; xw[p][1] = xp[p].y; xw[p][2] = xp[p].z; xw[p][3] = xp[p].w;
  }
  int dh = 0, dl = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if constexpr (BITS == 8) {
      dh = dp4a_ss(ws[i], xw[0][i], dh);
      dl = dp4a_su(ws[i], xw[1][i], dl);
    } else {
      const u32 lo = ws[i] & 0x0f0f0f0fu, hi = (ws[i] >> 4) & 0x0f0f0f0fu;
      dh = dp4a_ss(lo, xw[0][i], dh);
      dh = dp4a_ss(hi, xw[1][i], dh);
      dl = dp4a_su(lo, xw[2][i], dl);
      dl = dp4a_su(hi, xw[3][i], dl);
    }
  }
  return dh * 256 + dl;
}
