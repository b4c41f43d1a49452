// Weight-only quantized matrices (capabilities int8/int4; numpy_ref/quant.py defines them,
// docs/quantization.md the packing): qweight int32 words of int8 or int4 values, float32
// scales (and offsets) per row and group of k.
//
// quant_matmul: rows of W are spread over threads, so the packed matrix is read exactly once
// whatever m is. Decoding (m <= 8): each group's products are summed straight from the
// packed values, four rows at a time (x . q in eight partial sums: an int4 word's eight
// values or eight int8 values fill one vector) and scaled once per group (s * (x . q) +
// b * sum(x)); prefill: a block of rows is dequantized into float32 and multiplied by the
// blocked GEMM core.
#include <cstring>

#include "common.h"
#include "matmul.h"
#include "quant.h"
#include "quant_intx.h"

namespace needle {
namespace {

// Row r of W into w[0..k) as float32 (the rule of numpy_ref.quant: (u - 8) * s for
// symmetric int4, u * s + b with offsets, v * s for int8), eight values at a time.
void dequant_row(const QuantMatrix& m, int64_t r, float* w) {
  const uint32_t* q = m.q + r * m.words;
  const int8_t* v = reinterpret_cast<const int8_t*>(q);  // little-endian words: byte j = k j
  const float* s = m.scales + r * m.groups;
  const float* b = m.offsets ? m.offsets + r * m.groups : nullptr;
  const float bias = (m.bits == 4 && !b) ? 8.0f : 0.0f;
  for (int64_t g = 0; g < m.groups; ++g) {
    const int64_t lo = g * m.group, hi = std::min(m.k, lo + m.group);
    const float sg = s[g], bg = b ? b[g] : 0.0f;
    int64_t j = lo;
    if (m.bits == 8 || lo % 8 == 0)
      for (; j + 8 <= hi; j += 8) {
        const f32x8 u = m.bits == 8 ? int8x8_to_f32(v + j) : int4x8_to_f32(q[j >> 3]);
        const f32x8 x = b ? u * sg + bg : (u - bias) * sg;
        std::memcpy(w + j, &x, sizeof x);
      }
    for (; j < hi; ++j) {
      const float u = m.bits == 8 ? stored<8>(q, j) : stored<4>(q, j);
      w[j] = b ? u * sg + bg : (u - bias) * sg;
    }
  }
}

// 64 int4 values (8 words) of a row against xt, the matching 64 values of x transposed
// (xt[8p + e] = x[8e + p]: nibble p of word e), into two accumulators: a word's nibble p
// of all eight words is one shift and mask of the eight words at once (four instructions
// for eight values instead of five with a broadcast word and eight shift amounts): 4-11% less
// time on the 2-vCPU AVX2 development machine's 1.1B matrices (docs/quantization.md).
// Processing the four rows a step inside it (x loaded once) spilled AVX2's 16 registers
// and lost 15-20%.
inline void int4x64_dot(const uint32_t* q, const float* xt, f32x8& even, f32x8& odd) {
  u32x8 w;
  std::memcpy(&w, q, sizeof w);
#pragma GCC unroll 8
  for (int p = 0; p < 8; p += 2) {
    even += load_f32x8(xt + 8 * p) * __builtin_convertvector(w >> (4 * p) & 15u, f32x8);
    odd += load_f32x8(xt + 8 * p + 8) *
           __builtin_convertvector(w >> (4 * p + 4) & 15u, f32x8);
  }
}

// y[t] = x . W[r0 + t] for R rows: per group g, s_g * (x . u)_g + b_g * xsum_g, with u the
// stored values and b_g the offset (symmetric int4: -8 s_g, as it stores q + 8). x is
// loaded once for the R rows; each group's vector partial sums are scaled into vector
// totals, summed across lanes once at the end. Groups of int4 start on a word (group_size
// % 8 == 0, checked by the caller); with xt (x transposed by 64-value blocks, given where
// the groups are multiples of 64) int4 takes 64 values at a time (int4x64_dot), and with xb
// (16-bit x as integers, AVX2; those groups or 32) by integer products (int4x64_sums,
// rows_dot_g32; rows_int4_vnni and, for int8, rows_int8_vnni where the CPU has AVX-512
// VNNI: quant_intx.h).
template <int R, int BITS>
void rows_dot(const QuantMatrix& w, int64_t r0, const float* x, const float* xt,
              const XBlocks* xb, const float* xsum, float* y) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (BITS == 4)
    if (xb != nullptr && vnni_group(w.group)) return rows_int4_vnni<R>(w, r0, x, *xb, xsum, y);
  if constexpr (BITS == 8)
    if (xb != nullptr) return rows_int8_vnni<R>(w, r0, x, *xb, xsum, y);
#endif
#if defined(__AVX2__)
  if constexpr (BITS == 4)
    if (xb != nullptr && w.group == 32) return rows_dot_g32<R>(w, r0, x, *xb, xsum, y);
#endif
  const float bias = (BITS == 4 && !w.offsets) ? 8.0f : 0.0f;  // symmetric int4 stores q + 8
  const RowsOf<R> rows(w, r0);
  const auto& q = rows.q;
  f32x8 tot[R] = {};
  float tail[R] = {};
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t lo = g * w.group, hi = std::min(w.k, lo + w.group);
    f32x8 acc[R] = {};
    float rest[R] = {};
    int64_t j = lo;
#if defined(__AVX2__)
    if (BITS == 4 && xb != nullptr)
      for (; j + 64 <= hi; j += 64)
        for (int t = 0; t < R; ++t) {  // each chunk's 2^-k times its sum of u * q
          if (j % 128 == 0) prefetch_ahead<R>(q[t], w.words, j / 2);
          acc[t] += int4x64_sums(q[t] + (j >> 3), xb->planes.data() + 2 * j) *
                    halves(xb->scale[j / 32], xb->scale[j / 32 + 1]);
        }
#endif
    if (BITS == 4 && xt != nullptr) {
      f32x8 odd[R] = {};
      for (; j + 64 <= hi; j += 64)
        for (int t = 0; t < R; ++t) {
          if (j % 128 == 0) prefetch_ahead<R>(q[t], w.words, j / 2);
          int4x64_dot(q[t] + (j >> 3), xt + j, acc[t], odd[t]);
        }
      for (int t = 0; t < R; ++t) acc[t] += odd[t];
    }
    for (; j + 8 <= hi; j += 8) {
      const f32x8 xv = load_f32x8(x + j);
      const bool line = (j * BITS / 8) % 64 == 0;  // a new line of each row
      for (int t = 0; t < R; ++t) {
        if (line) prefetch_ahead<R>(q[t], w.words, j * BITS / 8);
        const f32x8 u = BITS == 8 ? int8x8_to_f32(reinterpret_cast<const int8_t*>(q[t]) + j)
                                  : int4x8_to_f32(q[t][j >> 3]);
        acc[t] += xv * u;  // the bias comes back below, as -bias * sum(x)
      }
    }
    for (; j < hi; ++j)  // a ragged last group
      for (int t = 0; t < R; ++t) rest[t] += x[j] * stored<BITS>(q[t], j);
    for (int t = 0; t < R; ++t) {
      const float sg = rows.s[t][g];
      const float bg = rows.b[t] ? rows.b[t][g] : -bias * sg;
      tot[t] += sg * acc[t];
      tail[t] += sg * rest[t] + bg * xsum[g];
    }
  }
  row_totals<R>(tot, tail, y);
}

// rows [r0, r1) of ys (m, n) for the m rows of xs (m, k); xsum (m, groups): each row of x
// summed over each group (what the offsets multiply); xts (m, k): each row transposed by
// 64-value blocks (transpose64), or nullptr; xbs (m): each row as integers, or nullptr
template <int BITS>
void matvec_rows(const QuantMatrix& w, int64_t r0, int64_t r1, const float* xs,
                 const float* xts, const XBlocks* xbs, const float* xsum, int64_t m,
                 float* ys) {
  constexpr int R = 4;  // independent accumulators: one FMA chain per row
  float y[R];
  for (int64_t i = 0; i < m; ++i) {
    const float* x = xs + i * w.k;
    const float* xt = xts ? xts + i * w.k : nullptr;
    const XBlocks* xb = xbs ? xbs + i : nullptr;
    const float* xg = xsum + i * w.groups;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      rows_dot<R, BITS>(w, r, x, xt, xb, xg, y);
      for (int t = 0; t < R; ++t) ys[i * w.n + r + t] = y[t];
    }
    for (; r < r1; ++r) {
      rows_dot<1, BITS>(w, r, x, xt, xb, xg, y);
      ys[i * w.n + r] = y[0];
    }
  }
}

// x (k) into xt with each whole 64-value block transposed as 8 x 8 (xt[8p + e] = x[8e + p]
// within a block), what int4x64_dot reads; the last partial block is not read from xt.
void transpose64(const float* x, float* xt, int64_t k) {
  for (int64_t b = 0; b + 64 <= k; b += 64)
    for (int p = 0; p < 8; ++p)
      for (int e = 0; e < 8; ++e) xt[b + 8 * p + e] = x[b + 8 * e + p];
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
    // rows per work item: enough work to amortize the wake-up; decoding, runs of up to 128
    // rows (a thread streams 128 KiB of a 2048-wide int4 matrix before it moves) while every
    // thread still gets four items: 16-row items took 20-30% longer (1.1B matvecs, 2 vCPUs)
    const int64_t kRows = std::clamp<int64_t>(n / (4 * max_threads()) / 4 * 4, 16, 128);
    const int64_t items = (n + kRows - 1) / kRows;
    if (m <= 8 && (w.bits == 8 || w.group % 8 == 0)) {  // decoding: see the header
      std::vector<float> xsum(m * w.groups, 0.0f);
      for (int64_t i = 0; i < m; ++i)  // group by group (a division a value cost ~5 us a call)
        for (int64_t g = 0; g < w.groups; ++g) {
          const float* v = xs.p + i * k + g * w.group;
          const int64_t end = std::min(w.group, k - g * w.group);
          float sum = 0.0f;  // in vector lanes: one dependent add a value cost ~1 us at k 2048
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < end; ++j) sum += v[j];
          xsum[i * w.groups + g] = sum;
        }
      // int4 with groups of whole 64-value blocks or of 32: 16-bit x as integers (AVX2),
      // else (whole blocks) x transposed by blocks (see int4x64_sums, int4x64_dot)
      std::vector<float> xts;
      std::vector<XBlocks> xbs;
      if (w.bits == 4 && (w.group % 64 == 0 || w.group == 32)) {
#if defined(__AVX2__)
        if (x.dtype != DType::f32)
          for (int64_t i = 0; i < m; ++i) xbs.push_back(int_blocks(xs.p + i * k, k));
#endif
        if (xbs.empty() && w.group % 64 == 0) {
          xts.resize(m * k);
          for (int64_t i = 0; i < m; ++i) transpose64(xs.p + i * k, xts.data() + i * k, k);
        }
      }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      // int8 with bf16 / f16 x: 16-bit x as integers in its own order (rows_int8_vnni)
      if (w.bits == 8 && x.dtype != DType::f32 && vnni_int8_group(w))
        for (int64_t i = 0; i < m; ++i) xbs.push_back(int_chunks(xs.p + i * k, k));
#endif
      const float* xt = xts.empty() ? nullptr : xts.data();
      const XBlocks* xb = xbs.empty() ? nullptr : xbs.data();
      parallel_items(items, kRows * k * (m + 1), [&](int64_t it) {
        const int64_t r0 = it * kRows, r1 = std::min(n, r0 + kRows);
        if (w.bits == 8)
          matvec_rows<8>(w, r0, r1, xs.p, nullptr, xb, xsum.data(), m, ys.p);
        else
          matvec_rows<4>(w, r0, r1, xs.p, xt, xb, xsum.data(), m, ys.p);
      });
    } else {  // prefill (or odd int4 groups): rows dequantized, the blocked GEMM core
      // blocks of 128 rows (1 MiB of float32 at k = 2048): the GEMM core needs wide panels
      constexpr int64_t kBlock = 128;
      parallel_items((n + kBlock - 1) / kBlock, kBlock * k * (m + 1), [&](int64_t it) {
        const int64_t r0 = it * kBlock, rows = std::min(n, r0 + kBlock) - r0;
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
