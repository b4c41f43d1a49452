// Weight-only quantized matrices (capabilities int8/int4; numpy_ref/quant.py defines them,
// docs/quantization.md the packing): qweight int32 words of int8 or int4 values, float32
// scales (and offsets) per row and group of k.
//
// quant_matmul: rows of W are spread over threads; each row is dequantized once into a
// float buffer in the cache and dotted with every row of x (converted to float32 once), so
// the packed matrix is read exactly once whatever m is.
#include "common.h"
#include "matmul.h"

namespace needle {
namespace {

struct QuantMatrix {
  const uint32_t* q;
  const float* scales;
  const float* offsets;  // nullptr: symmetric
  int64_t n, k, words, groups, group;
  int bits;
};

// Row r of W into w[0..k) as float32 (the rule of numpy_ref.quant: see the header).
void dequant_row(const QuantMatrix& m, int64_t r, float* w) {
  const uint32_t* q = m.q + r * m.words;
  const float* s = m.scales + r * m.groups;
  const float* b = m.offsets ? m.offsets + r * m.groups : nullptr;
  if (m.bits == 8) {
    const int8_t* v = reinterpret_cast<const int8_t*>(q);  // little-endian words: byte j = k j
    for (int64_t j = 0; j < m.k; ++j) w[j] = (float)v[j];
  } else {
    for (int64_t j = 0; j < m.k; ++j) w[j] = (float)((q[j >> 3] >> ((j & 7) * 4)) & 15u);
    if (!b)
      for (int64_t j = 0; j < m.k; ++j) w[j] -= 8.0f;
  }
  for (int64_t g = 0; g < m.groups; ++g) {
    const int64_t lo = g * m.group, hi = std::min(m.k, lo + m.group);
    const float sg = s[g], bg = b ? b[g] : 0.0f;
    if (b) {
      for (int64_t j = lo; j < hi; ++j) w[j] = w[j] * sg + bg;
    } else {
      for (int64_t j = lo; j < hi; ++j) w[j] *= sg;
    }
  }
}

inline float dot(const float* a, const float* b, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: the loop vectorizes
  int64_t j = 0;
  for (; j + 8 <= k; j += 8)
    for (int e = 0; e < 8; ++e) acc[e] += a[j + e] * b[j + e];
  float s = 0.0f;
  for (; j < k; ++j) s += a[j] * b[j];
  for (int e = 0; e < 8; ++e) s += acc[e];
  return s;
}

template <class S> void to_f32(const void* src, float* dst, int64_t n) {
  const S* s = static_cast<const S*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = (float)load(s[i]);
}

template <class S> void from_f32(const float* src, void* dst, int64_t n) {
  S* d = static_cast<S*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = store<S>(src[i]);
}

template <class F> decltype(auto) float_dispatch(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::f32: return f(Tag<float>{});
    case DType::f16: return f(Tag<f16>{});
    case DType::bf16: return f(Tag<bf16>{});
    default: unsupported(op, dt);
  }
}

QuantMatrix check_matrix(const Array& qweight, const Array& scales, const Array* offsets,
                         int64_t n, int64_t k, int64_t bits, int64_t group, const char* fn) {
  if (bits != 8 && bits != 4) raise("ShapeError", std::string(fn) + ": bits must be 8 or 4");
  if (n < 0 || k < 0 || group < 1) raise("ShapeError", std::string(fn) + ": bad n, k or group");
  const int64_t per = 32 / bits, words = (k + per - 1) / per, groups = (k + group - 1) / group;
  check_dtype(qweight, DType::i32, fn, "qweight");
  check_dtype(scales, DType::f32, fn, "scales");
  check_size(qweight, n * words, fn, "qweight");
  check_size(scales, n * groups, fn, "scales");
  if (offsets) {
    check_dtype(*offsets, DType::f32, fn, "offsets");
    check_size(*offsets, n * groups, fn, "offsets");
  }
  return QuantMatrix{qweight.as<uint32_t>(), scales.as<float>(),
                     offsets ? offsets->as<float>() : nullptr, n, k, words, groups, group,
                     (int)bits};
}

void quant_matmul(const Array& x, const Array& qweight, const Array& scales,
                  const Array* offsets, Array& out, int64_t m, int64_t n, int64_t k,
                  int64_t bits, int64_t group_size) {
  const QuantMatrix w = check_matrix(qweight, scales, offsets, n, k, bits, group_size,
                                     "quant_matmul");
  check_same_dtype(x, out, "quant_matmul");
  check_size(x, m * k, "quant_matmul", "x");
  check_size(out, m * n, "quant_matmul", "out");
  auto convert_in = float_dispatch(x.dtype, "quant_matmul", [](auto tag) {
    return &to_f32<typename decltype(tag)::type>;
  });
  auto convert_out = float_dispatch(x.dtype, "quant_matmul", [](auto tag) {
    return &from_f32<typename decltype(tag)::type>;
  });
  without_gil([&] {
    Scratch<float> xs(m * k), ys(m * n);
    convert_in(x.data, xs.p, m * k);
    constexpr int64_t kRows = 16;  // rows per work item: enough work to amortize the wake-up
    const int64_t items = (n + kRows - 1) / kRows;
    if (m <= 8) {  // decoding: a dot product per row of x
      parallel_items(items, kRows * k * (m + 1), [&](int64_t it) {
        std::vector<float> row(k);
        for (int64_t r = it * kRows; r < std::min(n, (it + 1) * kRows); ++r) {
          dequant_row(w, r, row.data());
          for (int64_t i = 0; i < m; ++i) ys.p[i * n + r] = dot(xs.p + i * k, row.data(), k);
        }
      });
    } else {  // prefill: a block of rows dequantized, then the blocked GEMM core on it
      parallel_items(items, kRows * k * (m + 1), [&](int64_t it) {
        const int64_t r0 = it * kRows, rows = std::min(n, r0 + kRows) - r0;
        std::vector<float> block(rows * k);  // W rows r0.. as (rows, k)
        for (int64_t r = 0; r < rows; ++r) dequant_row(w, r0 + r, block.data() + r * k);
        // ys[:, r0:r0+rows] = xs (m, k) @ block^T: B(kk, j) = block[j * k + kk]
        gemm_serial<float>(m, k, rows, xs.p, k, 1, block.data(), 1, k, ys.p + r0, n);
      });
    }
    convert_out(ys.p, out.data, m * n);
  });
}

void dequantize(const Array& qweight, const Array& scales, const Array* offsets, Array& out,
                int64_t n, int64_t k, int64_t bits, int64_t group_size) {
  const QuantMatrix w = check_matrix(qweight, scales, offsets, n, k, bits, group_size,
                                     "dequantize");
  check_size(out, n * k, "dequantize", "out");
  auto convert_out = float_dispatch(out.dtype, "dequantize", [](auto tag) {
    return &from_f32<typename decltype(tag)::type>;
  });
  const size_t item = dtype_size(out.dtype);
  char* dst = static_cast<char*>(out.data);
  without_gil([&] {
    parallel_items(n, k, [&](int64_t r) {
      std::vector<float> row(k);
      dequant_row(w, r, row.data());
      convert_out(row.data(), dst + r * k * item, k);
    });
  });
}

}  // namespace

void bind_quant(nb::module_& m) {
  m.def("quant_matmul", &quant_matmul, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"),
        nb::arg("offsets").none(), nb::arg("out"), nb::arg("m"), nb::arg("n"), nb::arg("k"),
        nb::arg("bits"), nb::arg("group_size"),
        "out (m, n) = x (m, k) @ W.T for a packed int8/int4 W (numpy_ref.quant_matmul)");
  m.def("dequantize", &dequantize, nb::arg("qweight"), nb::arg("scales"),
        nb::arg("offsets").none(), nb::arg("out"), nb::arg("n"), nb::arg("k"), nb::arg("bits"),
        nb::arg("group_size"), "out (n, k) = the packed int8/int4 matrix W, in out's dtype");
  register_kernel("quant_matmul_f32");
  register_kernel("quant_matmul_f16");
  register_kernel("quant_matmul_bf16");
}

}  // namespace needle
