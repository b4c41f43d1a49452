// Elementwise kernels: binary ops (array-array and array-scalar), comparisons, unary ops,
// casts between every pair of dtypes, and where. One template per shape of loop, instantiated
// per (op, dtype) into KernelTables under the names ewise_add_f32, scalar_lt_bf16, ...
#include <type_traits>

#include "common.h"
#include "vmath.h"

namespace needle {
namespace {

// Cheap ops are memory-bound: threads pay off only on large arrays. Transcendentals earlier.
constexpr int64_t kGrainCheap = int64_t(1) << 16;
constexpr int64_t kGrainMath = int64_t(1) << 13;

// --- binary ops ---------------------------------------------------------------------------------
// apply(C, C) works on the compute type C; integers wrap around like numpy's (no UB).

template <class C> using uint_t = std::make_unsigned_t<C>;

struct Add {
  template <class C> static C apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) return (C)((uint_t<C>)a + (uint_t<C>)b);
    else return a + b;
  }
};
struct Sub {
  template <class C> static C apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) return (C)((uint_t<C>)a - (uint_t<C>)b);
    else return a - b;
  }
};
struct Mul {
  template <class C> static C apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) return (C)((uint_t<C>)a * (uint_t<C>)b);
    else return a * b;
  }
};
struct Div {  // integers: truncate toward zero, x / 0 = 0 (as the reference)
  template <class C> static C apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) {
      if (b == 0) return 0;
      if (b == -1) return (C)(uint_t<C>(0) - (uint_t<C>)a);  // INT_MIN / -1 wraps
      return a / b;
    } else {
      return a / b;
    }
  }
};
struct Power {  // integers: negative exponents count as 0, as the reference
  template <class C> static C apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) {
      uint_t<C> result = 1, base = (uint_t<C>)a;
      for (C e = b; e > 0; e >>= 1) {
        if (e & 1) result *= base;
        base *= base;
      }
      return (C)result;
    } else {
      return std::pow(a, b);
    }
  }
};
struct Maximum {  // NaN wins, as np.maximum
  template <class C> static C apply(C a, C b) { return (a > b || a != a) ? a : b; }
};
struct Minimum {
  template <class C> static C apply(C a, C b) { return (a < b || a != a) ? a : b; }
};
struct Eq { template <class C> static bool apply(C a, C b) { return a == b; } };
struct Ne { template <class C> static bool apply(C a, C b) { return a != b; } };
struct Lt { template <class C> static bool apply(C a, C b) { return a < b; } };
struct Le { template <class C> static bool apply(C a, C b) { return a <= b; } };
struct Gt { template <class C> static bool apply(C a, C b) { return a > b; } };
struct Ge { template <class C> static bool apply(C a, C b) { return a >= b; } };

template <class Op> constexpr bool is_comparison_v =
    std::is_same_v<Op, Eq> || std::is_same_v<Op, Ne> || std::is_same_v<Op, Lt> ||
    std::is_same_v<Op, Le> || std::is_same_v<Op, Gt> || std::is_same_v<Op, Ge>;

// out dtype: bool for comparisons, the input's otherwise.
template <class Op, class S> using binary_out_t = std::conditional_t<is_comparison_v<Op>, b8, S>;

template <class Op, class S> constexpr int64_t binary_grain() {
  return std::is_same_v<Op, Power> ? kGrainMath : kGrainCheap;
}

template <class Op, class S>
void binary_kernel(const void* a_, const void* b_, void* out_, int64_t n) {
  using O = binary_out_t<Op, S>;
  const S* a = (const S*)a_;
  const S* b = (const S*)b_;
  O* out = (O*)out_;
  produce(out, n, binary_grain<Op, S>(), [=](int64_t lo, int64_t hi, O* __restrict dst) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) dst[i - lo] = store<O>(Op::apply(load(a[i]), load(b[i])));
  });
}

// The scalar arrives as double (float dtypes) or int64 (integer dtypes), already converted.
struct Scalar {
  double f;
  int64_t i;
};

template <class Op, class S>
void scalar_kernel(const void* a_, Scalar value, void* out_, int64_t n) {
  using O = binary_out_t<Op, S>;
  using C = compute_t<S>;
  const S* a = (const S*)a_;
  O* out = (O*)out_;
  const C v = std::is_floating_point_v<C> ? (C)value.f : (C)value.i;
  produce(out, n, binary_grain<Op, S>(), [=](int64_t lo, int64_t hi, O* __restrict dst) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) dst[i - lo] = store<O>(Op::apply(load(a[i]), v));
  });
}

using BinaryFn = void (*)(const void*, const void*, void*, int64_t);
using ScalarFn = void (*)(const void*, Scalar, void*, int64_t);

// Arithmetic has no bool kernels (NDArray computes bool arithmetic in int32).
template <class Op> struct BinaryTables {
  KernelTable<BinaryFn> ewise;
  KernelTable<ScalarFn> scalar;
  BinaryTables(const char* ewise_name, const char* scalar_name)
      : ewise(ewise_name, [](auto tag) -> BinaryFn {
          using S = typename decltype(tag)::type;
          if constexpr (std::is_same_v<S, b8> && !is_comparison_v<Op>) return nullptr;
          else return &binary_kernel<Op, S>;
        }),
        scalar(scalar_name, [](auto tag) -> ScalarFn {
          using S = typename decltype(tag)::type;
          if constexpr (std::is_same_v<S, b8> && !is_comparison_v<Op>) return nullptr;
          else return &scalar_kernel<Op, S>;
        }) {}
};

// --- unary ops ----------------------------------------------------------------------------------

struct Neg {
  template <class C> static C apply(C x) {
    if constexpr (std::is_integral_v<C>) return (C)(uint_t<C>(0) - (uint_t<C>)x);
    else return -x;
  }
};
struct Abs {
  template <class C> static C apply(C x) {
    if constexpr (std::is_integral_v<C>) return x < 0 ? Neg::apply(x) : x;
    else return std::fabs(x);
  }
};
struct Relu {
  template <class C> static C apply(C x) { return Maximum::apply(x, C(0)); }
};
struct Exp { template <class C> static C apply(C x) { return vexp(x); } };
struct Log { template <class C> static C apply(C x) { return vlog(x); } };
struct Sqrt { template <class C> static C apply(C x) { return std::sqrt(x); } };
struct Rsqrt { template <class C> static C apply(C x) { return C(1) / std::sqrt(x); } };
struct Sin { template <class C> static C apply(C x) { return std::sin(x); } };
struct Cos { template <class C> static C apply(C x) { return std::cos(x); } };
struct Tanh { template <class C> static C apply(C x) { return vtanh(x); } };
struct Sigmoid { template <class C> static C apply(C x) { return vsigmoid(x); } };
struct Silu { template <class C> static C apply(C x) { return x * vsigmoid(x); } };
struct Gelu {  // the exact erf form, as torch.nn.GELU()
  template <class C> static C apply(C x) {
    return C(0.5) * x * (C(1) + std::erf(x / std::sqrt(C(2))));
  }
};

template <class Op> constexpr bool int_unary_v =
    std::is_same_v<Op, Neg> || std::is_same_v<Op, Abs> || std::is_same_v<Op, Relu>;

template <class Op> constexpr int64_t unary_grain() {
  return int_unary_v<Op> || std::is_same_v<Op, Sqrt> ? kGrainCheap : kGrainMath;
}

template <class Op, class S> void unary_kernel(const void* a_, void* out_, int64_t n) {
  const S* a = (const S*)a_;
  S* out = (S*)out_;
  produce(out, n, unary_grain<Op>(), [=](int64_t lo, int64_t hi, S* __restrict dst) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) dst[i - lo] = store<S>(Op::apply(load(a[i])));
  });
}

using UnaryFn = void (*)(const void*, void*, int64_t);

// Transcendentals need floats (NDArray casts integers to float32 first); neg/abs/relu also
// take integers; none takes bool.
template <class Op> KernelTable<UnaryFn> unary_table(const char* name) {
  return KernelTable<UnaryFn>(name, [](auto tag) -> UnaryFn {
    using S = typename decltype(tag)::type;
    if constexpr (is_float_storage_v<S> || (int_unary_v<Op> && !std::is_same_v<S, b8>))
      return &unary_kernel<Op, S>;
    else
      return nullptr;
  });
}

// --- casts --------------------------------------------------------------------------------------

template <class S, class D> inline D convert(S x) {
  using DC = compute_t<D>;
  if constexpr (std::is_same_v<D, b8>) {
    return b8{(uint8_t)(load(x) != 0)};
  } else if constexpr (std::is_same_v<S, double> && std::is_same_v<D, f16>) {
    return f16{f64_to_f16(x)};  // numpy rounds double -> half once
  } else {
    const auto c = load(x);  // float for fp16/bf16; ints -> bf16 go through float as ml_dtypes
    if constexpr (std::is_integral_v<DC> && std::is_floating_point_v<decltype(c)>)
      return store<D>(float_to_int<DC>(c));
    else
      return store<D>((DC)c);
  }
}

template <class S, class D> void cast_kernel(const void* a_, void* out_, int64_t n) {
  const S* a = (const S*)a_;
  D* out = (D*)out_;
  produce(out, n, kGrainCheap, [=](int64_t lo, int64_t hi, D* __restrict dst) {
    if constexpr (std::is_same_v<S, D>) {
      std::memcpy(dst, a + lo, (hi - lo) * sizeof(S));
    } else {
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) dst[i - lo] = convert<S, D>(a[i]);
    }
  });
}

// from[S] holds the kernels from dtype S to every dtype, named cast_{from}_{to}.
struct CastTables {
  std::vector<KernelTable<UnaryFn>> from;
  std::vector<std::string> names;
  CastTables() {
    names.reserve(kNumDTypes);
    for (int d = 0; d < kNumDTypes; ++d) {
      names.push_back(std::string("cast_") + dtype_short((DType)d));
      dispatch_all((DType)d, [&](auto stag) {
        using S = typename decltype(stag)::type;
        from.emplace_back(names.back().c_str(), [](auto dtag) -> UnaryFn {
          return &cast_kernel<S, typename decltype(dtag)::type>;
        });
      });
    }
  }
};

// --- where --------------------------------------------------------------------------------------

template <class T> void where_kernel(const b8* c, const T* a, const T* b, T* out, int64_t n) {
  produce(out, n, kGrainCheap, [=](int64_t lo, int64_t hi, T* __restrict dst) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) dst[i - lo] = c[i].v ? a[i] : b[i];
  });
}

using WhereFn = void (*)(const b8*, const void*, const void*, void*, int64_t);

// where only moves bits, so one kernel per element size serves every dtype of that size.
template <class T> void where_bits(const b8* c, const void* a, const void* b, void* out, int64_t n) {
  where_kernel<T>(c, (const T*)a, (const T*)b, (T*)out, n);
}

const KernelTable<WhereFn> kWhere("where", [](auto tag) -> WhereFn {
  constexpr size_t size = sizeof(typename decltype(tag)::type);
  if constexpr (size == 1) return &where_bits<uint8_t>;
  else if constexpr (size == 2) return &where_bits<uint16_t>;
  else if constexpr (size == 4) return &where_bits<uint32_t>;
  else return &where_bits<uint64_t>;
});

// --- bindings -----------------------------------------------------------------------------------

void check_binary(const Array& a, const Array& b, const Array& out, bool comparison,
                  const char* fn) {
  check_same_dtype(a, b, fn);
  check_size(b, a.size, fn, "b");
  check_size(out, a.size, fn, "out");
  check_dtype(out, comparison ? DType::b8 : a.dtype, fn, "out");
}

template <class Op> void def_binary(nb::module_& m, const char* ewise, const char* scalar) {
  static const BinaryTables<Op> tables(ewise, scalar);
  constexpr bool cmp = is_comparison_v<Op>;
  m.def(ewise, [ewise](const Array& a, const Array& b, Array& out) {
    check_binary(a, b, out, cmp, ewise);
    const BinaryFn fn = tables.ewise[a.dtype];
    without_gil([&] { fn(a.data, b.data, out.data, a.size); });
  }, nb::arg("a"), nb::arg("b"), nb::arg("out"));
  m.def(scalar, [scalar](const Array& a, nb::handle value, Array& out) {
    check_binary(a, a, out, cmp, scalar);
    const ScalarFn fn = tables.scalar[a.dtype];
    const bool is_float = a.dtype == DType::f32 || a.dtype == DType::f16 ||
                          a.dtype == DType::bf16 || a.dtype == DType::f64;
    const Scalar v{is_float ? scalar_as_double(value) : 0.0, is_float ? 0 : scalar_as_int(value)};
    without_gil([&] { fn(a.data, v, out.data, a.size); });
  }, nb::arg("a"), nb::arg("value"), nb::arg("out"));
}

template <class Op> void def_unary(nb::module_& m, const char* name) {
  static const KernelTable<UnaryFn> table = unary_table<Op>(name);
  m.def(name, [name](const Array& a, Array& out) {
    check_same_dtype(a, out, name);
    check_size(out, a.size, name, "out");
    const UnaryFn fn = table[a.dtype];
    without_gil([&] { fn(a.data, out.data, a.size); });
  }, nb::arg("a"), nb::arg("out"));
}

}  // namespace

void bind_elementwise(nb::module_& m) {
  def_binary<Add>(m, "ewise_add", "scalar_add");
  def_binary<Sub>(m, "ewise_sub", "scalar_sub");
  def_binary<Mul>(m, "ewise_mul", "scalar_mul");
  def_binary<Div>(m, "ewise_div", "scalar_div");
  def_binary<Power>(m, "ewise_power", "scalar_power");
  def_binary<Maximum>(m, "ewise_maximum", "scalar_maximum");
  def_binary<Minimum>(m, "ewise_minimum", "scalar_minimum");
  def_binary<Eq>(m, "ewise_eq", "scalar_eq");
  def_binary<Ne>(m, "ewise_ne", "scalar_ne");
  def_binary<Lt>(m, "ewise_lt", "scalar_lt");
  def_binary<Le>(m, "ewise_le", "scalar_le");
  def_binary<Gt>(m, "ewise_gt", "scalar_gt");
  def_binary<Ge>(m, "ewise_ge", "scalar_ge");

  def_unary<Neg>(m, "ewise_neg");
  def_unary<Abs>(m, "ewise_abs");
  def_unary<Exp>(m, "ewise_exp");
  def_unary<Log>(m, "ewise_log");
  def_unary<Sqrt>(m, "ewise_sqrt");
  def_unary<Rsqrt>(m, "ewise_rsqrt");
  def_unary<Sin>(m, "ewise_sin");
  def_unary<Cos>(m, "ewise_cos");
  def_unary<Tanh>(m, "ewise_tanh");
  def_unary<Sigmoid>(m, "ewise_sigmoid");
  def_unary<Relu>(m, "ewise_relu");
  def_unary<Silu>(m, "ewise_silu");
  def_unary<Gelu>(m, "ewise_gelu");

  static const CastTables casts;
  m.def("ewise_cast", [](const Array& a, Array& out) {
    check_size(out, a.size, "ewise_cast", "out");
    const UnaryFn fn = casts.from[(int)a.dtype][out.dtype];
    without_gil([&] { fn(a.data, out.data, a.size); });
  }, nb::arg("a"), nb::arg("out"), "Convert `a` to out's dtype (floats to ints truncate).");

  m.def("where", [](const Array& cond, const Array& a, const Array& b, Array& out) {
    check_dtype(cond, DType::b8, "where", "cond");
    check_binary(a, b, out, false, "where");
    check_size(cond, a.size, "where", "cond");
    const WhereFn fn = kWhere[a.dtype];
    without_gil([&] { fn(cond.as<b8>(), a.data, b.data, out.data, a.size); });
  }, nb::arg("cond"), nb::arg("a"), nb::arg("b"), nb::arg("out"));
}

}  // namespace needle
