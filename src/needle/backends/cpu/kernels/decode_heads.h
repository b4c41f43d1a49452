// One token's attention for the query heads of one KV head, over n cached key and value rows
// wherever they live: attention.cc's attention_decode (a contiguous cache) and paged.cc's
// paged_attention (rows in pages of a pool) call it with functions that give row j's
// address.
#pragma once
#include <memory>
#include <vector>

#include "common.h"
#include "rows.h"

namespace needle {
namespace {

// Query heads q (`heads` of them, D values each, roped, in the compute type C) against keys
// key(0..n-1) and values value(0..n-1) (D values of S each), into out (heads x D, rounded to
// S once). Per block of DECODE_KEYS keys the keys are made C once, transposed
// (dimension-major), so that each head's scores are vector FMAs of one q value against the
// block's keys (no horizontal sum a key); the values are made C once a block and each head's
// weights added in row by row. A query head that converted the keys itself and summed each
// 64-long product across lanes took ~120 cycles a (head, key) pair (docs/cpu_notes.md).
constexpr int64_t DECODE_KEYS = 64;
template <class S, class C, class KeyRow, class ValueRow>
void decode_heads(const C* q, int64_t n, int64_t D, int64_t heads, C scale, double softcap,
                  KeyRow&& key, ValueRow&& value, S* out) {
  constexpr int64_t J = DECODE_KEYS;
  std::vector<C> s((size_t)(heads * n)), o((size_t)(heads * D), C(0));
  std::unique_ptr<C[]> blk(new C[(size_t)(J * D)]);
  alignas(64) C acc[J];
  for (int64_t j0 = 0; j0 < n; j0 += J) {
    // the block's keys, padded with zeros to a multiple of 16 (a short cache's one block
    // does not pay for 64)
    const int64_t m = std::min(J, n - j0), mr = (m + 15) / 16 * 16;
    const S* kr[J];
    for (int64_t j = 0; j < m; ++j) kr[j] = key(j0 + j);
    for (int64_t d = 0; d < D; ++d) {  // written a row of blk at a time
      C* row = blk.get() + d * J;
      for (int64_t j = 0; j < m; ++j) row[j] = load(kr[j][d]);
      for (int64_t j = m; j < mr; ++j) row[j] = C(0);
    }
    for (int64_t h = 0; h < heads; ++h) {
#pragma omp simd
      for (int64_t j = 0; j < mr; ++j) acc[j] = C(0);
      for (int64_t d = 0; d < D; ++d) {
        const C qd = q[h * D + d];
        const C* kd = blk.get() + d * J;
#pragma omp simd
        for (int64_t j = 0; j < mr; ++j) acc[j] += qd * kd[j];
      }
      C* sh = s.data() + h * n + j0;
      for (int64_t j = 0; j < m; ++j) sh[j] = soft_cap(acc[j] * scale, softcap);
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_row(s.data() + h * n, n);
  for (int64_t j0 = 0; j0 < n; j0 += J) {
    const int64_t m = std::min(J, n - j0);
    for (int64_t j = 0; j < m; ++j) {
      const S* vr = value(j0 + j);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) blk[j * D + d] = load(vr[d]);
    }
    for (int64_t h = 0; h < heads; ++h) {
      C* oh = o.data() + h * D;
      const C* wh = s.data() + h * n + j0;
      for (int64_t j = 0; j < m; ++j) {
        const C pj = wh[j];
        const C* vr = blk.get() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oh[d] += pj * vr[d];
      }
    }
  }
  for (int64_t i = 0; i < heads * D; ++i) out[i] = store<S>(o[i]);
}

}  // namespace
}  // namespace needle
