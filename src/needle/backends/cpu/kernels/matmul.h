// The blocked GEMM core, shared by matmul (matmul.cc) and attention (attention.cc).
#pragma once

#include <type_traits>

#include "common.h"

namespace needle {

// C (m x p, row stride ldc) = A (m x n) . B (n x p) on the calling thread, where
// A(i, k) = a[i * ars + k * acs] and B(k, j) = b[k * brs + j * bcs]: transposes are strides.
// T is float or double (inputs and accumulation of one type).
template <class T>
void gemm_serial(int64_t m, int64_t n, int64_t p, const T* a, int64_t ars, int64_t acs,
                 const T* b, int64_t brs, int64_t bcs, T* c, int64_t ldc);

// out (m x p) = a (m x n) . b^T for b stored (p x n), all three of float dtype dt, on all
// threads, each element rounded once to dt: the matmul kernel with transpose_b (decode.cc's
// many-row path). Call without the GIL; dt must be a float dtype (validated by the caller).
void matmul_nt(DType dt, const void* a, const void* b, void* out, int64_t m, int64_t n,
               int64_t p);

// x of storage type S as accumulator type T (float, double, or an integer S's unsigned type)
template <class T, class S> inline T widen(S x) {
  if constexpr (std::is_integral_v<T>) return (T)x;
  else return (T)load(x);
}

// acc[r * ld + q] = h[r] . W[q] for r < rows, q < n, W holding n rows of length dim (h of
// type H: the accumulator type T, or S itself; T float, double, or an integer S's unsigned
// type). Four weight rows at a time: each load of h serves four of them, and the four rows
// (a few KiB) stay in cache while the rows of h pass over them, so the weights stream once;
// two rows of h per pass share each widened weight element (eight sums: within 16 vector
// registers).
template <class S, class T, class H>
inline void dot_block(const H* h, int64_t rows, const S* W, int64_t n, int64_t dim, T* acc,
                      int64_t ld) {
  int64_t q = 0;
  for (; q + 4 <= n; q += 4) {
    const S *w0 = W + q * dim, *w1 = w0 + dim, *w2 = w1 + dim, *w3 = w2 + dim;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const H *ha = h + r * dim, *hb = ha + dim;
      T a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
      for (int64_t k = 0; k < dim; ++k) {
        const T x0 = widen<T>(w0[k]), x1 = widen<T>(w1[k]), x2 = widen<T>(w2[k]),
                x3 = widen<T>(w3[k]);
        const T u = widen<T>(ha[k]), v = widen<T>(hb[k]);
        a0 += u * x0;
        a1 += u * x1;
        a2 += u * x2;
        a3 += u * x3;
        b0 += v * x0;
        b1 += v * x1;
        b2 += v * x2;
        b3 += v * x3;
      }
      T* o = acc + r * ld + q;
      o[0] = a0, o[1] = a1, o[2] = a2, o[3] = a3;
      o[ld] = b0, o[ld + 1] = b1, o[ld + 2] = b2, o[ld + 3] = b3;
    }
    for (; r < rows; ++r) {
      const H* hr = h + r * dim;
      T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < dim; ++k) {
        const T hk = widen<T>(hr[k]);
        s0 += hk * widen<T>(w0[k]);
        s1 += hk * widen<T>(w1[k]);
        s2 += hk * widen<T>(w2[k]);
        s3 += hk * widen<T>(w3[k]);
      }
      T* o = acc + r * ld + q;
      o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
    }
  }
  for (; q < n; ++q) {
    const S* wq = W + q * dim;
    for (int64_t r = 0; r < rows; ++r) {
      const H* hr = h + r * dim;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < dim; ++k) s += widen<T>(hr[k]) * widen<T>(wq[k]);
      acc[r * ld + q] = s;
    }
  }
}

}  // namespace needle
