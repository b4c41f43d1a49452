// The packed matrix as the quant kernels see it, and the vector helpers they share
// (quant.cc, quant_intx.h). Included by quant.cc only.
#pragma once
#include <cstring>

#include "common.h"

namespace needle {
namespace {

struct QuantMatrix {
  const uint32_t* q;
  const float* scales;
  const float* offsets;  // nullptr: symmetric
  int64_t n, k, words, groups, group;
  int bits;
};

// Rows r0 .. r0 + R - 1 of w: each one's packed words, scales and offsets (nullptr: none)
template <int R> struct RowsOf {
  const uint32_t* q[R];
  const float* s[R];
  const float* b[R];
  RowsOf(const QuantMatrix& w, int64_t r0) {
    for (int t = 0; t < R; ++t) {
      q[t] = w.q + (r0 + t) * w.words;
      s[t] = w.scales + (r0 + t) * w.groups;
      b[t] = w.offsets ? w.offsets + (r0 + t) * w.groups : nullptr;
    }
  }
};

// Eight floats as one vector (GCC/Clang vector extensions: AVX2's ymm, two NEON registers).
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load_f32x8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Eight int8 values as floats. GCC turns the portable form into byte-by-byte code, so x86
// takes the two conversion instructions directly (5x faster per element, measured).
inline f32x8 int8x8_to_f32(const int8_t* p) {
#if defined(__AVX2__)
  return (f32x8)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  f32x8 v;
  for (int e = 0; e < 8; ++e) v[e] = (float)p[e];
  return v;
#endif
}

// The eight int4 values of one word (nibble e is element e) as floats.
inline f32x8 int4x8_to_f32(uint32_t word) {
  const u32x8 shift = {0, 4, 8, 12, 16, 20, 24, 28};
  return __builtin_convertvector(((u32x8){} + word) >> shift & 15u, f32x8);
}

// Value j of row q (its stored int8 or int4 value, before scale and offset).
template <int BITS> inline float stored(const uint32_t* q, int64_t j) {
  if constexpr (BITS == 8) return (float)reinterpret_cast<const int8_t*>(q)[j];
  return (float)((q[j >> 3] >> ((j & 7) * 4)) & 15u);
}

// The line at byte `at` of the row R rows after row q (the rows a thread takes next) into
// L2. A row of a 2048-wide int4 matrix is 1 KiB, too short a stream for the hardware
// prefetcher to reach memory's rate, and the kernels take R rows at a time: asking for
// the next R rows' lines as these are used took an int4 matvec from ~50% to ~80% of the
// copy rate on the 2-vCPU development machine (docs/quantization.md). L2, not L1: more
// requests in flight.
template <int R> inline void prefetch_ahead(const uint32_t* q, int64_t words, int64_t at) {
#if defined(__SSE__)
  _mm_prefetch(reinterpret_cast<const char*>(q + R * words) + at, _MM_HINT_T1);
#else
  __builtin_prefetch(reinterpret_cast<const char*>(q + R * words) + at, 0, 2);
#endif
}

// y[t] = tail[t] + the lanes of tot[t] (each row's vector total summed once, at the end)
template <int R> inline void row_totals(const f32x8 (&tot)[R], const float (&tail)[R], float* y) {
  for (int t = 0; t < R; ++t) {
    float sum = tail[t];
    for (int e = 0; e < 8; ++e) sum += tot[t][e];
    y[t] = sum;
  }
}

}  // namespace
}  // namespace needle
