// The blocked GEMM core, shared by matmul (matmul.cc) and attention (nn.cc).
#pragma once

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

}  // namespace needle
