// Row kernels of transformers: softmax / log_softmax / rmsnorm / add_rmsnorm / layernorm over
// rows, rope, silu_mul, swiglu. Rows are independent, so threads take whole rows; within a
// row the loops vectorize. fp16/bf16 compute in fp32 and round once on store. Indexing
// (take, scatter_add) is indexing.cc, attention attention.cc.
#include <initializer_list>
#include <type_traits>

#include "common.h"
#include "rows.h"
#include "vmath.h"

namespace needle {
namespace {

// --- softmax family -----------------------------------------------------------------------

template <class S> void softmax_kernel(const void* a_, void* out_, int64_t rows, int64_t dim,
                                       bool log) {
  using C = compute_t<S>;
  const S* a = (const S*)a_;
  S* out = (S*)out_;
  for_rows<S>(rows, dim, [&](int64_t r, C* scratch) {
    const S* x = a + r * dim;
    S* o = out + r * dim;
    const C mx = row_max(x, dim);
    if (log) {
      const C s = lane_sum<C>(dim, [&](int64_t i) { return vexp(load(x[i]) - mx); });
      const C ls = vlog(s);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = store<S>((load(x[i]) - mx) - ls);
      return;
    }
    C* e = std::is_same_v<C, S> ? (C*)o : scratch;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) e[i] = vexp(load(x[i]) - mx);
    const C inv = C(1) / lane_sum<C>(dim, [&](int64_t i) { return e[i]; });
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = store<S>(e[i] * inv);
  });
}

template <class S> void rmsnorm_kernel(const void* x_, const void* w_, void* out_, int64_t rows,
                                       int64_t dim, double eps) {
  using C = compute_t<S>;
  const S* x = (const S*)x_;
  const S* w = (const S*)w_;
  S* out = (S*)out_;
  for_rows<S>(rows, dim, [&](int64_t r, C*) {
    const S* v = x + r * dim;
    S* o = out + r * dim;
    const C ms = lane_sum<C>(dim, [&](int64_t i) { const C t = load(v[i]); return t * t; });
    const C inv = C(1) / std::sqrt(ms / (C)dim + (C)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = store<S>(load(v[i]) * inv * load(w[i]));
  });
}

// total = x + delta rounded to S (total may be x itself: element i is read before it is
// written), then out = rmsnorm(total) * w from the rounded sum, as rmsnorm(x + delta) does.
// With dw (add_rmsnorm_post), delta is first rmsnorm(delta) * dw, rounded to S as the
// separate rmsnorm rounds it.
template <class S> void add_rmsnorm_kernel(const void* x_, const void* d_, const void* dw_,
                                           const void* w_, void* total_, void* out_,
                                           int64_t rows, int64_t dim, double eps) {
  using C = compute_t<S>;
  const S* x = (const S*)x_;
  const S* dl = (const S*)d_;
  const S* dw = (const S*)dw_;
  const S* w = (const S*)w_;
  S* total = (S*)total_;
  S* out = (S*)out_;
  for_rows<S>(rows, dim, [&](int64_t r, C*) {
    const S* a = x + r * dim;
    const S* b = dl + r * dim;
    S* t = total + r * dim;
    S* o = out + r * dim;
    if (dw != nullptr) {
      const C md = lane_sum<C>(dim, [&](int64_t i) { const C v = load(b[i]); return v * v; });
      const C rd = C(1) / std::sqrt(md / (C)dim + (C)eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i)
        t[i] = store<S>(load(a[i]) + load(store<S>(load(b[i]) * rd * load(dw[i]))));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) t[i] = store<S>(load(a[i]) + load(b[i]));
    }
    const C ms = lane_sum<C>(dim, [&](int64_t i) { const C v = load(t[i]); return v * v; });
    const C inv = C(1) / std::sqrt(ms / (C)dim + (C)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = store<S>(load(t[i]) * inv * load(w[i]));
  });
}

template <class S> void layernorm_kernel(const void* x_, const void* w_, const void* b_,
                                         void* out_, int64_t rows, int64_t dim, double eps) {
  using C = compute_t<S>;
  const S* x = (const S*)x_;
  const S* w = (const S*)w_;
  const S* b = (const S*)b_;
  S* out = (S*)out_;
  for_rows<S>(rows, dim, [&](int64_t r, C*) {
    const S* v = x + r * dim;
    S* o = out + r * dim;
    const C mu = lane_sum<C>(dim, [&](int64_t i) { return load(v[i]); }) / (C)dim;
    const C var =
        lane_sum<C>(dim, [&](int64_t i) { const C t = load(v[i]) - mu; return t * t; }) / (C)dim;
    const C inv = C(1) / std::sqrt(var + (C)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i)
      o[i] = store<S>((load(v[i]) - mu) * inv * load(w[i]) + load(b[i]));
  });
}

template <class S> void rope_kernel(const void* x_, const void* cos_, const void* sin_,
                                    void* out_, int64_t batch, int64_t seq, int64_t heads,
                                    int64_t head_dim) {
  const S* x = (const S*)x_;
  const S* cs = (const S*)cos_;
  const S* sn = (const S*)sin_;
  S* out = (S*)out_;
  const int64_t h = head_dim / 2;
  for_rows<S>(batch * seq * heads, head_dim, [&](int64_t r, compute_t<S>*) {
    const int64_t s = r / heads % seq;
    const S* x1 = x + r * head_dim;
    const S* x2 = x1 + h;
    const S* c = cs + s * h;
    const S* si = sn + s * h;
    S* o = out + r * head_dim;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      const auto a = load(x1[i]), b = load(x2[i]), cc = load(c[i]), ss = load(si[i]);
      o[i] = store<S>(a * cc - b * ss);
      o[h + i] = store<S>(b * cc + a * ss);
    }
  });
}

template <class S> void silu_mul_kernel(const void* a_, const void* b_, void* out_, int64_t n) {
  const S* a = (const S*)a_;
  const S* b = (const S*)b_;
  S* out = (S*)out_;
  produce(out, n, int64_t(1) << 13, [=](int64_t lo, int64_t hi, S* __restrict dst) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const auto x = load(a[i]);
      dst[i - lo] = store<S>(x * vsigmoid(x) * load(b[i]));
    }
  });
}

// Gate functions of the gated MLPs: SiLU (SwiGLU) and GELU's tanh form (GeGLU, Gemma)
struct Silu {
  template <class C> C operator()(C a) const { return a * vsigmoid(a); }
};
struct GeluTanh {
  template <class C> C operator()(C a) const {
    const C inner = (a + a * a * a * C(0.044715)) * C(0.7978845608028654);
    return a * (std::tanh(inner) + C(1)) * C(0.5);
  }
};

// out[r, j] = gate(x[r, j]) * x[r, dim + j] for x (rows, 2 * dim): threads take runs of the
// flat output, so one long row (a decode step) spreads over cores as well as many rows do.
template <class S, class Gate> void glu_kernel(const void* x_, void* out_, int64_t n,
                                               int64_t dim) {
  const S* x = (const S*)x_;
  S* out = (S*)out_;
  produce(out, n, int64_t(1) << 13, [=](int64_t lo, int64_t hi, S* __restrict dst) {
    int64_t r = lo / dim, j = lo - r * dim;
    for (int64_t i = lo; i < hi; ++r, j = 0) {
      const int64_t len = std::min(hi - i, dim - j);
      const S* g = x + r * 2 * dim + j;
      const S* u = g + dim;
      S* o = dst + (i - lo);
#pragma omp simd
      for (int64_t k = 0; k < len; ++k) o[k] = store<S>(Gate()(load(g[k])) * load(u[k]));
      i += len;
    }
  });
}
template <class S> void swiglu_kernel(const void* x, void* out, int64_t n, int64_t dim) {
  glu_kernel<S, Silu>(x, out, n, dim);
}
template <class S> void geglu_kernel(const void* x, void* out, int64_t n, int64_t dim) {
  glu_kernel<S, GeluTanh>(x, out, n, dim);
}

// Per-head norms of a fused q/k/v projection: rows of head_dim, each token's query heads
// normed with qw, its key heads with kw, its value heads copied (numpy_ref.qk_rmsnorm).
template <class S> void qk_rmsnorm_kernel(const void* x_, const void* qw_, const void* kw_,
                                          void* out_, int64_t rows, int64_t q_heads,
                                          int64_t kv_heads, int64_t dim, double eps) {
  using C = compute_t<S>;
  const S* x = (const S*)x_;
  const S* qw = (const S*)qw_;
  const S* kw = (const S*)kw_;
  S* out = (S*)out_;
  const int64_t heads = q_heads + 2 * kv_heads;
  for_rows<S>(rows, dim, [&](int64_t r, C*) {
    const S* a = x + r * dim;
    S* o = out + r * dim;
    const int64_t h = r % heads;
    if (h >= q_heads + kv_heads) {
      std::copy(a, a + dim, o);
      return;
    }
    const S* w = h < q_heads ? qw : kw;
    const C ms = lane_sum<C>(dim, [&](int64_t i) { const C v = load(a[i]); return v * v; });
    const C inv = C(1) / std::sqrt(ms / (C)dim + (C)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = store<S>(load(a[i]) * inv * load(w[i]));
  });
}

// --- tables and bindings ------------------------------------------------------------------------

using RowFn = void (*)(const void*, void*, int64_t, int64_t, bool);
using RmsFn = void (*)(const void*, const void*, void*, int64_t, int64_t, double);
using LayerFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, double);
using RopeFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                        int64_t);
using BinFn = void (*)(const void*, const void*, void*, int64_t);
using AddRmsFn = void (*)(const void*, const void*, const void*, const void*, void*, void*,
                         int64_t, int64_t, double);
using SwigluFn = void (*)(const void*, void*, int64_t, int64_t);
using QkNormFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t,
                          int64_t, int64_t, double);

const KernelTable<RowFn> kSoftmax = NEEDLE_FLOAT_TABLE(RowFn, "softmax", softmax_kernel);
const KernelTable<RmsFn> kRmsnorm = NEEDLE_FLOAT_TABLE(RmsFn, "rmsnorm", rmsnorm_kernel);
const KernelTable<LayerFn> kLayernorm = NEEDLE_FLOAT_TABLE(LayerFn, "layernorm", layernorm_kernel);
const KernelTable<RopeFn> kRope = NEEDLE_FLOAT_TABLE(RopeFn, "rope", rope_kernel);
const KernelTable<BinFn> kSiluMul = NEEDLE_FLOAT_TABLE(BinFn, "silu_mul", silu_mul_kernel);
const KernelTable<AddRmsFn> kAddRmsnorm =
    NEEDLE_FLOAT_TABLE(AddRmsFn, "add_rmsnorm", add_rmsnorm_kernel);
const KernelTable<SwigluFn> kSwiglu = NEEDLE_FLOAT_TABLE(SwigluFn, "swiglu", swiglu_kernel);
const KernelTable<SwigluFn> kGeglu = NEEDLE_FLOAT_TABLE(SwigluFn, "geglu", geglu_kernel);
const KernelTable<QkNormFn> kQkRmsnorm =
    NEEDLE_FLOAT_TABLE(QkNormFn, "qk_rmsnorm", qk_rmsnorm_kernel);

int64_t rows_of(const Array& a, int64_t dim, const char* fn) {
  if (dim <= 0 || a.size % dim)
    raise("ShapeError", std::string(fn) + ": dim " + std::to_string(dim) +
                            " does not divide the buffer's " + std::to_string(a.size) +
                            " elements");
  return a.size / dim;
}

void softmax(const Array& a, Array& out, int64_t dim, bool log, const char* fn) {
  const int64_t rows = rows_of(a, dim, fn);
  check_same_dtype(a, out, fn);
  check_size(out, a.size, fn, "out");
  const RowFn f = kSoftmax[a.dtype];
  without_gil([&] { f(a.data, out.data, rows, dim, log); });
}

void rmsnorm(const Array& x, const Array& w, Array& out, int64_t dim, double eps) {
  const int64_t rows = rows_of(x, dim, "rmsnorm");
  check_same_dtype(x, w, "rmsnorm");
  check_same_dtype(x, out, "rmsnorm");
  check_size(w, dim, "rmsnorm", "w");
  check_size(out, x.size, "rmsnorm", "out");
  const RmsFn f = kRmsnorm[x.dtype];
  without_gil([&] { f(x.data, w.data, out.data, rows, dim, eps); });
}

void add_rmsnorm_any(const Array& x, const Array& delta, const Array* dw, const Array& w,
                     Array& total, Array& out, int64_t dim, double eps, const char* fn) {
  const int64_t rows = rows_of(x, dim, fn);
  for (const Array* a : std::initializer_list<const Array*>{&delta, &w, &total, &out})
    check_same_dtype(x, *a, fn);
  check_size(delta, x.size, fn, "delta");
  check_size(w, dim, fn, "w");
  check_size(total, x.size, fn, "total");
  check_size(out, x.size, fn, "out");
  if (dw != nullptr) {
    check_same_dtype(x, *dw, fn);
    check_size(*dw, dim, fn, "dw");
  }
  const void* dw_data = dw != nullptr ? dw->data : nullptr;
  const AddRmsFn f = kAddRmsnorm[x.dtype];
  without_gil([&] {
    f(x.data, delta.data, dw_data, w.data, total.data, out.data, rows, dim, eps);
  });
}

void add_rmsnorm(const Array& x, const Array& delta, const Array& w, Array& total, Array& out,
                 int64_t dim, double eps) {
  add_rmsnorm_any(x, delta, nullptr, w, total, out, dim, eps, "add_rmsnorm");
}

void add_rmsnorm_post(const Array& x, const Array& delta, const Array& dw, const Array& w,
                      Array& total, Array& out, int64_t dim, double eps) {
  add_rmsnorm_any(x, delta, &dw, w, total, out, dim, eps, "add_rmsnorm_post");
}

void layernorm(const Array& x, const Array& w, const Array& b, Array& out, int64_t dim,
               double eps) {
  const int64_t rows = rows_of(x, dim, "layernorm");
  check_same_dtype(x, w, "layernorm");
  check_same_dtype(x, b, "layernorm");
  check_same_dtype(x, out, "layernorm");
  check_size(w, dim, "layernorm", "w");
  check_size(b, dim, "layernorm", "b");
  check_size(out, x.size, "layernorm", "out");
  const LayerFn f = kLayernorm[x.dtype];
  without_gil([&] { f(x.data, w.data, b.data, out.data, rows, dim, eps); });
}

void rope(const Array& x, const Array& cos, const Array& sin, Array& out, int64_t batch,
          int64_t seq, int64_t heads, int64_t head_dim) {
  if (batch < 0 || seq < 0 || heads < 0 || head_dim < 0 || head_dim % 2)
    raise("ShapeError", "rope: sizes must be >= 0 and head_dim even");
  check_same_dtype(x, cos, "rope");
  check_same_dtype(x, sin, "rope");
  check_same_dtype(x, out, "rope");
  check_size(x, batch * seq * heads * head_dim, "rope", "x");
  check_size(cos, seq * (head_dim / 2), "rope", "cos");
  check_size(sin, seq * (head_dim / 2), "rope", "sin");
  check_size(out, x.size, "rope", "out");
  const RopeFn f = kRope[x.dtype];
  if (x.size == 0) return;
  without_gil([&] { f(x.data, cos.data, sin.data, out.data, batch, seq, heads, head_dim); });
}

void silu_mul(const Array& a, const Array& b, Array& out) {
  check_same_dtype(a, b, "silu_mul");
  check_same_dtype(a, out, "silu_mul");
  check_size(b, a.size, "silu_mul", "b");
  check_size(out, a.size, "silu_mul", "out");
  const BinFn f = kSiluMul[a.dtype];
  without_gil([&] { f(a.data, b.data, out.data, a.size); });
}

// out = gate(x[:, :dim]) * x[:, dim:] per row, by one of the gated kernels' tables
void glu(const KernelTable<SwigluFn>& table, const char* fn, const Array& x, Array& out,
         int64_t dim) {
  const int64_t rows = rows_of(out, dim, fn);
  check_same_dtype(x, out, fn);
  check_size(x, rows * 2 * dim, fn, "x");
  const SwigluFn f = table[x.dtype];
  if (out.size == 0) return;
  without_gil([&] { f(x.data, out.data, out.size, dim); });
}

void swiglu(const Array& x, Array& out, int64_t dim) { glu(kSwiglu, "swiglu", x, out, dim); }

void qk_rmsnorm(const Array& x, const Array& qw, const Array& kw, Array& out, int64_t rows,
                int64_t q_heads, int64_t kv_heads, int64_t head_dim, double eps) {
  const char* fn = "qk_rmsnorm";
  if (rows < 0 || q_heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
      rows % (q_heads + 2 * kv_heads))
    raise("ShapeError", "qk_rmsnorm: rows must be a multiple of q_heads + 2 * kv_heads > 0");
  for (const Array* a : std::initializer_list<const Array*>{&qw, &kw, &out})
    check_same_dtype(x, *a, fn);
  check_size(x, rows * head_dim, fn, "x");
  check_size(out, rows * head_dim, fn, "out");
  check_size(qw, head_dim, fn, "q_weight");
  check_size(kw, head_dim, fn, "k_weight");
  const QkNormFn f = kQkRmsnorm[x.dtype];
  if (rows == 0) return;
  without_gil([&] {
    f(x.data, qw.data, kw.data, out.data, rows, q_heads, kv_heads, head_dim, eps);
  });
}

void geglu(const Array& x, Array& out, int64_t dim) { glu(kGeglu, "geglu", x, out, dim); }

}  // namespace

void bind_nn(nb::module_& m) {
  m.def("softmax", [](const Array& a, Array& out, int64_t dim) {
    softmax(a, out, dim, false, "softmax");
  }, nb::arg("a"), nb::arg("out"), nb::arg("dim"));
  m.def("log_softmax", [](const Array& a, Array& out, int64_t dim) {
    softmax(a, out, dim, true, "log_softmax");
  }, nb::arg("a"), nb::arg("out"), nb::arg("dim"));
  m.def("rmsnorm", &rmsnorm, nb::arg("x"), nb::arg("w"), nb::arg("out"), nb::arg("dim"),
        nb::arg("eps"));
  m.def("layernorm", &layernorm, nb::arg("x"), nb::arg("w"), nb::arg("b"), nb::arg("out"),
        nb::arg("dim"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"),
        nb::arg("batch"), nb::arg("seq"), nb::arg("heads"), nb::arg("head_dim"));
  m.def("silu_mul", &silu_mul, nb::arg("a"), nb::arg("b"), nb::arg("out"));
  m.def("add_rmsnorm", &add_rmsnorm, nb::arg("x"), nb::arg("delta"), nb::arg("w"),
        nb::arg("total"), nb::arg("out"), nb::arg("dim"), nb::arg("eps"),
        "total = x + delta (rounded), out = rmsnorm(total) * w, per row; total may be x");
  m.def("add_rmsnorm_post", &add_rmsnorm_post, nb::arg("x"), nb::arg("delta"), nb::arg("dw"),
        nb::arg("w"), nb::arg("total"), nb::arg("out"), nb::arg("dim"), nb::arg("eps"),
        "add_rmsnorm of rmsnorm(delta) * dw (rounded): Gemma's sandwich norms");
  m.def("swiglu", &swiglu, nb::arg("x"), nb::arg("out"), nb::arg("dim"),
        "out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)");
  m.def("qk_rmsnorm", &qk_rmsnorm, nb::arg("x"), nb::arg("q_weight"), nb::arg("k_weight"),
        nb::arg("out"), nb::arg("rows"), nb::arg("q_heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("eps"),
        "per-head rmsnorm of a fused q/k/v projection's query and key heads (values copied)");
  m.def("geglu", &geglu, nb::arg("x"), nb::arg("out"), nb::arg("dim"),
        "out = gelu_tanh(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)");
}

}  // namespace needle
