// Row helpers shared by the CPU kernel files of whole rows (nn.cc, attention.cc): vectorized
// sums and maxima, rows spread over threads, a row's softmax in place, and the float-only
// kernel table.
#pragma once
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "vmath.h"

namespace needle {

// Sum of f(i) for i < n, vectorized (the simd reduction keeps one partial sum per lane).
template <class C, class F> inline C lane_sum(int64_t n, F&& f) {
  C s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += f(i);
  return s;
}

// Maximum of x[0..n), NaN if any element is NaN (as numpy's max).
template <class S> inline compute_t<S> row_max(const S* x, int64_t n) {
  using C = compute_t<S>;
  C m = -std::numeric_limits<C>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const C v = load(x[i]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  return nan ? std::numeric_limits<C>::quiet_NaN() : m;
}

// Run f(row, scratch) over `rows` rows of length `dim` across threads; scratch is a per-call
// compute-type buffer of `dim` elements for storage types that are not their compute type.
template <class S, class F> void for_rows(int64_t rows, int64_t dim, F&& f) {
  using C = compute_t<S>;
  const int64_t group = std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1));
  const int64_t items = (rows + group - 1) / group;
  parallel_items(items, group * dim * 4, [&](int64_t it) {
    std::vector<C> scratch(std::is_same_v<C, S> ? 0 : dim);
    const int64_t r1 = std::min(rows, (it + 1) * group);
    for (int64_t r = it * group; r < r1; ++r) f(r, scratch.data());
  });
}

// Softmax of one row of scores in place over [0, n); the rest of the row is not read.
template <class C> void softmax_row(C* s, int64_t n) {
  const C mx = row_max(s, n);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = vexp(s[j] - mx);
  const C inv = C(1) / lane_sum<C>(n, [&](int64_t j) { return s[j]; });
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// Float kernels only: make(Tag<S>) returns &kernel<S> for the four float dtypes.
#define NEEDLE_FLOAT_TABLE(Fn, name, kernel)                      \
  KernelTable<Fn>(name, [](auto tag) -> Fn {                      \
    using S = typename decltype(tag)::type;                       \
    if constexpr (is_float_storage_v<S>) return &kernel<S>;       \
    else return nullptr;                                          \
  })

}  // namespace needle
