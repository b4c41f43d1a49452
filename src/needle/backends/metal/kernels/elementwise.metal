// Elementwise kernels: binary and scalar ops, comparisons, unary ops, casts, where, fill.
// One element per thread per grid-stride step (docs/kernels.md §3); Apple GPUs coalesce
// neighbouring threads' scalar loads, so no vector loads are needed to reach bandwidth.
#include <metal_stdlib>
using namespace metal;

// ---- operations on compute values ----------------------------------------------------------
struct Add {
  template <class C>
  C operator()(C a, C b) const { return a + b; }
};
struct Sub {
  template <class C>
  C operator()(C a, C b) const { return a - b; }
};
struct Mul {
  template <class C>
  C operator()(C a, C b) const { return a * b; }
};
struct Maximum {
  template <class C>
  C operator()(C a, C b) const { return nan_max(a, b); }
};
struct Minimum {
  template <class C>
  C operator()(C a, C b) const { return nan_min(a, b); }
};

// numpy_ref._div: true division for floats; for integers floor division, and x / 0 gives 0
// for x >= 0 and 1 for x < 0 (the reference's formula, kept exactly)
template <class C>
inline C int_div(C x, C y) {
  if (y == 0) return x < 0 ? C(1) : C(0);
  C q = x / y;
  if ((x % y != 0) && ((x < 0) != (y < 0))) q -= 1;
  return q;
}
struct Div {
  float operator()(float a, float b) const { return a / b; }
  int operator()(int a, int b) const { return int_div(a, b); }
  long operator()(long a, long b) const { return int_div(a, b); }
};

// integer power wraps like numpy's; a negative exponent counts as 0
template <class C>
inline C int_pow(C x, C y) {
  ulong base = ulong(x), r = 1;
  for (C e = y < 0 ? C(0) : y; e > 0; e >>= 1) {
    if (e & 1) r *= base;
    base *= base;
  }
  return C(r);
}
struct Power {
  float operator()(float a, float b) const { return pow(a, b); }
  int operator()(int a, int b) const { return int_pow(a, b); }
  long operator()(long a, long b) const { return int_pow(a, b); }
};

struct Eq {
  template <class C>
  bool operator()(C a, C b) const { return a == b; }
};
struct Ne {
  template <class C>
  bool operator()(C a, C b) const { return a != b; }
};
struct Lt {
  template <class C>
  bool operator()(C a, C b) const { return a < b; }
};
struct Le {
  template <class C>
  bool operator()(C a, C b) const { return a <= b; }
};
struct Gt {
  template <class C>
  bool operator()(C a, C b) const { return a > b; }
};
struct Ge {
  template <class C>
  bool operator()(C a, C b) const { return a >= b; }
};

inline float sigmoid(float x) {
  return 0.5f * (tanh(0.5f * x) + 1.0f);  // numpy_ref's formula
}

struct Neg {
  template <class C>
  C operator()(C x) const { return -x; }
};
struct Abs {
  float operator()(float x) const { return fabs(x); }
  int operator()(int x) const { return x < 0 ? -x : x; }
  long operator()(long x) const { return x < 0 ? -x : x; }
};
struct Relu {
  template <class C>
  C operator()(C x) const { return (x > C(0) || is_nan(x)) ? x : C(0); }
};
struct Exp {
  float operator()(float x) const { return exp(x); }
};
struct Log {
  float operator()(float x) const { return log(x); }
};
struct Sqrt {
  float operator()(float x) const { return sqrt(x); }
};
struct Rsqrt {
  float operator()(float x) const { return 1.0f / sqrt(x); }
};
struct Sin {
  float operator()(float x) const { return sin(x); }
};
struct Cos {
  float operator()(float x) const { return cos(x); }
};
struct Tanh {
  float operator()(float x) const { return tanh(x); }
};
struct Sigmoid {
  float operator()(float x) const { return sigmoid(x); }
};
struct Silu {
  float operator()(float x) const { return x * sigmoid(x); }
};
struct Gelu {  // exact (erf) form: 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2)
  float operator()(float x) const { return 0.5f * x * erfc_approx(-x * M_SQRT1_2_F); }
};
struct SiluMul {
  float operator()(float a, float b) const { return a * sigmoid(a) * b; }
};

// ---- kernels -------------------------------------------------------------------------------
template <class T, class Op>
kernel void binary(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                   device T* out [[buffer(2)]], constant NParams& p [[buffer(3)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = store<T>(Op()(load(a[i]), load(b[i]))); }
}

template <class T, class Op>
kernel void binary_scalar(device const T* a [[buffer(0)]], device T* out [[buffer(1)]],
                          constant SParams<typename Scalar<T>::type>& p [[buffer(2)]],
                          GRID_ARGS) {
  const typename Acc<T>::type s = scalar_value<T>(p.value);
  GRID_STRIDE(i, p.n) { out[i] = store<T>(Op()(load(a[i]), s)); }
}

template <class T, class Op>
kernel void compare(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                    device bool* out [[buffer(2)]], constant NParams& p [[buffer(3)]],
                    GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = Op()(load(a[i]), load(b[i])); }
}

template <class T, class Op>
kernel void compare_scalar(device const T* a [[buffer(0)]], device bool* out [[buffer(1)]],
                           constant SParams<typename Scalar<T>::type>& p [[buffer(2)]],
                           GRID_ARGS) {
  const typename Acc<T>::type s = scalar_value<T>(p.value);
  GRID_STRIDE(i, p.n) { out[i] = Op()(load(a[i]), s); }
}

template <class T, class Op>
kernel void unary(device const T* a [[buffer(0)]], device T* out [[buffer(1)]],
                  constant NParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = store<T>(Op()(load(a[i]))); }
}

// A compute value converted to a storage type. Floats to integers follow needle's rule on
// every backend (docs/dtypes.md): truncate toward zero, saturate, NaN gives 0.
template <class To, class C>
inline To convert(C v) {
  return store<To>(typename Acc<To>::type(v));
}
template <>
inline int convert<int, float>(float v) {
  return v != v ? 0 : v >= 2147483648.0f ? 2147483647 : v < -2147483648.0f ? int(0x80000000)
                                                                          : int(v);
}
template <>
inline long convert<long, float>(float v) {
  return v != v ? 0
         : v >= 9223372036854775808.0f ? long(0x7fffffffffffffff)
         : v < -9223372036854775808.0f ? long(0x8000000000000000)
                                       : long(v);
}

template <>
inline uchar convert<uchar, float>(float v) {
  return v != v ? uchar(0) : v >= 256.0f ? uchar(255) : v < 0.0f ? uchar(0) : uchar(int(v));
}
template <>
inline char convert<char, float>(float v) {
  return v != v ? char(0) : v >= 128.0f ? char(127) : v < -128.0f ? char(-128) : char(int(v));
}

template <class From, class To>
kernel void cast(device const From* a [[buffer(0)]], device To* out [[buffer(1)]],
                 constant NParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = convert<To>(load(a[i])); }
}

// to bool: nonzero (NaN included) is true
template <class From>
kernel void cast_to_bool(device const From* a [[buffer(0)]], device bool* out [[buffer(1)]],
                         constant NParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = load(a[i]) != 0; }
}

template <class T>
kernel void where(device const bool* cond [[buffer(0)]], device const T* a [[buffer(1)]],
                  device const T* b [[buffer(2)]], device T* out [[buffer(3)]],
                  constant NParams& p [[buffer(4)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = cond[i] ? a[i] : b[i]; }
}

template <class T>
kernel void fill(device T* out [[buffer(0)]],
                 constant SParams<typename Scalar<T>::type>& p [[buffer(1)]], GRID_ARGS) {
  const T v = store<T>(scalar_value<T>(p.value));
  GRID_STRIDE(i, p.n) { out[i] = v; }
}

// ---- instantiation -------------------------------------------------------------------------
#define ARITH(OP, F, SFX, T)                                                     \
  INSTANTIATE(NAME(ewise_##OP##_##SFX), binary<T, F>)                            \
  INSTANTIATE(NAME(scalar_##OP##_##SFX), binary_scalar<T, F>)
#define COMPARE(OP, F, SFX, T)                                                   \
  INSTANTIATE(NAME(ewise_##OP##_##SFX), compare<T, F>)                           \
  INSTANTIATE(NAME(scalar_##OP##_##SFX), compare_scalar<T, F>)
#define UNARY(OP, F, SFX, T) INSTANTIATE(NAME(ewise_##OP##_##SFX), unary<T, F>)
#define SILU_MUL(unused, SFX, T) INSTANTIATE(NAME(silu_mul_##SFX), binary<T, SiluMul>)
#define WHERE(unused, SFX, T) INSTANTIATE(NAME(where_##SFX), where<T>)
#define FILL(unused, SFX, T) INSTANTIATE(NAME(fill_##SFX), fill<T>)

NUMBERS(ARITH, add, Add)
SMALL_INTS(ARITH, add, Add)
NUMBERS(ARITH, sub, Sub)
SMALL_INTS(ARITH, sub, Sub)
NUMBERS(ARITH, mul, Mul)
SMALL_INTS(ARITH, mul, Mul)
NUMBERS(ARITH, div, Div)
SMALL_INTS(ARITH, div, Div)
NUMBERS(ARITH, power, Power)
SMALL_INTS(ARITH, power, Power)
NUMBERS(ARITH, maximum, Maximum)
SMALL_INTS(ARITH, maximum, Maximum)
NUMBERS(ARITH, minimum, Minimum)
SMALL_INTS(ARITH, minimum, Minimum)

ALL(COMPARE, eq, Eq)
SMALL_INTS(COMPARE, eq, Eq)
ALL(COMPARE, ne, Ne)
SMALL_INTS(COMPARE, ne, Ne)
ALL(COMPARE, lt, Lt)
SMALL_INTS(COMPARE, lt, Lt)
ALL(COMPARE, le, Le)
SMALL_INTS(COMPARE, le, Le)
ALL(COMPARE, gt, Gt)
SMALL_INTS(COMPARE, gt, Gt)
ALL(COMPARE, ge, Ge)
SMALL_INTS(COMPARE, ge, Ge)

NUMBERS(UNARY, neg, Neg)
SMALL_INTS(UNARY, neg, Neg)
NUMBERS(UNARY, abs, Abs)
SMALL_INTS(UNARY, abs, Abs)
NUMBERS(UNARY, relu, Relu)
SMALL_INTS(UNARY, relu, Relu)
FLOATS(UNARY, exp, Exp)
FLOATS(UNARY, log, Log)
FLOATS(UNARY, sqrt, Sqrt)
FLOATS(UNARY, rsqrt, Rsqrt)
FLOATS(UNARY, sin, Sin)
FLOATS(UNARY, cos, Cos)
FLOATS(UNARY, tanh, Tanh)
FLOATS(UNARY, sigmoid, Sigmoid)
FLOATS(UNARY, silu, Silu)
FLOATS(UNARY, gelu, Gelu)

FLOATS(SILU_MUL, _)
ALL(WHERE, _)
SMALL_INTS(WHERE, _)
ALL(FILL, _)
SMALL_INTS(FILL, _)

// every ordered pair of dtypes (macros that expand inside FLOATS/NUMBERS cannot use them
// again, so the targets are spelled out)
#define CAST_TO(SA, TA, SB, TB) INSTANTIATE(NAME(cast_##SA##_##SB), cast<TA, TB>)
#if defined(__HAVE_BFLOAT__)
#define CAST_TO_BF16(SA, TA) CAST_TO(SA, TA, bf16, bfloat)
#else
#define CAST_TO_BF16(SA, TA)
#endif
#define CAST_ROW(unused, SA, TA)                                                 \
  CAST_TO(SA, TA, f16, half) CAST_TO_BF16(SA, TA) CAST_TO(SA, TA, f32, float)     \
  CAST_TO(SA, TA, i32, int) CAST_TO(SA, TA, i64, long)                           \
  CAST_TO(SA, TA, u8, uchar) CAST_TO(SA, TA, i8, char)                           \
  INSTANTIATE(NAME(cast_##SA##_b8), cast_to_bool<TA>)
ALL(CAST_ROW, _)
SMALL_INTS(CAST_ROW, _)
