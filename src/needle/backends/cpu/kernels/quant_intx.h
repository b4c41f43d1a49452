// x as integers for the quantized matvecs' integer products (x86; elsewhere x takes the float
// form): 16-bit x a 32-value chunk, multiplied with int4's packed nibbles by AVX2's
// vpmaddubsw or, where the CPU has AVX-512 VNNI, vpdpbusd, and with int8's bytes by VNNI's
// vpdpwssd. Included by quant.cc only.
#pragma once
#include "quant.h"

namespace needle {
namespace {

struct XBlocks {
  std::vector<uint8_t> planes;  // int4's: (blocks of 64, 4, 32); empty for int8's
  std::vector<float> scale;     // 2^-k a 32-value chunk; NaN where it holds an inf or NaN
  std::vector<int16_t> ints;    // int8's: the whole chunks' q in x's order; empty for int4's
};

// Chunk v (32 values) as q = v * 2^sh, |q| < 2^15, the largest |v| exact (below); the chunk's
// 2^-sh (NaN where it holds an inf or NaN) into scale, each q to put(e, q)
template <class Put> inline void chunk_ints(const float* v, float& scale, Put&& put) {
  uint32_t mb = 0;  // the largest |x| as bits: integer order is float order below NaN
  for (int e = 0; e < 32; ++e) {
    uint32_t u;
    std::memcpy(&u, v + e, 4);
    mb = std::max(mb, u & 0x7fffffffu);
  }
  const int em = std::max((int)(mb >> 23), 1), sh = 141 - em;  // |x| < 2^(em - 126)
  // 2^sh (-113 <= sh <= 140) as two exact factors within float's range
  const float f1 = std::ldexp(1.0f, sh / 2), f2 = std::ldexp(1.0f, sh - sh / 2);
  for (int e = 0; e < 32; ++e) put(e, (int)std::lrint(v[e] * f1 * f2));  // exact scaling
  scale = mb >= 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, -sh);
}

#if defined(__AVX2__)
#if defined(__AVX512F__)
// chunk_ints in vectors: the chunk's 32 q as two vectors of int32 (values 0-15, 16-31)
inline void chunk_vectors(const float* v, float& scale, __m512i& qa, __m512i& qb) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const uint32_t mb = _mm512_reduce_max_epu32(
      _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(a), abs_mask),
                       _mm512_and_si512(_mm512_castps_si512(b), abs_mask)));
  const int em = std::max((int)(mb >> 23), 1), sh = 141 - em;  // as chunk_ints
  const __m512 f1 = _mm512_set1_ps(std::ldexp(1.0f, sh / 2));
  const __m512 f2 = _mm512_set1_ps(std::ldexp(1.0f, sh - sh / 2));
  qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(a, f1), f2));  // nearest, as lrint
  qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(b, f1), f2));
  scale = mb >= 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, -sh);
}

// a chunk into int4's planes (half `half` of its block): byte b of a half-block plane is
// element 2b (even) or 2b + 1 (odd) of the chunk, so the evens' and odds' high and low bytes
// are four 16-byte stores (the scalar form's byte at a time cost ~3 us a call at k = 2048)
inline void chunk_planes(const float* v, float& scale, uint8_t* pl, int half) {
  __m512i qa, qb;
  chunk_vectors(v, scale, qa, qb);
  const __m512i evens =
      _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  const __m512i qe = _mm512_permutex2var_epi32(qa, evens, qb);
  const __m512i qo = _mm512_permutex2var_epi32(qa, odds, qb);
  auto put = [&](int plane, __m512i q) {  // the low byte of each lane
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pl + 32 * plane + 16 * half),
                     _mm512_cvtepi32_epi8(q));
  };
  put(0, _mm512_srai_epi32(qe, 8));
  put(1, _mm512_srai_epi32(qo, 8));
  put(2, qe);
  put(3, qo);
}
#endif

// 16-bit x as integers for int4 (the CUDA kernels' form, kernels/quant_intx.cuh): each
// 32-value chunk of x as q = x * 2^k with one power of two a chunk and |q| < 2^15 (a bf16 /
// f16 value has at most 11 significant bits, so the chunk's largest |x| is exact), split into
// a signed high byte and an unsigned low byte (q = 256 hi + lo), laid out to meet the nibbles
// of 8 packed words (a 64-value block): 32 bytes each of even-hi, odd-hi, even-lo, odd-lo,
// byte b pairing with word b / 4's byte b % 4 (lo nibble: element 8 (b / 4) + 2 (b % 4), hi
// nibble the next). vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16
// (nibble x hi <= 2 * 15 * 128, lo x nibble <= 2 * 255 * 15: no saturation): ~21
// instructions a row and block against int4x64_dot's ~40.
XBlocks int_blocks(const float* x, int64_t k) {
  const int64_t blocks = k / 64;
  XBlocks xb{std::vector<uint8_t>(blocks * 128), std::vector<float>(2 * blocks), {}};
  for (int64_t c = 0; c < 2 * blocks; ++c) {
    uint8_t* pl = xb.planes.data() + 128 * (c / 2);  // chunk c: half c % 2 of a block
#if defined(__AVX512F__)
    chunk_planes(x + 32 * c, xb.scale[c], pl, (int)(c % 2));
#else
    chunk_ints(x + 32 * c, xb.scale[c], [&](int e, int q) {
      const int at = 32 * (c % 2) + e, byte = 4 * (at / 8) + (at % 8) / 2, odd = e % 2;
      pl[32 * odd + byte] = (uint8_t)((q >> 8) & 0xff);
      pl[64 + 32 * odd + byte] = (uint8_t)(q & 0xff);
    });
#endif
  }
  return xb;
}

// the int32 sums of u * q over the 64 nibbles u of 8 words at q, lanes 0-3 over the first 32
// values, 4-7 over the second, as floats
inline f32x8 int4x64_sums(const uint32_t* q, const uint8_t* pl) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i lo = _mm256_and_si256(w, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
  auto plane = [&](int i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl + 32 * i));
  };
  const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(lo, plane(0)),
                                      _mm256_maddubs_epi16(hi, plane(1)));
  const __m256i pq = _mm256_add_epi16(_mm256_maddubs_epi16(plane(2), lo),
                                      _mm256_maddubs_epi16(plane(3), hi));
  const __m256i t = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(ph, ones), 8),
                                     _mm256_madd_epi16(pq, ones));
  return (f32x8)_mm256_cvtepi32_ps(t);
}

// lanes 0-3 a, 4-7 b
inline f32x8 halves(float a, float b) { return f32x8{a, a, a, a, b, b, b, b}; }

// rows_dot for int4 in groups of 32 with x as integers: each 64-value block is two groups,
// so its sums take each half's x scale times its group's weight scale at once; the offsets'
// (or symmetric int4's -8 s) part from each group's sum of x, as in rows_dot
template <int R>
void rows_dot_g32(const QuantMatrix& w, int64_t r0, const float* x, const XBlocks& xb,
                  const float* xsum, float* y) {
  const RowsOf<R> rows(w, r0);
  const auto &q = rows.q, &s = rows.s, &b = rows.b;
  f32x8 tot[R] = {};
  float tail[R] = {};
  const int64_t blocks = w.k / 64;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* pl = xb.planes.data() + 128 * blk;
    const float sx0 = xb.scale[2 * blk], sx1 = xb.scale[2 * blk + 1];
    for (int t = 0; t < R; ++t) {
      if (blk % 2 == 0) prefetch_ahead<R>(q[t], w.words, 32 * blk);
      tot[t] += int4x64_sums(q[t] + 8 * blk, pl) *
                halves(sx0 * s[t][2 * blk], sx1 * s[t][2 * blk + 1]);
    }
  }
  for (int64_t j = 64 * blocks; j < w.k; ++j)  // a last group of 32 or fewer values
    for (int t = 0; t < R; ++t) tail[t] += x[j] * stored<4>(q[t], j) * s[t][j / 32];
  for (int64_t g = 0; g < w.groups; ++g)
    for (int t = 0; t < R; ++t) tail[t] += (b[t] ? b[t][g] : -8.0f * s[t][g]) * xsum[g];
  row_totals<R>(tot, tail, y);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Groups AVX-512 VNNI takes: whole 128-value steps of one scale, or steps of 2 or 4 groups
inline bool vnni_group(int64_t group) { return group == 32 || group == 64 || group % 128 == 0; }

// rows_dot for int4 by vpdpbusd, 128 values (16 words, two of int_blocks' 64-value blocks) a
// step: a byte's nibble times x's signed high byte, x's unsigned low byte times the nibble,
// four products and the int32 lane added in one instruction (vpmaddubsw's int16 pairs need
// two more), so a step is ~14 instructions a row against ~36 for two int4x64_sums: 6-15%
// less time a 1.1B matvec, 20% a batch of 8 rows (the prefetch in quant.h did the rest).
// Lane L of a step holds word L's eight values (chunk L / 4), so each lane's int32 sum is
// scaled by its chunk's 2^-k times its group's scale; the last block of 64 (k % 128) as
// rows_dot_g32, the offsets' (or symmetric int4's -8 s) part from each group's sum of x, as
// in rows_dot.
// the two 8-lane halves of v added: a 16-lane total as row_totals takes it
inline f32x8 fold_halves(__m512 v) {
  return (f32x8)_mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// sum over the groups of b_g * xsum_g (b: the offsets, or symmetric int4's -8 s_g): 16 groups
// a vector, not one dependent add a group (a 2048-wide row in groups of 32 has 64, as many
// cycles of latency as its products)
inline float offset_terms(const float* b, const float* s, const float* xsum, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) {
    const __m512 bg = b ? _mm512_loadu_ps(b + g) : _mm512_mul_ps(_mm512_set1_ps(-8.0f),
                                                                 _mm512_loadu_ps(s + g));
    acc = _mm512_fmadd_ps(bg, _mm512_loadu_ps(xsum + g), acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; g < groups; ++g) sum += (b ? b[g] : -8.0f * s[g]) * xsum[g];
  return sum;
}

template <int R>
void rows_int4_vnni(const QuantMatrix& w, int64_t r0, const float* x, const XBlocks& xb,
                    const float* xsum, float* y) {
  const int64_t steps = w.k / 128, group = w.group;
  const __m512i low4 = _mm512_set1_epi8(15);
  // lane L's chunk (L / 4) and, for groups of 64 / 32, its group within the step
  const __m512i chunk_of = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i half_of = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const RowsOf<R> rows(w, r0);
  const auto &q = rows.q, &s = rows.s;
  __m512 tot[R];
  for (int t = 0; t < R; ++t) tot[t] = _mm512_setzero_ps();
  // groups of 128 or more: the step's group, counted (no division in the loop)
  const int64_t steps_a_group = group % 128 == 0 ? group / 128 : 1;
  int64_t g = 0, into = 0;
  for (int64_t st = 0; st < steps; ++st) {
    const uint8_t* pl = xb.planes.data() + 256 * st;  // blocks 2 st and 2 st + 1
    __m512i plane[4];
    for (int i = 0; i < 4; ++i) {  // plane i of both blocks
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl + 32 * i));
      const __m256i second =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl + 128 + 32 * i));
      plane[i] = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
    }
    const __m512 sx = _mm512_permutexvar_ps(
        chunk_of, _mm512_castps128_ps512(_mm_loadu_ps(xb.scale.data() + 4 * st)));
    for (int t = 0; t < R; ++t) {
      prefetch_ahead<R>(q[t], w.words, 64 * st);
      const __m512i wv = _mm512_loadu_si512(q[t] + 16 * st);
      const __m512i lo = _mm512_and_si512(wv, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
      __m512i ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, plane[0]);
      ph = _mm512_dpbusd_epi32(ph, hi, plane[1]);
      __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), plane[2], lo);
      pq = _mm512_dpbusd_epi32(pq, plane[3], hi);
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ph, 8), pq));
      __m512 sw;
      if (group % 128 == 0) {
        sw = _mm512_set1_ps(s[t][g]);
      } else if (group == 64) {
        sw = _mm512_permutexvar_ps(half_of, _mm512_castps128_ps512(_mm_castpd_ps(
                 _mm_load_sd(reinterpret_cast<const double*>(s[t] + 2 * st)))));
      } else {
        sw = _mm512_permutexvar_ps(chunk_of,
                                   _mm512_castps128_ps512(_mm_loadu_ps(s[t] + 4 * st)));
      }
      tot[t] = _mm512_fmadd_ps(sums, _mm512_mul_ps(sx, sw), tot[t]);
    }
    if (++into == steps_a_group) {
      into = 0;
      ++g;
    }
  }
  f32x8 tot8[R];
  float tail[R] = {};
  for (int t = 0; t < R; ++t)
    tot8[t] = fold_halves(tot[t]);
  const int64_t done = 128 * steps;
  if (done + 64 <= w.k) {  // a last whole block of 64
    const int64_t blk = done / 64;
    const uint8_t* pl = xb.planes.data() + 128 * blk;
    const float sx0 = xb.scale[2 * blk], sx1 = xb.scale[2 * blk + 1];
    for (int t = 0; t < R; ++t)
      tot8[t] += int4x64_sums(q[t] + 8 * blk, pl) *
                 halves(sx0 * s[t][done / group], sx1 * s[t][(done + 32) / group]);
  }
  for (int64_t j = w.k / 64 * 64; j < w.k; ++j)  // fewer than 64 values
    for (int t = 0; t < R; ++t) tail[t] += x[j] * stored<4>(q[t], j) * s[t][j / group];
  for (int t = 0; t < R; ++t)
    tail[t] += offset_terms(rows.b[t], s[t], xsum, w.groups);
  row_totals<R>(tot8, tail, y);
}

// x as 16-bit integers in its own order for int8's products (rows_int8_vnni): the whole
// 32-value chunks, scaled as int_blocks scales them
XBlocks int_chunks(const float* x, int64_t k) {
  const int64_t chunks = k / 32;
  XBlocks xb{{}, std::vector<float>(chunks), std::vector<int16_t>(chunks * 32)};
  for (int64_t c = 0; c < chunks; ++c) {
#if defined(__AVX512F__)
    __m512i qa, qb;
    chunk_vectors(x + 32 * c, xb.scale[c], qa, qb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&xb.ints[32 * c]), _mm512_cvtepi32_epi16(qa));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&xb.ints[32 * c + 16]),
                        _mm512_cvtepi32_epi16(qb));
#else
    chunk_ints(x + 32 * c, xb.scale[c], [&](int e, int q) { xb.ints[32 * c + e] = (int16_t)q; });
#endif
  }
  return xb;
}

// Groups rows_int8_vnni takes: whole chunks of one scale, or one group a row (per channel)
inline bool vnni_int8_group(const QuantMatrix& w) { return w.group % 32 == 0 || w.groups == 1; }

// rows_dot for int8 by vpdpwssd: a chunk's 32 stored bytes widened to int16 (vpmovsxbw) and
// multiplied with the chunk's 16-bit x in pairs into int32 lanes (no saturation: 2 x 128 x
// 2^15 < 2^31), the lanes scaled by the chunk's 2^-k times its group's scale: ~6
// instructions a row and chunk against ~20 for the float form's 8-value steps. The values
// past the last whole chunk, and the offsets' part (from each group's sum of x), as in
// rows_dot.
template <int R>
void rows_int8_vnni(const QuantMatrix& w, int64_t r0, const float* x, const XBlocks& xb,
                    const float* xsum, float* y) {
  const int64_t chunks = w.k / 32;
  const int64_t chunks_a_group = w.groups == 1 ? chunks + 1 : w.group / 32;
  const RowsOf<R> rows(w, r0);
  const auto &row = rows.q, &s = rows.s;
  const int8_t* q[R];
  for (int t = 0; t < R; ++t) q[t] = reinterpret_cast<const int8_t*>(row[t]);
  __m512 tot[R];
  for (int t = 0; t < R; ++t) tot[t] = _mm512_setzero_ps();
  int64_t g = 0, into = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i xv = _mm512_loadu_si512(xb.ints.data() + 32 * c);
    const float sx = xb.scale[c];
    for (int t = 0; t < R; ++t) {
      if (c % 2 == 0) prefetch_ahead<R>(row[t], w.words, 32 * c);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[t] + 32 * c));
      const __m512i wv = _mm512_cvtepi8_epi16(bytes);
      const __m512 sums =
          _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), xv, wv));
      tot[t] = _mm512_fmadd_ps(sums, _mm512_set1_ps(sx * s[t][g]), tot[t]);
    }
    if (++into == chunks_a_group) {
      into = 0;
      ++g;
    }
  }
  f32x8 tot8[R];
  float tail[R] = {};
  for (int t = 0; t < R; ++t) {
    tot8[t] = fold_halves(tot[t]);
    for (int64_t j = 32 * chunks; j < w.k; ++j)  // fewer than 32 values
      tail[t] += x[j] * stored<8>(row[t], j) * s[t][j / w.group];
    if (rows.b[t] != nullptr) tail[t] += offset_terms(rows.b[t], s[t], xsum, w.groups);
  }
  row_totals<R>(tot8, tail, y);
}
#endif

}  // namespace
}  // namespace needle
