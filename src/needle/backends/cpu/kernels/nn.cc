// Transformer and indexing kernels: take / scatter_add (embedding lookup and its gradient),
// softmax / log_softmax / rmsnorm / add_rmsnorm / layernorm over rows, rope, silu_mul, swiglu,
// attention with grouped-query heads, and attention_decode (one token against a KV cache). Rows are independent, so threads take whole rows; within a row the loops
// vectorize. fp16/bf16 compute in fp32 and round once on store.
#include <initializer_list>
#include <type_traits>

#include "common.h"
#include "matmul.h"
#include "vmath.h"

namespace needle {
namespace {

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
template <class S> void add_rmsnorm_kernel(const void* x_, const void* d_, const void* w_,
                                           void* total_, void* out_, int64_t rows, int64_t dim,
                                           double eps) {
  using C = compute_t<S>;
  const S* x = (const S*)x_;
  const S* dl = (const S*)d_;
  const S* w = (const S*)w_;
  S* total = (S*)total_;
  S* out = (S*)out_;
  for_rows<S>(rows, dim, [&](int64_t r, C*) {
    const S* a = x + r * dim;
    const S* b = dl + r * dim;
    S* t = total + r * dim;
    S* o = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) t[i] = store<S>(load(a[i]) + load(b[i]));
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

// out[r, j] = silu(x[r, j]) * x[r, dim + j] for x (rows, 2 * dim): threads take runs of the
// flat output, so one long row (a decode step) spreads over cores as well as many rows do.
template <class S> void swiglu_kernel(const void* x_, void* out_, int64_t n, int64_t dim) {
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
      for (int64_t k = 0; k < len; ++k) {
        const auto a = load(g[k]);
        o[k] = store<S>(a * vsigmoid(a) * load(u[k]));
      }
      i += len;
    }
  });
}

// --- indexing -------------------------------------------------------------------------------------

// indices as int64 in [0, rows) (negative ones wrap, as numpy's); returns the first bad one.
template <class I> bool normalize_indices(const I* idx, int64_t n, int64_t rows,
                                          std::vector<int64_t>& out, int64_t* bad) {
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = (int64_t)idx[i];
    if (j < -rows || j >= rows) {
      *bad = j;
      return false;
    }
    out[i] = j < 0 ? j + rows : j;
  }
  return true;
}

std::vector<int64_t> checked_indices(const Array& indices, int64_t rows, const char* fn) {
  if (indices.dtype != DType::i32 && indices.dtype != DType::i64)
    raise("DTypeError", std::string(fn) + ": indices must be int32 or int64, got " +
                            dtype_name(indices.dtype));
  std::vector<int64_t> idx;
  int64_t bad = 0;
  bool ok;
  {
    nb::gil_scoped_release release;
    ok = indices.dtype == DType::i32
             ? normalize_indices(indices.as<int32_t>(), indices.size, rows, idx, &bad)
             : normalize_indices(indices.as<int64_t>(), indices.size, rows, idx, &bad);
  }
  if (!ok)
    raise("IndexOutOfRangeError", std::string(fn) + ": index " + std::to_string(bad) +
                                      " is out of range for " + std::to_string(rows) + " rows");
  return idx;
}

void take(const Array& table, const Array& indices, Array& out, int64_t rows, int64_t dim) {
  check_size(table, rows * dim, "take", "table");
  check_same_dtype(table, out, "take");
  check_size(out, indices.size * dim, "take", "out");
  const std::vector<int64_t> idx = checked_indices(indices, rows, "take");
  const size_t row_bytes = (size_t)dim * dtype_size(table.dtype);
  const char* src = (const char*)table.data;
  char* dst = (char*)out.data;
  without_gil([&] {
    parallel_items((int64_t)idx.size(), dim, [&](int64_t i) {
      std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
    });
  });
}

template <class S> void scatter_add_kernel(const std::vector<int64_t>& idx, const void* values_,
                                           void* out_, int64_t rows, int64_t dim) {
  using C = compute_t<S>;
  using A = wrapping_t<C>;
  const S* values = (const S*)values_;
  S* out = (S*)out_;
  // Columns are independent: a thread owns a block of columns for every index, in order, so
  // repeated indices accumulate deterministically in the reference's order.
  const int64_t width = std::max<int64_t>(64, (dim + max_threads() - 1) / max_threads());
  const int64_t blocks = (dim + width - 1) / width;
  parallel_items(blocks, (int64_t)idx.size() * width, [&](int64_t blk) {
    const int64_t c0 = blk * width, c1 = std::min(dim, c0 + width);
    std::vector<A> acc((size_t)rows * (c1 - c0));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c) acc[r * (c1 - c0) + c - c0] = (A)load(out[r * dim + c]);
    for (size_t i = 0; i < idx.size(); ++i) {
      A* dst = acc.data() + idx[i] * (c1 - c0);
      const S* src = values + (int64_t)i * dim + c0;
#pragma omp simd
      for (int64_t c = 0; c < c1 - c0; ++c) dst[c] += (A)load(src[c]);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c) out[r * dim + c] = store<S>((C)acc[r * (c1 - c0) + c - c0]);
  });
}

using ScatterFn = void (*)(const std::vector<int64_t>&, const void*, void*, int64_t, int64_t);

const KernelTable<ScatterFn> kScatterAdd("scatter_add", [](auto tag) -> ScatterFn {
  using S = typename decltype(tag)::type;
  if constexpr (std::is_same_v<S, b8>) return nullptr;
  else return &scatter_add_kernel<S>;
});

// --- attention -------------------------------------------------------------------------------------

struct AttentionArgs {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim;
  double scale;
  bool causal;
};

// Softmax of one row of scores in place over [0, n); the rest of the row is not read.
template <class C> void softmax_row(C* s, int64_t n) {
  const C mx = row_max(s, n);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = vexp(s[j] - mx);
  const C inv = C(1) / lane_sum<C>(n, [&](int64_t j) { return s[j]; });
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// One work item: query rows [i0, i0 + qb) of head (b, h). Scores and outputs go through the
// blocked GEMM (a tile of queries against all visible keys), so prefill runs at matmul speed;
// causal blocks stop at their last visible key.
template <class S> void attention_block(const S* q, const S* k, const S* v, S* out,
                                        const AttentionArgs& g, int64_t bh, int64_t i0,
                                        int64_t qb) {
  using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const int64_t D = g.head_dim, b = bh / g.q_heads, h = bh % g.q_heads;
  const int64_t kvh = h / (g.q_heads / g.kv_heads);
  const int64_t shift = g.kv_len - g.q_len;  // query i sits at position shift + i
  const int64_t visible = g.causal ? std::min(g.kv_len, shift + i0 + qb) : g.kv_len;
  const S* qs = q + (bh * g.q_len + i0) * D;
  const S* ks = k + (b * g.kv_heads + kvh) * g.kv_capacity * D;
  const S* vs = v + (b * g.kv_heads + kvh) * g.kv_capacity * D;
  S* os = out + (bh * g.q_len + i0) * D;

  // fp16/bf16 inputs are widened once per block so the GEMM sees compute-type matrices.
  std::vector<C> widened;
  const C *qc, *kc, *vc;
  if constexpr (std::is_same_v<S, C>) {
    qc = qs;
    kc = ks;
    vc = vs;
  } else {
    widened.resize((size_t)(qb + 2 * visible) * D);
    C* w = widened.data();
    for (int64_t i = 0; i < qb * D; ++i) w[i] = load(qs[i]);
    for (int64_t i = 0; i < visible * D; ++i) w[qb * D + i] = load(ks[i]);
    for (int64_t i = 0; i < visible * D; ++i) w[(qb + visible) * D + i] = load(vs[i]);
    qc = w;
    kc = w + qb * D;
    vc = w + (qb + visible) * D;
  }
  std::vector<C> scores((size_t)qb * visible), o((size_t)qb * D);
  const C scale = (C)g.scale;
  if (qb == 1) {  // decode: dot products and a weighted sum, no packing
    for (int64_t j = 0; j < visible; ++j)
      scores[j] = lane_sum<C>(D, [&](int64_t d) { return qc[d] * kc[j * D + d]; });
  } else {
    gemm_serial<C>(qb, D, visible, qc, D, 1, kc, 1, D, scores.data(), visible);
  }
  for (int64_t i = 0; i < qb; ++i) {
    C* s = scores.data() + i * visible;
    const int64_t n = g.causal ? std::min(visible, shift + i0 + i + 1) : visible;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= scale;
    softmax_row(s, n);
    for (int64_t j = n; j < visible; ++j) s[j] = 0;
  }
  if (qb == 1) {
    for (int64_t j = 0; j < visible; ++j) {
      const C pj = scores[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += pj * vc[j * D + d];
    }
  } else {
    gemm_serial<C>(qb, visible, D, scores.data(), visible, 1, vc, D, 1, o.data(), D);
  }
  for (int64_t i = 0; i < qb * D; ++i) os[i] = store<S>(o[i]);
}

template <class S> void attention_kernel(const void* q, const void* k, const void* v, void* out,
                                         const AttentionArgs& g) {
  constexpr int64_t QB = 64;
  const int64_t blocks = (g.q_len + QB - 1) / QB;
  const int64_t items = g.batch * g.q_heads * blocks;
  parallel_items(items, g.kv_len * g.head_dim * std::min(QB, g.q_len), [&](int64_t it) {
    const int64_t bh = it / blocks, i0 = it % blocks * QB;
    attention_block<S>((const S*)q, (const S*)k, (const S*)v, (S*)out, g, bh, i0,
                       std::min(QB, g.q_len - i0));
  });
}

// --- attention_decode -------------------------------------------------------------------------

struct DecodeArgs {
  int64_t q_heads, kv_heads, head_dim, capacity, table_rows;
  double scale;
};

// One token's step (numpy_ref.attention_decode): rope the queries and the key with row p of
// the tables (rounded to S), store key and value at row p of the caches, then attention of
// every query head over rows 0..p of its KV head. A position outside the cache or the tables
// writes nothing and gives NaN outputs.
template <class S> void attention_decode_kernel(const void* qkv_, const void* cos_,
                                                const void* sin_, int32_t p, void* keys_,
                                                void* values_, void* out_, const DecodeArgs& g) {
  using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const S* qkv = (const S*)qkv_;
  S* keys = (S*)keys_;
  S* values = (S*)values_;
  S* out = (S*)out_;
  const int64_t D = g.head_dim, H = D / 2;
  if (p < 0 || p >= std::min(g.capacity, g.table_rows)) {
    const S nan = store<S>(std::numeric_limits<C>::quiet_NaN());
    std::fill(out, out + g.q_heads * D, nan);
    return;
  }
  const S* cs = (const S*)cos_ + (int64_t)p * H;
  const S* sn = (const S*)sin_ + (int64_t)p * H;
  // RoPE of the queries (kept in the compute type after rounding) and of the keys (stored)
  const int64_t heads = g.q_heads + g.kv_heads;
  std::vector<C> q((size_t)(g.q_heads * D));
  for (int64_t h = 0; h < heads; ++h) {
    const S* x = qkv + h * D;
    S* krow = h < g.q_heads ? nullptr : keys + ((h - g.q_heads) * g.capacity + p) * D;
    for (int64_t i = 0; i < H; ++i) {
      const C a = load(x[i]), b = load(x[H + i]), c = load(cs[i]), s = load(sn[i]);
      const S lo = store<S>(a * c - b * s), hi = store<S>(b * c + a * s);
      if (krow) {
        krow[i] = lo;
        krow[H + i] = hi;
      } else {
        q[h * D + i] = load(lo);
        q[h * D + H + i] = load(hi);
      }
    }
  }
  for (int64_t h = 0; h < g.kv_heads; ++h)
    std::memcpy(values + (h * g.capacity + p) * D, qkv + (heads + h) * D, (size_t)D * sizeof(S));

  const int64_t n = (int64_t)p + 1, group = g.q_heads / g.kv_heads;
  const C scale = (C)g.scale;
  parallel_items(g.q_heads, n * D * 2, [&](int64_t h) {
    const C* qh = q.data() + h * D;
    const S* kc = keys + h / group * g.capacity * D;
    const S* vc = values + h / group * g.capacity * D;
    std::vector<C> s((size_t)n), o((size_t)D, C(0));
    for (int64_t j = 0; j < n; ++j)
      s[j] = lane_sum<C>(D, [&](int64_t d) { return qh[d] * load(kc[j * D + d]); }) * scale;
    softmax_row(s.data(), n);
    for (int64_t j = 0; j < n; ++j) {
      const C pj = s[j];
      const S* vr = vc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += pj * load(vr[d]);
    }
    S* oh = out + h * D;
    for (int64_t d = 0; d < D; ++d) oh[d] = store<S>(o[d]);
  });
}

// --- tables and bindings ------------------------------------------------------------------------

using RowFn = void (*)(const void*, void*, int64_t, int64_t, bool);
using RmsFn = void (*)(const void*, const void*, void*, int64_t, int64_t, double);
using LayerFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, double);
using RopeFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                        int64_t);
using BinFn = void (*)(const void*, const void*, void*, int64_t);
using AttnFn = void (*)(const void*, const void*, const void*, void*, const AttentionArgs&);
using AddRmsFn = void (*)(const void*, const void*, const void*, void*, void*, int64_t, int64_t,
                         double);
using SwigluFn = void (*)(const void*, void*, int64_t, int64_t);
using DecodeFn = void (*)(const void*, const void*, const void*, int32_t, void*, void*, void*,
                          const DecodeArgs&);

// Float kernels only: make(Tag<S>) returns &kernel<S> for the four float dtypes.
#define NEEDLE_FLOAT_TABLE(Fn, name, kernel)                      \
  KernelTable<Fn>(name, [](auto tag) -> Fn {                      \
    using S = typename decltype(tag)::type;                       \
    if constexpr (is_float_storage_v<S>) return &kernel<S>;       \
    else return nullptr;                                          \
  })

const KernelTable<RowFn> kSoftmax = NEEDLE_FLOAT_TABLE(RowFn, "softmax", softmax_kernel);
const KernelTable<RmsFn> kRmsnorm = NEEDLE_FLOAT_TABLE(RmsFn, "rmsnorm", rmsnorm_kernel);
const KernelTable<LayerFn> kLayernorm = NEEDLE_FLOAT_TABLE(LayerFn, "layernorm", layernorm_kernel);
const KernelTable<RopeFn> kRope = NEEDLE_FLOAT_TABLE(RopeFn, "rope", rope_kernel);
const KernelTable<BinFn> kSiluMul = NEEDLE_FLOAT_TABLE(BinFn, "silu_mul", silu_mul_kernel);
const KernelTable<AttnFn> kAttention = NEEDLE_FLOAT_TABLE(AttnFn, "attention", attention_kernel);
const KernelTable<AddRmsFn> kAddRmsnorm =
    NEEDLE_FLOAT_TABLE(AddRmsFn, "add_rmsnorm", add_rmsnorm_kernel);
const KernelTable<SwigluFn> kSwiglu = NEEDLE_FLOAT_TABLE(SwigluFn, "swiglu", swiglu_kernel);
const KernelTable<DecodeFn> kAttentionDecode =
    NEEDLE_FLOAT_TABLE(DecodeFn, "attention_decode", attention_decode_kernel);
#undef NEEDLE_FLOAT_TABLE

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

void add_rmsnorm(const Array& x, const Array& delta, const Array& w, Array& total, Array& out,
                 int64_t dim, double eps) {
  const int64_t rows = rows_of(x, dim, "add_rmsnorm");
  for (const Array* a : std::initializer_list<const Array*>{&delta, &w, &total, &out})
    check_same_dtype(x, *a, "add_rmsnorm");
  check_size(delta, x.size, "add_rmsnorm", "delta");
  check_size(w, dim, "add_rmsnorm", "w");
  check_size(total, x.size, "add_rmsnorm", "total");
  check_size(out, x.size, "add_rmsnorm", "out");
  const AddRmsFn f = kAddRmsnorm[x.dtype];
  without_gil([&] { f(x.data, delta.data, w.data, total.data, out.data, rows, dim, eps); });
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

void swiglu(const Array& x, Array& out, int64_t dim) {
  const int64_t rows = rows_of(out, dim, "swiglu");
  check_same_dtype(x, out, "swiglu");
  check_size(x, rows * 2 * dim, "swiglu", "x");
  const SwigluFn f = kSwiglu[x.dtype];
  if (out.size == 0) return;
  without_gil([&] { f(x.data, out.data, out.size, dim); });
}

void scatter_add(const Array& indices, const Array& values, Array& out, int64_t rows,
                 int64_t dim) {
  if (rows < 0 || dim < 0) raise("ShapeError", "scatter_add: rows and dim must be >= 0");
  check_same_dtype(values, out, "scatter_add");
  check_size(out, rows * dim, "scatter_add", "out");
  check_size(values, indices.size * dim, "scatter_add", "values");
  const ScatterFn f = kScatterAdd[out.dtype];
  const std::vector<int64_t> idx = checked_indices(indices, rows, "scatter_add");
  if (dim == 0) return;
  without_gil([&] { f(idx, values.data, out.data, rows, dim); });
}

void attention(const Array& q, const Array& k, const Array& v, Array& out, int64_t batch,
               int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
               int64_t kv_capacity, int64_t head_dim, double scale, bool causal) {
  const AttentionArgs g{batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                        scale, causal};
  if (batch < 0 || q_len < 0 || head_dim < 0 || q_heads < 0 || kv_heads <= 0 ||
      q_heads % kv_heads || kv_len < 1 || kv_len > kv_capacity || (causal && kv_len < q_len))
    raise("ShapeError", "attention: need kv_heads > 0 dividing q_heads, 1 <= kv_len <= "
                        "kv_capacity, and kv_len >= q_len when causal");
  check_same_dtype(q, k, "attention");
  check_same_dtype(q, v, "attention");
  check_same_dtype(q, out, "attention");
  check_size(q, batch * q_heads * q_len * head_dim, "attention", "q");
  check_size(k, batch * kv_heads * kv_capacity * head_dim, "attention", "k");
  check_size(v, batch * kv_heads * kv_capacity * head_dim, "attention", "v");
  check_size(out, q.size, "attention", "out");
  const AttnFn f = kAttention[q.dtype];
  if (q.size == 0) return;
  without_gil([&] { f(q.data, k.data, v.data, out.data, g); });
}

void attention_decode(const Array& qkv, const Array& cos, const Array& sin,
                      const Array& position, Array& keys, Array& values, Array& out,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t capacity,
                      int64_t table_rows, double scale) {
  const char* fn = "attention_decode";
  if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads || head_dim <= 0 || head_dim % 2 ||
      capacity < 0 || table_rows < 0)
    raise("ShapeError", "attention_decode: need kv_heads > 0 dividing q_heads > 0, an even "
                        "head_dim > 0 and capacity, table_rows >= 0");
  for (const Array* a : std::initializer_list<const Array*>{&cos, &sin, &keys, &values, &out})
    check_same_dtype(qkv, *a, fn);
  check_dtype(position, DType::i32, fn, "position");
  if (position.size < 1) raise("ShapeError", "attention_decode: position is empty");
  check_size(qkv, (q_heads + 2 * kv_heads) * head_dim, fn, "qkv");
  check_size(cos, table_rows * (head_dim / 2), fn, "cos");
  check_size(sin, table_rows * (head_dim / 2), fn, "sin");
  check_size(keys, kv_heads * capacity * head_dim, fn, "keys");
  check_size(values, kv_heads * capacity * head_dim, fn, "values");
  check_size(out, q_heads * head_dim, fn, "out");
  const DecodeFn f = kAttentionDecode[qkv.dtype];
  const DecodeArgs g{q_heads, kv_heads, head_dim, capacity, table_rows, scale};
  const int32_t p = position.as<int32_t>()[0];
  without_gil([&] {
    f(qkv.data, cos.data, sin.data, p, keys.data, values.data, out.data, g);
  });
}

}  // namespace

void bind_nn(nb::module_& m) {
  m.def("take", &take, nb::arg("table"), nb::arg("indices"), nb::arg("out"), nb::arg("rows"),
        nb::arg("dim"), "out[i, :] = table[indices[i], :]");
  m.def("scatter_add", &scatter_add, nb::arg("indices"), nb::arg("values"), nb::arg("out"),
        nb::arg("rows"), nb::arg("dim"), "out[indices[i], :] += values[i, :]");
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
  m.def("swiglu", &swiglu, nb::arg("x"), nb::arg("out"), nb::arg("dim"),
        "out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)");
  m.def("attention_decode", &attention_decode, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("position"), nb::arg("keys"), nb::arg("values"), nb::arg("out"),
        nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("capacity"),
        nb::arg("table_rows"), nb::arg("scale"),
        "one decode step: rope q and k at position[0], store k and v in the caches, attend");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("batch"), nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("q_len"),
        nb::arg("kv_len"), nb::arg("kv_capacity"), nb::arg("head_dim"), nb::arg("scale"),
        nb::arg("causal"));
}

}  // namespace needle
