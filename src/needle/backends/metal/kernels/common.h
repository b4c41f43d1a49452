// Shared by every needle Metal kernel file (the backend prepends it: Metal compiles source
// strings, so there is no include path). Params structs, compute types, conversions, NaN-aware
// min/max, erfc, 64-bit simd-group shuffles and the instantiation helpers. docs/kernels.md is
// the ABI these follow.
#include <metal_stdlib>
using namespace metal;

struct NParams {
  long n;
};
template <class S>
struct SParams {
  long n;
  S value;
};

// ---- compute types: what a storage type is loaded as ----------------------------------------
template <class T>
struct Acc {
  typedef T type;
};
template <>
struct Acc<half> {
  typedef float type;
};
#if defined(__HAVE_BFLOAT__)
template <>
struct Acc<bfloat> {
  typedef float type;
};
#endif
template <>
struct Acc<bool> {
  typedef int type;
};
// uint8 (uchar) and int8 (char, signed in MSL) compute in int; store keeps the low 8 bits,
// so arithmetic wraps modulo 2^8 (docs/dtypes.md)
template <>
struct Acc<uchar> {
  typedef int type;
};
template <>
struct Acc<char> {
  typedef int type;
};

// the params scalar `S` of a dtype (docs/kernels.md §1): float for every float, int for bool
template <class T>
struct Scalar {
  typedef typename Acc<T>::type type;
};

template <class T>
inline typename Acc<T>::type load(T x) {
  return typename Acc<T>::type(x);
}

// round once to the storage type (Metal's float -> half / bfloat conversions round to even)
template <class T>
inline T store(typename Acc<T>::type v) {
  return T(v);
}
template <>
inline bool store<bool>(int v) {
  return v != 0;
}

// the scalar param as a compute value (a bool scalar arrives as int 0/1)
template <class T>
inline typename Acc<T>::type scalar_value(typename Scalar<T>::type v) {
  return v;
}
template <>
inline int scalar_value<bool>(int v) {
  return v != 0 ? 1 : 0;
}

// ---- math on compute values ------------------------------------------------------------------
template <class C>
inline bool is_nan(C x) {
  return x != x;
}

// Gemma 2's soft-capped attention scores, cap * tanh(s / cap), after the scale; cap 0: s
inline float soft_cap(float s, float cap) {
  return cap > 0.0f ? cap * tanh(s / cap) : s;
}

// NaN-propagating max/min (numpy.maximum / numpy.minimum)
template <class C>
inline C nan_max(C a, C b) {
  return (a > b || is_nan(a)) ? a : b;
}
template <class C>
inline C nan_min(C a, C b) {
  return (a < b || is_nan(a)) ? a : b;
}

// MSL has no erf: erfc from Numerical Recipes' Chebyshev fit (relative error < 1.2e-7), which
// stays accurate in both tails where 1 - erf would cancel.
inline float erfc_approx(float x) {
  const float z = fabs(x);
  const float t = 1.0f / (1.0f + 0.5f * z);
  const float r =
      t * exp(-z * z - 1.26551223f +
              t * (1.00002368f +
                   t * (0.37409196f +
                        t * (0.09678418f +
                             t * (-0.18628806f +
                                  t * (0.27886807f +
                                       t * (-1.13520398f +
                                            t * (1.48851587f +
                                                 t * (-0.82215223f + t * 0.17087277f)))))))));
  return x >= 0.0f ? r : 2.0f - r;
}

template <class C>
inline C lowest();
template <>
inline float lowest<float>() {
  return -INFINITY;
}
template <>
inline int lowest<int>() {
  return int(0x80000000u);
}
template <>
inline long lowest<long>() {
  return long(0x8000000000000000ul);
}
template <class C>
inline C highest();
template <>
inline float highest<float>() {
  return INFINITY;
}
template <>
inline int highest<int>() {
  return 0x7fffffff;
}
template <>
inline long highest<long>() {
  return 0x7fffffffffffffffl;
}

inline long lmin(long a, long b) {
  return a < b ? a : b;
}

// ---- simd-group exchange of any 32- or 64-bit value ------------------------------------------
// simd_shuffle_xor is defined for 32-bit types; 64-bit values travel as two halves.
inline float shuffle_xor(float v, ushort m) {
  return simd_shuffle_xor(v, m);
}
inline int shuffle_xor(int v, ushort m) {
  return simd_shuffle_xor(v, m);
}
inline long shuffle_xor(long v, ushort m) {
  uint2 h = as_type<uint2>(v);
  uint2 r;
  r.x = simd_shuffle_xor(h.x, m);
  r.y = simd_shuffle_xor(h.y, m);
  return as_type<long>(r);
}

// ---- reductions: one op, its identity and its combine ---------------------------------------
template <class C>
struct SumOp {
  static C identity() { return C(0); }
  static C combine(C a, C b) { return a + b; }
};
template <class C>
struct MaxOp {
  static C identity() { return lowest<C>(); }
  static C combine(C a, C b) { return nan_max(a, b); }
};
template <class C>
struct MinOp {
  static C identity() { return highest<C>(); }
  static C combine(C a, C b) { return nan_min(a, b); }
};

// the reduction of v over the simd-group, in every lane
template <class Op, class C>
inline C simd_reduce(C v) {
  for (ushort m = 16; m > 0; m >>= 1) v = Op::combine(v, shuffle_xor(v, m));
  return v;
}
inline float simd_reduce_sum(float v) {
  return simd_sum(v);
}

// ---- grid-stride loops (docs/kernels.md §3) --------------------------------------------------
#define GRID_STRIDE(i, n) for (long i = long(gid); i < (n); i += long(grid_size))
#define GRID_ARGS                                   \
  uint gid [[thread_position_in_grid]],             \
      uint grid_size [[threads_per_grid]]

// ---- instantiation under host names ------------------------------------------------------------
#define NAME_(x) #x
#define NAME(x) NAME_(x)
#define INSTANTIATE(HOST, ...) \
  template [[host_name(HOST)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

#if defined(__HAVE_BFLOAT__)
#define WITH_BF16(M, ...) M(__VA_ARGS__, bf16, bfloat)
#else
#define WITH_BF16(M, ...)
#endif
#define FLOATS(M, ...) M(__VA_ARGS__, f16, half) WITH_BF16(M, __VA_ARGS__) M(__VA_ARGS__, f32, float)
#define NUMBERS(M, ...) FLOATS(M, __VA_ARGS__) M(__VA_ARGS__, i32, int) M(__VA_ARGS__, i64, long)
#define ALL(M, ...) NUMBERS(M, __VA_ARGS__) M(__VA_ARGS__, b8, bool)
// uint8/int8: elementwise, cast and layout kernels only (reductions and matmuls of them run
// through int32/int64 copies, backends/gpu/reduce.py and matmul.py)
#define SMALL_INTS(M, ...) M(__VA_ARGS__, u8, uchar) M(__VA_ARGS__, i8, char)
