// Indexing kernels: take (an embedding lookup) and scatter_add (its gradient), indices
// checked and negative ones wrapped as numpy's.
#include <type_traits>
#include <vector>

#include "common.h"

namespace needle {
namespace {

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

}  // namespace

void bind_indexing(nb::module_& m) {
  m.def("take", &take, nb::arg("table"), nb::arg("indices"), nb::arg("out"), nb::arg("rows"),
        nb::arg("dim"), "out[i, :] = table[indices[i], :]");
  m.def("scatter_add", &scatter_add, nb::arg("indices"), nb::arg("values"), nb::arg("out"),
        nb::arg("rows"), nb::arg("dim"), "out[indices[i], :] += values[i, :]");
}

}  // namespace needle
