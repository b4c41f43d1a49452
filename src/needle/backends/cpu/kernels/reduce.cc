// Reductions over the middle axis of a compact (outer, reduce_size, inner) array into
// (outer, inner). inner == 1 reduces rows (contiguous, vectorized along the row); inner > 1
// reduces columns in place (vectorized across the inner axis), so NDArray needs no transpose.
//
// Accumulators: float64 for float64, float32 blocks of 4096 summed into a double for
// float32/float16/bfloat16 (more accurate than numpy's pairwise float32 sum, never less), and
// wrapping integers of the input's width for int32/int64 (int64 for bool), as the reference.
#include <type_traits>

#include "common.h"

namespace needle {
namespace {

// Long rows are split into chunks of this many elements so that one row can use every thread.
constexpr int64_t kChunk = int64_t(1) << 16;
// Work items smaller than this are grouped: a thread should get at least this many elements.
constexpr int64_t kItem = int64_t(1) << 14;

template <class S> using acc_t =
    std::conditional_t<is_float_storage_v<S>, double,
                       std::conditional_t<std::is_same_v<S, int32_t>, uint32_t, uint64_t>>;
// Reductions whose out dtype differs from the input: bool sums to int64.
template <class S> using sum_out_t = std::conditional_t<std::is_same_v<S, b8>, int64_t, S>;

// Sum of x[0..n) (contiguous).
template <class S> acc_t<S> chunk_sum(const S* __restrict x, int64_t n) {
  using C = compute_t<S>;
  if constexpr (is_float_storage_v<S>) {
    constexpr int L = 32;
    double total = 0;
    for (int64_t blk = 0; blk < n; blk += 4096) {
      const int64_t m = std::min<int64_t>(4096, n - blk);
      const S* p = x + blk;
      C lanes[L] = {};
      int64_t j = 0;
      for (; j + L <= m; j += L)
        for (int l = 0; l < L; ++l) lanes[l] += load(p[j + l]);
      for (int w = L / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      C tail = 0;
      for (; j < m; ++j) tail += load(p[j]);
      total += (double)lanes[0] + (double)tail;
    }
    return total;
  } else {
    acc_t<S> total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) total += (acc_t<S>)load(x[j]);
    return total;
  }
}

struct MaxOp {  // NaN sticks: once the accumulator is NaN, x > acc is false
  template <class C> static C apply(C acc, C x) { return (x > acc || x != x) ? x : acc; }
};
struct MinOp {
  template <class C> static C apply(C acc, C x) { return (x < acc || x != x) ? x : acc; }
};

// max/min of x[0..n), n >= 1.
template <class Op, class S> compute_t<S> chunk_extreme(const S* __restrict x, int64_t n) {
  using C = compute_t<S>;
  constexpr int L = 32;
  C lanes[L];
  for (int l = 0; l < L; ++l) lanes[l] = load(x[0]);
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) lanes[l] = Op::apply(lanes[l], load(x[j + l]));
  for (; j < n; ++j) lanes[0] = Op::apply(lanes[0], load(x[j]));
  C r = lanes[0];
  for (int l = 1; l < L; ++l) r = Op::apply(r, lanes[l]);
  return r;
}

// First index in x[0..n) equal to v (or the first NaN when v is NaN), or n.
template <class S> int64_t find_first(const S* x, int64_t n, compute_t<S> v) {
  constexpr int64_t B = 256;
  for (int64_t b = 0; b < n; b += B) {
    const int64_t e = std::min(n, b + B);
    bool hit = false;
    for (int64_t j = b; j < e; ++j) {
      const auto c = load(x[j]);
      hit |= (c == v) | ((c != c) & (v != v));
    }
    if (!hit) continue;
    for (int64_t j = b; j < e; ++j) {
      const auto c = load(x[j]);
      if (c == v || (c != c && v != v)) return j;
    }
  }
  return n;
}

enum class Kind { sum, max, min, argmax };

// Row reductions (inner == 1) of `outer` rows of length R.
template <Kind K, class S, class O>
void reduce_rows(const S* a, O* out, int64_t outer, int64_t R) {
  using C = compute_t<S>;
  const int64_t chunks = R >= 2 * kChunk ? (R + kChunk - 1) / kChunk : 1;
  if (chunks == 1) {  // whole rows per work item, grouped to a useful size
    const int64_t group = std::max<int64_t>(1, kItem / std::max<int64_t>(R, 1));
    const int64_t items = (outer + group - 1) / group;
    parallel_items(items, group * R, [&](int64_t it) {
      const int64_t r1 = std::min(outer, (it + 1) * group);
      for (int64_t r = it * group; r < r1; ++r) {
        const S* x = a + r * R;
        if constexpr (K == Kind::sum) out[r] = store<O>((compute_t<O>)chunk_sum(x, R));
        else if constexpr (K == Kind::max) out[r] = store<O>(chunk_extreme<MaxOp>(x, R));
        else if constexpr (K == Kind::min) out[r] = store<O>(chunk_extreme<MinOp>(x, R));
        else out[r] = find_first(x, R, chunk_extreme<MaxOp>(x, R));
      }
    });
    return;
  }
  // Long rows: every chunk is a work item; partial results are combined in order.
  const int64_t len = (R + chunks - 1) / chunks;
  auto chunk_of = [&](int64_t it, int64_t* begin) {
    *begin = it % chunks * len;
    return std::min(len, R - *begin);
  };
  if constexpr (K == Kind::sum) {
    std::vector<acc_t<S>> part(outer * chunks);
    parallel_items(outer * chunks, len, [&](int64_t it) {
      int64_t b;
      const int64_t n = chunk_of(it, &b);
      part[it] = chunk_sum(a + it / chunks * R + b, n);
    });
    for (int64_t r = 0; r < outer; ++r) {
      acc_t<S> t = 0;
      for (int64_t c = 0; c < chunks; ++c) t += part[r * chunks + c];
      out[r] = store<O>((compute_t<O>)t);
    }
  } else {
    std::vector<C> part(outer * chunks);
    parallel_items(outer * chunks, len, [&](int64_t it) {
      int64_t b;
      const int64_t n = chunk_of(it, &b);
      const S* x = a + it / chunks * R + b;
      part[it] = K == Kind::min ? chunk_extreme<MinOp>(x, n) : chunk_extreme<MaxOp>(x, n);
    });
    std::vector<C> best(outer);
    for (int64_t r = 0; r < outer; ++r) {
      C v = part[r * chunks];
      for (int64_t c = 1; c < chunks; ++c)
        v = K == Kind::min ? MinOp::apply(v, part[r * chunks + c])
                           : MaxOp::apply(v, part[r * chunks + c]);
      best[r] = v;
      if constexpr (K != Kind::argmax) out[r] = store<O>(v);
    }
    if constexpr (K == Kind::argmax) {
      std::vector<int64_t> first(outer * chunks);
      parallel_items(outer * chunks, len, [&](int64_t it) {
        int64_t b;
        const int64_t n = chunk_of(it, &b);
        const int64_t j = find_first(a + it / chunks * R + b, n, best[it / chunks]);
        first[it] = j < n ? b + j : R;
      });
      for (int64_t r = 0; r < outer; ++r) {
        int64_t j = R;
        for (int64_t c = 0; c < chunks && j == R; ++c) j = first[r * chunks + c];
        out[r] = j;
      }
    }
  }
}

// Column reductions (inner > 1): each work item reduces a block of up to W columns of one
// outer slice, keeping W accumulators in L1 while it streams down the rows.
template <Kind K, class S, class O>
void reduce_cols(const S* a, O* out, int64_t outer, int64_t R, int64_t inner) {
  using C = compute_t<S>;
  using A = std::conditional_t<K == Kind::sum, std::conditional_t<is_float_storage_v<S>, C, acc_t<S>>, C>;
  constexpr int64_t W = 1024;
  const int64_t threads = max_threads();
  int64_t width = std::min<int64_t>(W, inner);
  if (outer < threads) width = std::min(width, std::max<int64_t>(64, (inner + threads - 1) / threads));
  const int64_t blocks = (inner + width - 1) / width;
  parallel_items(outer * blocks, R * width, [&](int64_t it) {
    const int64_t o = it / blocks, c0 = it % blocks * width, n = std::min(width, inner - c0);
    const S* x = a + o * R * inner + c0;
    A acc[W];
    int64_t idx[K == Kind::argmax ? W : 1];
    for (int64_t j = 0; j < n; ++j) acc[j] = K == Kind::sum ? A(0) : (A)load(x[j]);
    if constexpr (K == Kind::argmax)
      for (int64_t j = 0; j < n; ++j) idx[j] = 0;
    for (int64_t r = (K == Kind::sum ? 0 : 1); r < R; ++r) {
      const S* row = x + r * inner;
      if constexpr (K == Kind::sum) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] += (A)load(row[j]);
      } else if constexpr (K == Kind::max) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] = MaxOp::apply(acc[j], load(row[j]));
      } else if constexpr (K == Kind::min) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] = MinOp::apply(acc[j], load(row[j]));
      } else {  // the first NaN or the first strict maximum wins
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const C v = load(row[j]);
          const bool take = v > acc[j] || (v != v && acc[j] == acc[j]);
          acc[j] = take ? v : acc[j];
          idx[j] = take ? r : idx[j];
        }
      }
    }
    O* dst = out + o * inner + c0;
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (K == Kind::argmax) dst[j] = idx[j];
      else dst[j] = store<O>((compute_t<O>)acc[j]);
    }
  });
}

template <Kind K, class S, class O>
void reduce_kernel(const void* a, void* out, int64_t outer, int64_t R, int64_t inner) {
  if (inner == 1) reduce_rows<K>((const S*)a, (O*)out, outer, R);
  else reduce_cols<K>((const S*)a, (O*)out, outer, R, inner);
}

using ReduceFn = void (*)(const void*, void*, int64_t, int64_t, int64_t);

template <Kind K> KernelTable<ReduceFn> reduce_table(const char* name) {
  return KernelTable<ReduceFn>(name, [](auto tag) -> ReduceFn {
    using S = typename decltype(tag)::type;
    if constexpr (K == Kind::sum) return &reduce_kernel<K, S, sum_out_t<S>>;
    else if constexpr (K == Kind::argmax) return &reduce_kernel<K, S, int64_t>;
    else return &reduce_kernel<K, S, S>;
  });
}

template <Kind K> void def_reduce(nb::module_& m, const char* name) {
  static const KernelTable<ReduceFn> table = reduce_table<K>(name);
  m.def(name, [name](const Array& a, Array& out, int64_t outer, int64_t reduce_size,
                     int64_t inner) {
    if (outer < 0 || reduce_size < 0 || inner < 1)
      raise("ShapeError", std::string(name) + ": bad sizes outer=" + std::to_string(outer) +
                              " reduce_size=" + std::to_string(reduce_size) +
                              " inner=" + std::to_string(inner));
    check_size(a, outer * reduce_size * inner, name, "a");
    check_size(out, outer * inner, name, "out");
    const DType want = K == Kind::argmax                        ? DType::i64
                       : K == Kind::sum && a.dtype == DType::b8 ? DType::i64
                                                                : a.dtype;
    check_dtype(out, want, name, "out");
    const ReduceFn fn = table[a.dtype];
    if (out.size == 0) return;
    if (reduce_size == 0) {
      if (K != Kind::sum)
        raise("ShapeError", std::string(name) + " of an empty axis has no identity");
      std::memset(out.data, 0, out.size * dtype_size(out.dtype));
      return;
    }
    without_gil([&] { fn(a.data, out.data, outer, reduce_size, inner); });
  }, nb::arg("a"), nb::arg("out"), nb::arg("outer"), nb::arg("reduce_size"),
     nb::arg("inner") = 1);
}

}  // namespace

void bind_reduce(nb::module_& m) {
  def_reduce<Kind::sum>(m, "reduce_sum");
  def_reduce<Kind::max>(m, "reduce_max");
  def_reduce<Kind::min>(m, "reduce_min");
  def_reduce<Kind::argmax>(m, "reduce_argmax");
}

}  // namespace needle
