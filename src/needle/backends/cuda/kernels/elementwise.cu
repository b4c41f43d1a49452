// Elementwise kernels: binary and scalar ops, comparisons, unary ops, casts, where, fill.
// Grid-stride loops over 16-byte vectors (docs/kernels.md §3); memory-bound by design.
#include "common.cuh"

// ---- the loops ----------------------------------------------------------------------------
template <class In, class Out>
struct Width { static constexpr int V = 16 / (sizeof(In) > sizeof(Out) ? sizeof(In) : sizeof(Out)); };

template <class In, class Out, class F>
__device__ __forceinline__ void map1(const In* __restrict__ a, Out* __restrict__ out, i64 n, F f) {
  constexpr int V = Width<In, Out>::V;
  const i64 t0 = global_thread(), step = grid_threads();
  const i64 nv = (aligned16(a) && aligned16(out)) ? n / V : 0;
  for (i64 i = t0; i < nv; i += step) {
    Vec<In, V> x = reinterpret_cast<const Vec<In, V>*>(a)[i];
    Vec<Out, V> y;
#pragma unroll
    for (int j = 0; j < V; j++) y.v[j] = f(x.v[j]);
    reinterpret_cast<Vec<Out, V>*>(out)[i] = y;
  }
  for (i64 i = nv * V + t0; i < n; i += step) out[i] = f(a[i]);
}

template <class In, class Out, class F>
__device__ __forceinline__ void map2(const In* __restrict__ a, const In* __restrict__ b,
                                     Out* __restrict__ out, i64 n, F f) {
  constexpr int V = Width<In, Out>::V;
  const i64 t0 = global_thread(), step = grid_threads();
  const i64 nv = (aligned16(a) && aligned16(b) && aligned16(out)) ? n / V : 0;
  for (i64 i = t0; i < nv; i += step) {
    Vec<In, V> x = reinterpret_cast<const Vec<In, V>*>(a)[i];
    Vec<In, V> y = reinterpret_cast<const Vec<In, V>*>(b)[i];
    Vec<Out, V> z;
#pragma unroll
    for (int j = 0; j < V; j++) z.v[j] = f(x.v[j], y.v[j]);
    reinterpret_cast<Vec<Out, V>*>(out)[i] = z;
  }
  for (i64 i = nv * V + t0; i < n; i += step) out[i] = f(a[i], b[i]);
}

// ---- operations on compute values ---------------------------------------------------------
struct Add { template <class C> __device__ C operator()(C a, C b) const { return a + b; } };
struct Sub { template <class C> __device__ C operator()(C a, C b) const { return a - b; } };
struct Mul { template <class C> __device__ C operator()(C a, C b) const { return a * b; } };
struct Maximum { template <class C> __device__ C operator()(C a, C b) const { return nan_max(a, b); } };
struct Minimum { template <class C> __device__ C operator()(C a, C b) const { return nan_min(a, b); } };

// numpy_ref._div: true division for floats; for integers floor division, 0 for x / 0
// with x >= 0 and 1 with x < 0 (the reference's formula, kept bit for bit).
template <class C> __device__ __forceinline__ C int_div(C x, C y) {
  if (y == 0) return x < 0 ? 1 : 0;
  C q = x / y;
  if ((x % y != 0) && ((x < 0) != (y < 0))) q -= 1;
  return q;
}
struct Div {
  __device__ float operator()(float a, float b) const { return a / b; }
  __device__ double operator()(double a, double b) const { return a / b; }
  __device__ int operator()(int a, int b) const { return int_div(a, b); }
  __device__ i64 operator()(i64 a, i64 b) const { return int_div(a, b); }
};

template <class C> __device__ __forceinline__ C int_pow(C x, C y) {
  typedef unsigned long long U;  // wraps like numpy's integer power
  U base = (U)x, r = 1;
  for (C e = y < 0 ? 0 : y; e > 0; e >>= 1) {
    if (e & 1) r *= base;
    base *= base;
  }
  return (C)r;
}
struct Power {
  __device__ float operator()(float a, float b) const { return m_pow(a, b); }
  __device__ double operator()(double a, double b) const { return m_pow(a, b); }
  __device__ int operator()(int a, int b) const { return int_pow(a, b); }
  __device__ i64 operator()(i64 a, i64 b) const { return int_pow(a, b); }
};

struct Eq { template <class C> __device__ bool operator()(C a, C b) const { return a == b; } };
struct Ne { template <class C> __device__ bool operator()(C a, C b) const { return a != b; } };
struct Lt { template <class C> __device__ bool operator()(C a, C b) const { return a < b; } };
struct Le { template <class C> __device__ bool operator()(C a, C b) const { return a <= b; } };
struct Gt { template <class C> __device__ bool operator()(C a, C b) const { return a > b; } };
struct Ge { template <class C> __device__ bool operator()(C a, C b) const { return a >= b; } };

struct Neg { template <class C> __device__ C operator()(C x) const { return -x; } };
struct Abs { template <class C> __device__ C operator()(C x) const { return m_abs(x); } };
struct Relu { template <class C> __device__ C operator()(C x) const { return (x > C(0) || is_nan(x)) ? x : C(0); } };
struct Exp { template <class C> __device__ C operator()(C x) const { return m_exp(x); } };
struct Log { template <class C> __device__ C operator()(C x) const { return m_log(x); } };
struct Sqrt { template <class C> __device__ C operator()(C x) const { return m_sqrt(x); } };
struct Rsqrt { template <class C> __device__ C operator()(C x) const { return C(1) / m_sqrt(x); } };
struct Sin { template <class C> __device__ C operator()(C x) const { return m_sin(x); } };
struct Cos { template <class C> __device__ C operator()(C x) const { return m_cos(x); } };
struct Tanh { template <class C> __device__ C operator()(C x) const { return m_tanh(x); } };
struct Sigmoid { template <class C> __device__ C operator()(C x) const { return sigmoid(x); } };
struct Silu { template <class C> __device__ C operator()(C x) const { return x * sigmoid(x); } };
struct Gelu {
  template <class C> __device__ C operator()(C x) const {
    return C(0.5) * x * (C(1) + m_erf(x / C(1.4142135623730951)));
  }
};
struct SiluMul { template <class C> __device__ C operator()(C a, C b) const { return a * sigmoid(a) * b; } };

// ---- adapters from storage types to compute-value operations -------------------------------
template <class T, class Op> struct Arith2 {
  __device__ T operator()(T a, T b) const { return store<T>(Op()(load(a), load(b))); }
};
template <class T, class Op> struct ArithScalar {
  typename Acc<T>::type s;
  __device__ T operator()(T a) const { return store<T>(Op()(load(a), s)); }
};
template <class T, class Op> struct Compare2 {
  __device__ b8 operator()(T a, T b) const { return (b8)Op()(load(a), load(b)); }
};
template <class T, class Op> struct CompareScalar {
  typename Acc<T>::type s;
  __device__ b8 operator()(T a) const { return (b8)Op()(load(a), s); }
};
template <class T, class Op> struct Arith1 {
  __device__ T operator()(T a) const { return store<T>(Op()(load(a))); }
};
// floats to integers follow needle's rule on every backend (docs/dtypes.md): truncate toward
// zero, saturate at the integer's range, NaN gives 0
// IntRange<T>: the range of integer storage type T as its compute type I, with hi = max + 1
// (a power of two, exact in float and double); instantiated for float targets too (never run)
template <class T> struct IntRange {
  typedef typename Acc<T>::type I;
  __device__ static double hi() { return sizeof(I) == 4 ? 2147483648.0 : 9223372036854775808.0; }
  __device__ static double lo() { return -hi(); }
  __device__ static I max() { return sizeof(I) == 4 ? (I)0x7fffffff : (I)0x7fffffffffffffffll; }
  __device__ static I min() { return sizeof(I) == 4 ? (I)0x80000000 : (I)0x8000000000000000ull; }
};
template <> struct IntRange<u8_t> {
  __device__ static double hi() { return 256.0; }
  __device__ static double lo() { return 0.0; }
  __device__ static int max() { return 255; }
  __device__ static int min() { return 0; }
};
template <> struct IntRange<i8_t> {
  __device__ static double hi() { return 128.0; }
  __device__ static double lo() { return -128.0; }
  __device__ static int max() { return 127; }
  __device__ static int min() { return -128; }
};
// x < lo covers (lo - 1, lo) too, which truncates to lo = min
template <class T, class F> __device__ __forceinline__ typename Acc<T>::type float_to_int(F x) {
  typedef typename Acc<T>::type I;
  if (x != x) return 0;
  if (x >= (F)IntRange<T>::hi()) return IntRange<T>::max();
  if (x < (F)IntRange<T>::lo()) return IntRange<T>::min();
  return (I)x;
}
template <class C> struct IsFloat { static const bool value = false; };
template <> struct IsFloat<float> { static const bool value = true; };
template <> struct IsFloat<double> { static const bool value = true; };

template <class From, class To> struct Cast {
  __device__ To operator()(From a) const {
    typedef typename Acc<To>::type C;
    const auto v = load(a);
    // decltype(load(a)), not decltype(v): v is const, and IsFloat<const float> is false (the
    // rule was skipped, and int64 casts got the hardware's NaN/overflow results)
    if (IsFloat<decltype(load(a))>::value && !IsFloat<C>::value)
      return store<To>(float_to_int<To>(v));
    return store<To>((C)v);
  }
};
template <class From> struct Cast<From, b8> {
  __device__ b8 operator()(From a) const { return (b8)(load(a) != 0); }
};

// the scalar param, as the compute type (a bool scalar arrives as int 0/1)
template <class T> __device__ __forceinline__ typename Acc<T>::type scalar_value(typename Scalar<T>::type v) { return v; }
template <> __device__ __forceinline__ int scalar_value<b8>(int v) { return v != 0; }

// ---- instantiation -------------------------------------------------------------------------
#define ARITH(OP, F, SFX, T)                                                                   \
  extern "C" __global__ void ewise_##OP##_##SFX(const T* __restrict__ a, const T* __restrict__ b, \
                                                T* __restrict__ out, NParams p) {              \
    pdl_entry();                                                                               \
    map2(a, b, out, p.n, Arith2<T, F>());                                                      \
  }                                                                                            \
  extern "C" __global__ void scalar_##OP##_##SFX(const T* __restrict__ a, T* __restrict__ out, \
                                                 SParams<Scalar<T>::type> p) {                 \
    pdl_entry();                                                                               \
    map1(a, out, p.n, ArithScalar<T, F>{scalar_value<T>(p.value)});                            \
  }
#define COMPARE(OP, F, SFX, T)                                                                 \
  extern "C" __global__ void ewise_##OP##_##SFX(const T* __restrict__ a, const T* __restrict__ b, \
                                                b8* __restrict__ out, NParams p) {             \
    pdl_entry();                                                                               \
    map2(a, b, out, p.n, Compare2<T, F>());                                                    \
  }                                                                                            \
  extern "C" __global__ void scalar_##OP##_##SFX(const T* __restrict__ a, b8* __restrict__ out, \
                                                 SParams<Scalar<T>::type> p) {                 \
    pdl_entry();                                                                               \
    map1(a, out, p.n, CompareScalar<T, F>{scalar_value<T>(p.value)});                          \
  }
#define UNARY(OP, F, SFX, T)                                                                   \
  extern "C" __global__ void ewise_##OP##_##SFX(const T* __restrict__ a, T* __restrict__ out,  \
                                                NParams p) {                                   \
    pdl_entry();                                                                               \
    map1(a, out, p.n, Arith1<T, F>());                                                         \
  }
#define SILU_MUL(SFX, T)                                                                       \
  extern "C" __global__ void silu_mul_##SFX(const T* __restrict__ a, const T* __restrict__ b,  \
                                            T* __restrict__ out, NParams p) {                  \
    pdl_entry();                                                                               \
    map2(a, b, out, p.n, Arith2<T, SiluMul>());                                                \
  }
#define WHERE(SFX, T)                                                                          \
  extern "C" __global__ void where_##SFX(const b8* __restrict__ cond, const T* __restrict__ a, \
                                         const T* __restrict__ b, T* __restrict__ out, NParams p) { \
    pdl_entry();                                                                               \
    const i64 t0 = global_thread(), step = grid_threads();                                     \
    for (i64 i = t0; i < p.n; i += step) out[i] = cond[i] ? a[i] : b[i];                       \
  }
#define FILL(SFX, T)                                                                           \
  extern "C" __global__ void fill_##SFX(T* __restrict__ out, SParams<Scalar<T>::type> p) {     \
    pdl_entry();                                                                               \
    constexpr int V = 16 / sizeof(T);                                                          \
    const T v = store<T>(scalar_value<T>(p.value));                                            \
    Vec<T, V> w;                                                                               \
    for (int j = 0; j < V; j++) w.v[j] = v;                                                    \
    const i64 t0 = global_thread(), step = grid_threads();                                     \
    const i64 nv = aligned16(out) ? p.n / V : 0;                                               \
    for (i64 i = t0; i < nv; i += step) reinterpret_cast<Vec<T, V>*>(out)[i] = w;              \
    for (i64 i = nv * V + t0; i < p.n; i += step) out[i] = v;                                  \
  }
#define CAST(SA, TA, SB, TB)                                                                   \
  extern "C" __global__ void cast_##SA##_##SB(const TA* __restrict__ a, TB* __restrict__ out,  \
                                              NParams p) {                                     \
    pdl_entry();                                                                               \
    map1(a, out, p.n, Cast<TA, TB>());                                                         \
  }

#define FLOATS(M, ...) ONLY(f16, M(__VA_ARGS__, f16, half_t)) ONLY(bf16, M(__VA_ARGS__, bf16, bf16_t)) \
  ONLY(f32, M(__VA_ARGS__, f32, float)) ONLY(f64, M(__VA_ARGS__, f64, double))
#define NUMBERS(M, ...) FLOATS(M, __VA_ARGS__) ONLY(i32, M(__VA_ARGS__, i32, int)) \
  ONLY(i64, M(__VA_ARGS__, i64, i64)) ONLY(u8, M(__VA_ARGS__, u8, u8_t)) ONLY(i8, M(__VA_ARGS__, i8, i8_t))
#define ALL(M, ...) NUMBERS(M, __VA_ARGS__) ONLY(b8, M(__VA_ARGS__, b8, b8))

NUMBERS(ARITH, add, Add)
NUMBERS(ARITH, sub, Sub)
NUMBERS(ARITH, mul, Mul)
NUMBERS(ARITH, div, Div)
NUMBERS(ARITH, power, Power)
NUMBERS(ARITH, maximum, Maximum)
NUMBERS(ARITH, minimum, Minimum)

ALL(COMPARE, eq, Eq)
ALL(COMPARE, ne, Ne)
ALL(COMPARE, lt, Lt)
ALL(COMPARE, le, Le)
ALL(COMPARE, gt, Gt)
ALL(COMPARE, ge, Ge)

NUMBERS(UNARY, neg, Neg)
NUMBERS(UNARY, abs, Abs)
NUMBERS(UNARY, relu, Relu)
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

#define SILU_MUL_(unused, SFX, T) SILU_MUL(SFX, T)
#define WHERE_(unused, SFX, T) WHERE(SFX, T)
#define FILL_(unused, SFX, T) FILL(SFX, T)
FLOATS(SILU_MUL_, _)
ALL(WHERE_, _)
ALL(FILL_, _)

// every ordered pair of distinct dtypes
#define CAST_FROM(SA, TA, SB, TB) CAST(SA, TA, SB, TB)
#define CAST_ROW_(unused, SA, TA)                                                              \
  CAST_FROM(SA, TA, f16, half_t) CAST_FROM(SA, TA, bf16, bf16_t) CAST_FROM(SA, TA, f32, float) \
  CAST_FROM(SA, TA, f64, double) CAST_FROM(SA, TA, i32, int) CAST_FROM(SA, TA, i64, i64)        \
  CAST_FROM(SA, TA, b8, b8) CAST_FROM(SA, TA, u8, u8_t) CAST_FROM(SA, TA, i8, i8_t)
ALL(CAST_ROW_, _)
