// Products of a few rows with int8 / int4 weights on tensor cores (docs/quantization.md): out
// (m x n) = x (m x k) @ W^T for 2 <= m <= 16 rows of x (the tokens of a batched decode step),
// W (n x k) int8 in groups of a multiple of 16 values (per channel, GGUF Q8_0, Q5_K, Q6_K)
// or int4 in groups of a multiple of 32 (needle's g64 / g128, GGUF Q4_0, Q4_K), float32
// scales, with or without offsets. quant.cu's qmv reads W once per row of x; this reads it
// once, as skinny.cu does for dense weights, and dequantizes in registers:
//  * mma.sync m16n8k16: A = x (tokens g and g + 8 in a lane's rows; rows past m are zeros),
//    B = 8 weight rows, one per n column; the sum does not care in which order k runs as
//    long as A and B agree, so each lane's 32-bit word of a weight row is laid onto the B
//    pairs (k 2t, 2t+1) and (2t+8, 2t+9) in whatever order dequantizes cheapest, and x's
//    values are taken in the same order.
//  * A block of `warps` warps (blockDim.x / 32, the launch's choice: more where the rows are
//    few) owns 8 weight rows; warp w takes its share of the rows' sets. A set is LW words a
//    lane, loaded at once (lane (g, t): words 4 LW s + LW t .. + LW - 1 of weight row g); its
//    sub-step i takes word i of each lane: 16 k of int8 (one MMA) or 32 k of int4 (two),
//    within the set's 4 LW words, so a group must hold whole sets: LW = 4 where groups are a
//    multiple of 64 (int8) / 128 (int4) values, 2 for 32 / 64, 1 for 16 / 32 (fewer, wider
//    loads: the stream is short of requests, not bytes; docs/cuda_notes.md v51). x is read
//    through L1, not staged: a block's shared memory is its scales and sums only, so k does
//    not bound how many blocks a multiprocessor holds.
//  * int8: byte i as a float 2^23 + (q ^ 0x80) by one byte permute, minus 2^23 + 128 (exact),
//    two packed into T (exact: |q| <= 128); the MMA's k pairs are bytes (0, 1) and (2, 3),
//    so x is read as it lies.
//  * int4: a nibble u placed in the mantissa of 128 (bf16: 0x4300 | u) or 1024 (f16: 0x6400
//    | u) is 128 + u (1024 + u) exactly; one packed FMA subtracts 136 (1032): u - 8, or 128
//    (1024) with offsets: u, exact in T. The pairs are nibbles (e, e + 4) of a word, so x's
//    pairs are put in the same order (x0 x4, x1 x5, ...) by byte permutes.
//  * The products are exact in the fp32 accumulators; each group's sum is scaled once, then
//    the output rounded once to T, as qmv's. Offsets: a third accumulator takes the MMA of x
//    with ones (each token's sum of x over the same k), times the group's offset.
#include "common.cuh"
#include "tensor_core.cuh"

// m, n, k, words, groups, group (values), has_offsets
struct QuantSkinnyParams { i64 m, n, k, words, groups, group, has_offsets; };

#ifndef QSKW_THREADS
#define QSKW_THREADS 512  // at most 16 warps a block (cuda/quant_skinny.py WORD_WARPS)
#endif
#ifndef QSKW_WORDS
#define QSKW_WORDS 16  // words a lane has in flight
#endif
namespace qskw {
constexpr int ROWS = 8;

// nibbles e and e + 4 of w as two T values, minus the bias (8, or 0 with offsets)
template <class T, int E> __device__ __forceinline__ u32 nibble_pair(u32 w, u32 bias) {
  typedef tc::Nibbles<T> N;
  return N::fma2(((w >> (4 * E)) & 0x000F000Fu) | N::OR, N::ONE, bias);
}

// bytes (0, 1) and (2, 3) of w, signed, as two pairs of T
template <class T> __device__ __forceinline__ void byte_pairs(u32 w, u32& p01, u32& p23) {
  const u32 b = w ^ 0x80808080u;  // q + 128, 0..255
  const float magic = 8388736.f;  // 2^23 + 128
  const float f0 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7540)) - magic;
  const float f1 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7541)) - magic;
  const float f2 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7542)) - magic;
  const float f3 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7543)) - magic;
  p01 = tc::pack2<T>(f0, f1);
  p23 = tc::pack2<T>(f2, f3);
}

// LW words of a weight row, streamed
template <int LW> __device__ __forceinline__ void load_words(const u32* p, u32 (&w)[LW]) {
  if constexpr (LW == 4) {
    const uint4 r = ld_stream16(p);
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
  } else if constexpr (LW == 2) {
    const uint2 r = ld_stream8(p);
    w[0] = r.x, w[1] = r.y;
  } else {
    w[0] = ld_stream4(p);
  }
}

// NP pairs of x values (2 NP values) from p, or zeros (a token past m)
template <int NP> __device__ __forceinline__ void x_pairs(const void* p, bool live, u32 (&v)[NP]) {
  if constexpr (NP >= 4) {
#pragma unroll
    for (int i = 0; i < NP / 4; i++) {
      const uint4 r = live ? __ldg(reinterpret_cast<const uint4*>(p) + i) : make_uint4(0, 0, 0, 0);
      v[4 * i] = r.x, v[4 * i + 1] = r.y, v[4 * i + 2] = r.z, v[4 * i + 3] = r.w;
    }
  } else {
    const uint2 r = live ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
    v[0] = r.x, v[1] = r.y;
  }
}

template <class T, int TOKENS, int BITS, int LW>
__device__ __forceinline__ void run(const T* __restrict__ x, const u32* __restrict__ q,
                                    const float* __restrict__ s, const float* __restrict__ b,
                                    T* __restrict__ out, const QuantSkinnyParams& p,
                                    float* smem) {
  constexpr int KPW = 32 / BITS, KSET = 4 * LW * KPW;  // values a word, a set
  constexpr int US = QSKW_WORDS / LW > 0 ? QSKW_WORDS / LW : 1;  // sets a lane has in flight
  constexpr int NP = LW * KPW / 2;  // pairs of x a lane takes a set
  const int k = (int)p.k, m = (int)p.m, groups = (int)p.groups;
  const int sets = k / KSET, per_group = (int)(p.group / KSET);
  const int warps = blockDim.x / 32, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const bool offs = p.has_offsets;
  const i64 row0 = (i64)blockIdx.x * ROWS, last = p.n - 1;
  const u32* qrow = q + (row0 + g <= last ? row0 + g : last) * p.words + LW * t;
  const int s0 = warp * sets / warps, s1 = (warp + 1) * sets / warps;
  u32 w[US][LW];
  pdl_entry();  // weights, scales and x only after the wait (the previous kernel's writes)
  auto fetch = [&](int sb) {
#pragma unroll
    for (int u = 0; u < US; u++)
      if (sb + u < s1) load_words<LW>(qrow + 4 * LW * (sb + u), w[u]);
  };
  fetch(s0);  // in flight while the scales are staged
  float* ss = smem;  // [ROWS][groups] scales, then offsets, then the warps' sums
  float* os = ss + ROWS * groups;
  float* red = os + (offs ? ROWS * groups : 0);
  for (int i = tid; i < ROWS * groups; i += blockDim.x) {
    const int row = i / groups, gi = i % groups;
    const i64 at = (row0 + row <= last ? row0 + row : last) * groups + gi;
    ss[i] = __ldg(s + at);
    if (offs) os[i] = __ldg(b + at);
  }
  __syncthreads();
  // token g's x and token g + 8's from this lane's first value (rows past m read as zeros)
  const T* xg = x + (i64)g * k + LW * KPW * t;
  const T* xh = x + (i64)(g + 8) * k + LW * KPW * t;
  const bool live_g = g < m, live_h = TOKENS == 16 && g + 8 < m;
  typedef tc::Nibbles<T> N;
  const u32 bias = offs ? N::BIAS_OFF : N::BIAS_SYM;
  float tot[2][2] = {}, c[4] = {}, d[4] = {}, o[4] = {};
  int gi = s0 / per_group, left = per_group - s0 % per_group;
  for (int sb = s0; sb < s1; sb += US) {
    if (sb > s0) fetch(sb);
#pragma unroll
    for (int u = 0; u < US; u++) {
      const int set = sb + u;
      if (set >= s1) break;
      u32 lo[NP], hi[NP];
      x_pairs<NP>(xg + KSET * set, live_g, lo);
      if (TOKENS == 16) x_pairs<NP>(xh + KSET * set, live_h, hi);
#pragma unroll
      for (int i = 0; i < LW; i++) {
        if (BITS == 8) {  // word i: x pairs 2i, 2i + 1
          const u32 a[4] = {lo[2 * i], TOKENS == 16 ? hi[2 * i] : 0u, lo[2 * i + 1],
                            TOKENS == 16 ? hi[2 * i + 1] : 0u};
          u32 b01, b23;
          byte_pairs<T>(w[u][i], b01, b23);
          if (i & 1)  // two accumulators halve the dependent chain
            tc::Mma<T>::run(d, a, b01, b23);
          else
            tc::Mma<T>::run(c, a, b01, b23);
          if (offs) tc::Mma<T>::run(o, a, N::ONE, N::ONE);
        } else {  // word i: x pairs 4i .. 4i + 3 (values 0 1, 2 3, 4 5, 6 7)
          const u32 h0 = TOKENS == 16 ? hi[4 * i] : 0u, h1 = TOKENS == 16 ? hi[4 * i + 1] : 0u;
          const u32 h2 = TOKENS == 16 ? hi[4 * i + 2] : 0u, h3 = TOKENS == 16 ? hi[4 * i + 3] : 0u;
          const u32 l0 = lo[4 * i], l1 = lo[4 * i + 1], l2 = lo[4 * i + 2], l3 = lo[4 * i + 3];
          const u32 a0[4] = {__byte_perm(l0, l2, 0x5410), __byte_perm(h0, h2, 0x5410),
                             __byte_perm(l0, l2, 0x7632), __byte_perm(h0, h2, 0x7632)};
          const u32 a1[4] = {__byte_perm(l1, l3, 0x5410), __byte_perm(h1, h3, 0x5410),
                             __byte_perm(l1, l3, 0x7632), __byte_perm(h1, h3, 0x7632)};
          tc::Mma<T>::run(c, a0, nibble_pair<T, 0>(w[u][i], bias),
                          nibble_pair<T, 1>(w[u][i], bias));
          tc::Mma<T>::run(d, a1, nibble_pair<T, 2>(w[u][i], bias),
                          nibble_pair<T, 3>(w[u][i], bias));
          if (offs) {
            tc::Mma<T>::run(o, a0, N::ONE, N::ONE);
            tc::Mma<T>::run(o, a1, N::ONE, N::ONE);
          }
        }
      }
      if (--left == 0 || set == s1 - 1) {  // the group's sums (or this warp's part of them)
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int at = (2 * t + j) * groups + gi;
          const float sc = ss[at], of = offs ? os[at] : 0.f;
#pragma unroll
          for (int h = 0; h < 2; h++) {
            tot[h][j] = fmaf(c[2 * h + j] + d[2 * h + j], sc, tot[h][j]);
            if (offs) tot[h][j] = fmaf(o[2 * h + j], of, tot[h][j]);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) c[j] = d[j] = o[j] = 0.f;
        if (left == 0) {
          gi++;
          left = per_group;
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < TOKENS / 8; h++)
#pragma unroll
    for (int j = 0; j < 2; j++) red[(warp * TOKENS + g + 8 * h) * ROWS + 2 * t + j] = tot[h][j];
  __syncthreads();
  for (int i = tid; i < TOKENS * ROWS; i += blockDim.x) {  // every (token, row)
    const int token = i / ROWS, row = i % ROWS;
    if (token >= m || row0 + row > last) continue;
    float sum = 0.f;
    for (int wi = 0; wi < warps; wi++) sum += red[(wi * TOKENS + token) * ROWS + row];
    out[(i64)token * p.n + row0 + row] = store<T>(sum);
  }
}
}  // namespace qskw

// qmm{8,4}w{1,2,4}_tc{8,16}_{bf16,f16}: up to 8 or up to 16 rows of x
#define QUANT_SKINNY_WORDS(SFX, T, TOKENS, BITS, LW)                                           \
  extern "C" __global__ void __launch_bounds__(QSKW_THREADS, 1)                               \
      qmm##BITS##w##LW##_tc##TOKENS##_##SFX(const T* __restrict__ x,                           \
                                            const u32* __restrict__ q,                         \
                                            const float* __restrict__ s,                       \
                                            const float* __restrict__ b, T* __restrict__ out,  \
                                            QuantSkinnyParams p) {                             \
    extern __shared__ __align__(16) float qskw_smem[];                                         \
    qskw::run<T, TOKENS, BITS, LW>(x, q, s, b, out, p, qskw_smem);                             \
  }
#define QUANT_SKINNY_LW(SFX, T, TOKENS, LW)                                                    \
  QUANT_SKINNY_WORDS(SFX, T, TOKENS, 8, LW) QUANT_SKINNY_WORDS(SFX, T, TOKENS, 4, LW)
#define QUANT_SKINNY_ALL(SFX, T)                                                               \
  QUANT_SKINNY_LW(SFX, T, 8, 1) QUANT_SKINNY_LW(SFX, T, 8, 2) QUANT_SKINNY_LW(SFX, T, 8, 4)    \
  QUANT_SKINNY_LW(SFX, T, 16, 1) QUANT_SKINNY_LW(SFX, T, 16, 2) QUANT_SKINNY_LW(SFX, T, 16, 4)
ONLY(f16, QUANT_SKINNY_ALL(f16, half_t))
ONLY(bf16, QUANT_SKINNY_ALL(bf16, bf16_t))
