// The decode step's fused projections (numpy_ref/decode.py): rmsnorm_matvec (pre-norm +
// projection), rmsnorm_matvec_swiglu (pre-norm + gate/up projection + SiLU·mul) and
// matvec_add (projection + residual add, in place).
//
// Decoding reads every weight once per token, so these kernels are bound by memory: the
// normed input h is computed once (rounded to the dtype, as rmsnorm would store it) and kept
// in the compute type, then threads take blocks of output columns and stream each weight row
// once, dotting it with every row of h, and apply the epilogue (round the product, then
// swiglu or the residual add) to the block they own. No intermediate goes to memory.
//
// Many rows (a prefill rather than a decode step) are compute-bound instead: there the fused
// loop would redo the weight widening per row, so h is rounded into a buffer and the
// blocked GEMM of matmul.cc does the product. Both paths round where the unfused ops would
// (rmsnorm, matmul, swiglu, ewise_add), so they differ from them only in the order of sums.
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

#include "common.h"
#include "matmul.h"
#include "vmath.h"

namespace needle {
namespace {

enum class Epilogue { none, swiglu, add };

// Up to this many rows the fused streaming loop runs; above it, h goes to a buffer and
// matmul_nt does the product (dot_block up to 64 rows, the blocked GEMM beyond: the GEMM
// packs the whole weight per call, which small batches do not repay). Measured on 2 cores,
// (rows, 2048) x (2560, 2048) bf16, before matmul had its few-row path: fused
// 1.0/2.2/7.7/17.6 ms for 4/8/16/32 rows, GEMM 9.2/9.2/14.5/16.9 ms (docs/cpu_notes.md).
constexpr int64_t kFusedRows = 16;

// Accumulation type: float for f32/f16/bf16, double for f64 (as matmul's).
template <class S> using acc_t = std::conditional_t<std::is_same_v<S, double>, double, float>;

// 1 / sqrt(mean(v^2) + eps) of one row, computed as rmsnorm_kernel (nn.cc) computes it.
template <class S> acc_t<S> inv_rms(const S* v, int64_t dim, double eps) {
  using C = acc_t<S>;
  C ms = 0;
#pragma omp simd reduction(+ : ms)
  for (int64_t i = 0; i < dim; ++i) {
    const C t = load(v[i]);
    ms += t * t;
  }
  return C(1) / std::sqrt(ms / (C)dim + (C)eps);
}

// One row of h in the compute type: rmsnorm(v) * w rounded to S, as rmsnorm stores it; or,
// without w (matvec_add), v widened.
template <class S>
void normed_row(const S* v, const S* w, int64_t dim, double eps, acc_t<S>* h) {
  if (!w) {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) h[i] = load(v[i]);
    return;
  }
  const acc_t<S> inv = inv_rms(v, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) h[i] = load(store<S>(load(v[i]) * inv * load(w[i])));
}

// The epilogue of one output element o from its product(s), each first rounded to S as the
// matmul would store it: swiglu as swiglu_kernel (nn.cc) computes it, the add as ewise_add
// (o holds total's old value, the only case where it is read).
template <class S, Epilogue E>
inline void finish(acc_t<S> y, acc_t<S> up, S* o) {
  const auto g = load(store<S>(y));
  if constexpr (E == Epilogue::swiglu) *o = store<S>(g * vsigmoid(g) * load(store<S>(up)));
  else if constexpr (E == Epilogue::add) *o = store<S>(load(*o) + g);
  else *o = store<S>(y);
}

template <class S> struct FusedArgs {
  const S* x;       // rows x dim
  const S* w;       // the norm's weight (dim), nullptr for matvec_add
  const S* weight;  // (p or 2p) x dim
  S* out;           // rows x p (matvec_add: total, read and written)
  int64_t rows, dim, p;
  double eps;
};

// Few rows: h once, then column blocks across threads, each streaming its weight rows once.
template <class S, Epilogue E> void fused_rows(const FusedArgs<S>& g) {
  using T = acc_t<S>;
  const int64_t rows = g.rows, dim = g.dim, p = g.p;
  // h is a copy, so out (total) may alias x (a): nothing reads x after this point.
  std::vector<T> h((size_t)(rows * dim));
  for (int64_t r = 0; r < rows; ++r) normed_row(g.x + r * dim, g.w, dim, g.eps, &h[r * dim]);
  const int64_t nt = max_threads();
  const int64_t width = std::min<int64_t>(512, std::max<int64_t>(16, (p + 4 * nt - 1) / (4 * nt)));
  const int64_t blocks = (p + width - 1) / width;
  const int64_t reads = E == Epilogue::swiglu ? 2 : 1;  // weight rows per output column
  parallel_items(blocks, width * dim * reads, [&](int64_t b) {
    const int64_t j0 = b * width, n = std::min(p, j0 + width) - j0;
    std::vector<T> acc((size_t)(rows * n * reads));
    dot_block(h.data(), rows, g.weight + j0 * dim, n, dim, acc.data(), n);
    if constexpr (E == Epilogue::swiglu)
      dot_block(h.data(), rows, g.weight + (p + j0) * dim, n, dim, acc.data() + rows * n, n);
    for (int64_t r = 0; r < rows; ++r) {
      S* o = g.out + r * p + j0;
      const T* y = acc.data() + r * n;
      const T* up = E == Epilogue::swiglu ? y + rows * n : y;
      for (int64_t q = 0; q < n; ++q) finish<S, E>(y[q], up[q], o + q);
    }
  });
}

// Many rows: h rounded into a buffer, the blocked GEMM (rounding the product to S), then the
// epilogue over the outputs.
template <class S, Epilogue E> void gemm_rows(DType dt, const FusedArgs<S>& g) {
  const int64_t rows = g.rows, dim = g.dim, p = g.p;
  const int64_t cols = E == Epilogue::swiglu ? 2 * p : p;
  const S* h = g.x;  // matvec_add multiplies a itself (the GEMM writes y, not total)
  std::optional<Scratch<S>> normed;
  if (g.w) {
    normed.emplace((size_t)(rows * dim));
    S* hs = normed->p;
    parallel_items(rows, dim, [&](int64_t r) {
      const S* v = g.x + r * dim;
      const acc_t<S> inv = inv_rms(v, dim, g.eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) hs[r * dim + i] = store<S>(load(v[i]) * inv * load(g.w[i]));
    });
    h = hs;
  }
  if constexpr (E == Epilogue::none) {
    matmul_nt(dt, h, g.weight, g.out, rows, dim, cols);
  } else {
    Scratch<S> y((size_t)(rows * cols));
    matmul_nt(dt, h, g.weight, y.p, rows, dim, cols);
    parallel_for(rows * p, int64_t(1) << 13, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t r = i / p, j = i - r * p;
        const S* yr = y.p + r * cols;
        if constexpr (E == Epilogue::swiglu) finish<S, E>(load(yr[j]), load(yr[p + j]), g.out + i);
        else finish<S, E>(load(yr[j]), 0, g.out + i);
      }
    });
  }
}

template <class S, Epilogue E>
void fused_kernel(DType dt, const void* x, const void* w, const void* weight, void* out,
                  int64_t rows, int64_t dim, int64_t p, double eps) {
  const FusedArgs<S> g{(const S*)x, (const S*)w, (const S*)weight, (S*)out, rows, dim, p, eps};
  if (rows <= kFusedRows) fused_rows<S, E>(g);
  else gemm_rows<S, E>(dt, g);
}

using FusedFn = void (*)(DType, const void*, const void*, const void*, void*, int64_t, int64_t,
                         int64_t, double);

template <Epilogue E> KernelTable<FusedFn> fused_table(const char* name) {
  return KernelTable<FusedFn>(name, [](auto tag) -> FusedFn {
    using S = typename decltype(tag)::type;
    if constexpr (is_float_storage_v<S>) return &fused_kernel<S, E>;
    else return nullptr;
  });
}

const KernelTable<FusedFn> kRmsnormMatvec = fused_table<Epilogue::none>("rmsnorm_matvec");
const KernelTable<FusedFn> kRmsnormMatvecSwiglu =
    fused_table<Epilogue::swiglu>("rmsnorm_matvec_swiglu");
const KernelTable<FusedFn> kMatvecAdd = fused_table<Epilogue::add>("matvec_add");

// rows, dim, p >= 0 and every buffer's size product representable (so check_size compares
// true sizes): ShapeError naming the function otherwise.
void check_extents(int64_t rows, int64_t dim, int64_t p, int64_t weight_rows, const char* fn) {
  if (rows < 0 || dim < 0 || p < 0)
    raise("ShapeError", std::string(fn) + ": rows, dim and p must be >= 0, got " +
                            std::to_string(rows) + ", " + std::to_string(dim) + ", " +
                            std::to_string(p));
  constexpr int64_t big = std::numeric_limits<int64_t>::max() / 4;
  const auto fits = [](int64_t a, int64_t b) { return a == 0 || b <= big / a; };
  if (!fits(rows, dim) || !fits(rows, p) || !fits(p, weight_rows) || !fits(p * weight_rows, dim))
    raise("ShapeError", std::string(fn) + ": rows, dim and p are too large");
}

void rmsnorm_matvec_impl(const KernelTable<FusedFn>& table, const char* fn, int64_t factor,
                         const Array& x, const Array& w, const Array& weight, Array& out,
                         int64_t rows, int64_t dim, int64_t p, double eps) {
  check_extents(rows, dim, p, factor, fn);
  for (const Array* a : std::initializer_list<const Array*>{&w, &weight, &out})
    check_same_dtype(x, *a, fn);
  check_size(x, rows * dim, fn, "x");
  check_size(w, dim, fn, "w");
  check_size(weight, factor * p * dim, fn, "weight");
  check_size(out, rows * p, fn, "out");
  const FusedFn f = table[x.dtype];
  if (out.size == 0) return;
  without_gil([&] { f(x.dtype, x.data, w.data, weight.data, out.data, rows, dim, p, eps); });
}

void rmsnorm_matvec(const Array& x, const Array& w, const Array& weight, Array& out,
                    int64_t rows, int64_t dim, int64_t p, double eps) {
  rmsnorm_matvec_impl(kRmsnormMatvec, "rmsnorm_matvec", 1, x, w, weight, out, rows, dim, p,
                      eps);
}

void rmsnorm_matvec_swiglu(const Array& x, const Array& w, const Array& weight, Array& out,
                           int64_t rows, int64_t dim, int64_t p, double eps) {
  rmsnorm_matvec_impl(kRmsnormMatvecSwiglu, "rmsnorm_matvec_swiglu", 2, x, w, weight, out,
                      rows, dim, p, eps);
}

void matvec_add(const Array& a, const Array& weight, Array& total, int64_t rows, int64_t dim,
                int64_t p) {
  const char* fn = "matvec_add";
  check_extents(rows, dim, p, 1, fn);
  check_same_dtype(a, weight, fn);
  check_same_dtype(a, total, fn);
  check_size(a, rows * dim, fn, "a");
  check_size(weight, p * dim, fn, "weight");
  check_size(total, rows * p, fn, "total");
  const FusedFn f = kMatvecAdd[a.dtype];
  if (total.size == 0) return;
  without_gil([&] { f(a.dtype, a.data, nullptr, weight.data, total.data, rows, dim, p, 0.0); });
}

}  // namespace

void bind_decode(nb::module_& m) {
  m.def("rmsnorm_matvec", &rmsnorm_matvec, nb::arg("x"), nb::arg("w"), nb::arg("weight"),
        nb::arg("out"), nb::arg("rows"), nb::arg("dim"), nb::arg("p"), nb::arg("eps"),
        "out (rows, p) = rmsnorm(x) * w @ weight.T, weight (p, dim)");
  m.def("rmsnorm_matvec_swiglu", &rmsnorm_matvec_swiglu, nb::arg("x"), nb::arg("w"),
        nb::arg("weight"), nb::arg("out"), nb::arg("rows"), nb::arg("dim"), nb::arg("p"),
        nb::arg("eps"),
        "out (rows, p) = silu(g) * u, [g | u] = rmsnorm(x) * w @ weight.T, weight (2p, dim)");
  m.def("matvec_add", &matvec_add, nb::arg("a"), nb::arg("weight"), nb::arg("total"),
        nb::arg("rows"), nb::arg("dim"), nb::arg("p"),
        "total (rows, p) += a @ weight.T (the product rounded first), in place");
}

}  // namespace needle
