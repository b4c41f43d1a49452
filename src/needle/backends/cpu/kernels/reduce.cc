// Reductions over the middle axis of a compact (outer, reduce_size, inner) array into
// (outer, inner). inner == 1 reduces rows (contiguous, vectorized along the row); inner > 1
// reduces columns in place (vectorized across the inner axis), so NDArray needs no transpose.
//
// Accumulators: float64 for float64, float32 blocks of 4096 summed into a double for
// float32/float16/bfloat16 (more accurate than numpy's pairwise float32 sum, never less), and
// wrapping integers of the input's width for int32/int64 (int64 for bool), as the reference.
#include <type_traits>
#include <utility>

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
// bool and 8-bit integers sum in int64 so that they count rather than wrap (docs/dtypes.md)
template <class S> using sum_out_t = std::conditional_t<sizeof(S) == 1, int64_t, S>;

// Sum of x[0..n) (contiguous). Floats: vectorized float partial sums over blocks of 4096,
// blocks added in double.
template <class S> acc_t<S> chunk_sum(const S* __restrict x, int64_t n) {
  using C = compute_t<S>;
  if constexpr (is_float_storage_v<S>) {
    double total = 0;
    for (int64_t blk = 0; blk < n; blk += 4096) {
      const int64_t e = std::min<int64_t>(n, blk + 4096);
      C s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = blk; j < e; ++j) s += load(x[j]);
      total += (double)s;
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

// max (or min) of x[0..n), n >= 1; NaN if any element is NaN, as numpy.
template <class Op, class S> compute_t<S> chunk_extreme(const S* __restrict x, int64_t n) {
  using C = compute_t<S>;
  constexpr bool is_max = std::is_same_v<Op, MaxOp>;
  C m = load(x[0]);
  int nan = 0;
  if constexpr (is_max) {
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < n; ++j) {
      const C v = load(x[j]);
      m = v > m ? v : m;
      nan |= v != v;
    }
  } else {
#pragma omp simd reduction(min : m) reduction(| : nan)
    for (int64_t j = 0; j < n; ++j) {
      const C v = load(x[j]);
      m = v < m ? v : m;
      nan |= v != v;
    }
  }
  if constexpr (std::is_floating_point_v<C>)
    if (nan) return std::numeric_limits<C>::quiet_NaN();
  return m;
}

// First index in x[0..n) holding v (the first NaN when v is NaN), or n. Blocks are tested
// with a vectorized count before they are scanned.
template <class S> int64_t find_first(const S* __restrict x, int64_t n, compute_t<S> v) {
  constexpr int64_t B = 64;
  const bool nan = v != v;
  for (int64_t b = 0; b < n; b += B) {
    const int64_t e = std::min(n, b + B);
    int hits = 0;
    if (nan) {
#pragma omp simd reduction(+ : hits)
      for (int64_t j = b; j < e; ++j) { const auto c = load(x[j]); hits += c != c; }
    } else {
#pragma omp simd reduction(+ : hits)
      for (int64_t j = b; j < e; ++j) hits += load(x[j]) == v;
    }
    if (!hits) continue;
    for (int64_t j = b; j < e; ++j) {
      const auto c = load(x[j]);
      if (nan ? c != c : c == v) return j;
    }
  }
  return n;
}

// The first maximum of x[0..n) (the first NaN counts as the maximum): (value, index).
template <class S> std::pair<compute_t<S>, int64_t> chunk_argmax(const S* x, int64_t n) {
  const compute_t<S> m = chunk_extreme<MaxOp>(x, n);
  return {m, find_first(x, n, m)};
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
        else out[r] = chunk_argmax(x, R).second;
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
  } else if constexpr (K == Kind::argmax) {
    std::vector<std::pair<C, int64_t>> part(outer * chunks);
    parallel_items(outer * chunks, len, [&](int64_t it) {
      int64_t b;
      const int64_t n = chunk_of(it, &b);
      part[it] = chunk_argmax(a + it / chunks * R + b, n);
      part[it].second += b;
    });
    for (int64_t r = 0; r < outer; ++r) {  // chunks in order: a later one must be strictly better
      auto [bv, bi] = part[r * chunks];
      for (int64_t c = 1; c < chunks; ++c) {
        const auto [v, i] = part[r * chunks + c];
        if (v > bv || (v != v && bv == bv)) {
          bv = v;
          bi = i;
        }
      }
      out[r] = bi;
    }
  } else {
    std::vector<C> part(outer * chunks);
    parallel_items(outer * chunks, len, [&](int64_t it) {
      int64_t b;
      const int64_t n = chunk_of(it, &b);
      const S* x = a + it / chunks * R + b;
      part[it] = K == Kind::min ? chunk_extreme<MinOp>(x, n) : chunk_extreme<MaxOp>(x, n);
    });
    for (int64_t r = 0; r < outer; ++r) {
      C v = part[r * chunks];
      for (int64_t c = 1; c < chunks; ++c)
        v = K == Kind::min ? MinOp::apply(v, part[r * chunks + c])
                           : MaxOp::apply(v, part[r * chunks + c]);
      out[r] = store<O>(v);
    }
  }
}

// Column reductions (inner > 1). A work item reduces a band of rows [r0, r1) of a block of
// up to W columns of one outer slice into W accumulators (in L1), streaming whole rows as
// numpy does. When there are too few (outer, column block) pairs to keep every thread busy,
// the rows are split into bands whose partial results are then merged in row order.
template <Kind K, class S, class O>
void reduce_cols(const S* a, O* out, int64_t outer, int64_t R, int64_t inner) {
  using C = compute_t<S>;
  using A = std::conditional_t<K == Kind::sum,
                               std::conditional_t<is_float_storage_v<S>, C, acc_t<S>>, C>;
  constexpr int64_t W = 4096;
  constexpr bool arg = K == Kind::argmax;
  const int64_t width = std::min<int64_t>(W, inner);
  const int64_t blocks = (inner + width - 1) / width;
  const int64_t want = 4 * max_threads();
  const int64_t bands = outer * blocks >= want ? 1
                        : std::max<int64_t>(1, std::min((want + outer * blocks - 1) / (outer * blocks),
                                                        R / 16));
  const int64_t band = (R + bands - 1) / bands;
  const int64_t items = outer * blocks * bands;
  std::vector<A> acc_all((size_t)items * width);
  std::vector<int64_t> idx_all(arg ? (size_t)items * width : 0);
  parallel_items(items, band * width, [&](int64_t it) {
    const int64_t ob = it / bands, o = ob / blocks, c0 = ob % blocks * width;
    const int64_t n = std::min(width, inner - c0);
    const int64_t r0 = it % bands * band, r1 = std::min(R, r0 + band);
    A* acc = acc_all.data() + it * width;
    int64_t* idx = arg ? idx_all.data() + it * width : nullptr;
    if (r0 >= r1) {  // an empty band (R not divisible): contributes nothing
      if constexpr (arg)
        for (int64_t j = 0; j < n; ++j) idx[j] = -1;
      return;
    }
    const S* x = a + (o * R + r0) * inner + c0;
    for (int64_t j = 0; j < n; ++j) acc[j] = K == Kind::sum ? A(0) : (A)load(x[j]);
    if constexpr (arg)
      for (int64_t j = 0; j < n; ++j) idx[j] = r0;
    for (int64_t r = (K == Kind::sum ? 0 : 1); r < r1 - r0; ++r) {
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
          idx[j] = take ? r0 + r : idx[j];
        }
      }
    }
  });
  // Merge the bands of each (outer, column block) in row order and store.
  for (int64_t ob = 0; ob < outer * blocks; ++ob) {
    const int64_t o = ob / blocks, c0 = ob % blocks * width, n = std::min(width, inner - c0);
    A* acc = acc_all.data() + ob * bands * width;
    int64_t* idx = arg ? idx_all.data() + ob * bands * width : nullptr;
    for (int64_t bnd = 1; bnd < bands; ++bnd) {
      const A* part = acc + bnd * width;
      if (bnd * band >= R) break;
      for (int64_t j = 0; j < n; ++j) {
        if constexpr (K == Kind::sum) {
          acc[j] += part[j];
        } else if constexpr (K == Kind::max) {
          acc[j] = MaxOp::apply(acc[j], part[j]);
        } else if constexpr (K == Kind::min) {
          acc[j] = MinOp::apply(acc[j], part[j]);
        } else {
          const A v = part[j];
          if (v > acc[j] || (v != v && acc[j] == acc[j])) {
            acc[j] = v;
            idx[j] = idx[bnd * width + j];
          }
        }
      }
    }
    O* dst = out + o * inner + c0;
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (arg) dst[j] = idx[j];
      else dst[j] = store<O>((compute_t<O>)acc[j]);
    }
  }
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
                       : K == Kind::sum && dtype_size(a.dtype) == 1 ? DType::i64
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
