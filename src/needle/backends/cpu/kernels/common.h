// Shared pieces of the CPU kernels: dtypes and their storage/compute types, the bit-exact
// float16/bfloat16 conversions, the Array buffer, threading helpers and error reporting.
//
// runtime.cc defines the dtypes, the Array, errors, threads and registry declared here;
// every kernel family (memory.cc, elementwise.cc, reduce.cc, matmul.cc, nn.cc,
// attention.cc, ...) includes this header and registers its Python-visible functions on the
// module in a bind_* function.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace nb = nanobind;

namespace needle {

// --- dtypes -------------------------------------------------------------------------------

enum class DType : int { f32, f16, bf16, f64, i32, i64, b8, u8, i8 };
constexpr int kNumDTypes = 9;

// needle's dtype names (Python side) and the short names used in kernel names (C++ side).
const char* dtype_name(DType dt);
const char* dtype_short(DType dt);
size_t dtype_size(DType dt);
DType parse_dtype(const std::string& name);  // raises DTypeError on an unknown name

// fp16/bf16/bool get distinct storage types so that overloads and templates can tell them apart.
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };
struct b8 { uint8_t v; };

// Storage type S -> compute type: fp16/bf16 compute in float32, bool in int32.
template <class S> struct Compute { using type = S; };
template <> struct Compute<f16> { using type = float; };
template <> struct Compute<bf16> { using type = float; };
template <> struct Compute<b8> { using type = int32_t; };
template <class S> using compute_t = typename Compute<S>::type;

// Integers accumulate in their unsigned twin so that overflow wraps (as numpy) instead of UB.
template <class C, class = void> struct Wrapping { using type = C; };
template <class C> struct Wrapping<C, std::enable_if_t<std::is_integral_v<C>>> {
  using type = std::make_unsigned_t<C>;
};
template <class C> using wrapping_t = typename Wrapping<C>::type;

template <class S> constexpr bool is_float_storage_v =
    std::is_same_v<S, float> || std::is_same_v<S, double> || std::is_same_v<S, f16> ||
    std::is_same_v<S, bf16>;

// --- float16 / bfloat16 bit conversions (branch-free so that loops vectorize) -------------

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Exact widening, denormals included (after Maratyszcza's FP16 library).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t finite =
      sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
  // inf/NaN by bits, so that signaling NaNs stay signaling (as numpy's conversion)
  const uint32_t special = sign | 0x7F800000u | ((uint32_t)(h & 0x3FFu) << 13);
  return bits_f32((h & 0x7C00u) == 0x7C00u ? special : finite);
}

// Round to nearest even, overflow to inf; NaNs keep their top payload bits as numpy does.
inline uint16_t f32_to_f16(float f) {
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float scaled = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const float base = bits_f32((bias >> 1) + 0x07800000u) + scaled;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t payload = (w & 0x007FFFFFu) >> 13;
  const uint32_t nan = 0x7C00u | payload | (payload == 0);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// Round to nearest even; every NaN becomes the quiet NaN 0x7fc0 with its sign (as ml_dtypes).
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return (uint16_t)(nan ? ((u >> 16) & 0x8000u) | 0x7FC0u : rounded);
}

uint16_t f64_to_f16(double d);  // one rounding, as numpy's double->half cast

// needle's float -> int conversion, the same on every backend (docs/dtypes.md): truncate
// toward zero, saturate at the integer's range, NaN gives 0 (what GPUs' conversions do).
template <class I, class F> inline I float_to_int(F x) {
  // max + 1, a power of two (2^8, 2^7, 2^31, 2^63), exact in F
  constexpr F hi = (F)2 * (F)(std::numeric_limits<I>::max() / 2 + 1);
  constexpr F lo = (F)std::numeric_limits<I>::min();  // 0 or -2^(bits-1), exact in F
  if (x != x) return 0;
  if (x >= hi) return std::numeric_limits<I>::max();
  if (x < lo) return std::numeric_limits<I>::min();  // (lo - 1, lo) truncates to lo too
  return (I)x;
}

// Load a storage value as its compute type, and store a compute value (rounding once).
inline float load(f16 x) { return f16_to_f32(x.bits); }
inline float load(bf16 x) { return bf16_to_f32(x.bits); }
inline int32_t load(b8 x) { return x.v != 0; }
inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline int32_t load(int32_t x) { return x; }
inline uint8_t load(uint8_t x) { return x; }
inline int8_t load(int8_t x) { return x; }
inline int64_t load(int64_t x) { return x; }

template <class S> inline S store(compute_t<S> x) { return (S)x; }
template <> inline f16 store<f16>(float x) { return f16{f32_to_f16(x)}; }
template <> inline bf16 store<bf16>(float x) { return bf16{f32_to_bf16(x)}; }
template <> inline b8 store<b8>(int32_t x) { return b8{(uint8_t)(x != 0)}; }

// --- buffers --------------------------------------------------------------------------------

// A flat typed buffer: 64-byte aligned memory the Array owns, or memory of a Python object
// (a numpy array passed to wrap()) that `owner` keeps alive.
struct Array {
  void* data = nullptr;
  int64_t size = 0;
  DType dtype = DType::f32;
  bool owned = false;
  nb::object owner;

  Array(int64_t size, const std::string& dtype);
  Array(void* data, int64_t size, DType dtype, nb::object owner);
  ~Array();
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;

  template <class T> T* as() const { return static_cast<T*>(data); }
};

// Aligned allocation; large blocks are advised to use transparent huge pages (as numpy does).
void* aligned_alloc_bytes(size_t bytes);
void aligned_free(void* p);
// The pool of freed large buffers (runtime.cc): free them all, and their bytes.
void pool_empty();
size_t pool_cached_bytes();

// A scratch buffer for kernels (never shared with Python).
template <class T> struct Scratch {
  T* p = nullptr;
  explicit Scratch(size_t n) : p(static_cast<T*>(aligned_alloc_bytes(n * sizeof(T) + 64))) {
    if (!p) throw std::bad_alloc();
  }
  ~Scratch() { aligned_free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// --- errors -----------------------------------------------------------------------------------
// Raise needle.errors.<cls>(msg). Only with the GIL held: kernels validate before releasing it.
[[noreturn]] void raise(const char* cls, const std::string& msg);

[[noreturn]] void unsupported(const char* op, DType dt);  // DTypeError: op has no dt kernel

// Stable kernel names ({op}_{dtype}) of every instantiation, for tracing and tests.
void register_kernel(const std::string& name);
const std::vector<std::string>& kernel_names();

void check_dtype(const Array& a, DType dt, const char* fn, const char* what);
void check_same_dtype(const Array& a, const Array& b, const char* fn);
void check_size(const Array& a, int64_t n, const char* fn, const char* what);

// Call f(Tag<S>{}) with S the storage type of dt.
template <class T> struct Tag { using type = T; };

template <class F> decltype(auto) dispatch_all(DType dt, F&& f) {
  switch (dt) {
    case DType::f16: return f(Tag<f16>{});
    case DType::bf16: return f(Tag<bf16>{});
    case DType::f64: return f(Tag<double>{});
    case DType::i32: return f(Tag<int32_t>{});
    case DType::i64: return f(Tag<int64_t>{});
    case DType::b8: return f(Tag<b8>{});
    case DType::u8: return f(Tag<uint8_t>{});
    case DType::i8: return f(Tag<int8_t>{});
    case DType::f32: break;
  }
  return f(Tag<float>{});
}

// The instantiations of one templated kernel, one per dtype it supports, each registered under
// its stable name "{op}_{dtype}" (ewise_add_f32, reduce_sum_bf16, ...). `make(Tag<S>{})`
// returns the instantiation for storage type S, or nullptr where the op has no such kernel.
template <class Fn> class KernelTable {
 public:
  template <class Make> KernelTable(const char* op, Make&& make) : op_(op) {
    for (int i = 0; i < kNumDTypes; ++i) {
      const DType dt = (DType)i;
      fns_[i] = dispatch_all(dt, [&](auto tag) -> Fn { return make(tag); });
      if (fns_[i]) register_kernel(std::string(op) + "_" + dtype_short(dt));
    }
  }
  // The kernel for dt; raises DTypeError (GIL held) when there is none.
  Fn operator[](DType dt) const {
    if (!fns_[(int)dt]) unsupported(op_, dt);
    return fns_[(int)dt];
  }

 private:
  const char* op_;
  Fn fns_[kNumDTypes] = {};
};

// A Python scalar (int, float, bool, numpy scalar) as a double or an int64, converted as
// numpy converts it when it assigns the scalar to an array (floats to ints truncate).
double scalar_as_double(nb::handle value);
int64_t scalar_as_int(nb::handle value);

// --- threading ------------------------------------------------------------------------------

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// A non-owning reference to a callable, so that the OpenMP regions below are compiled once
// instead of once per kernel instantiation.
template <class... Args> struct FnRef {
  void (*call)(const void*, Args...);
  const void* obj;
  template <class F> FnRef(const F& f)  // NOLINT: implicit on purpose
      : call([](const void* o, Args... args) { (*static_cast<const F*>(o))(args...); }),
        obj(&f) {}
  void operator()(Args... args) const { call(obj, args...); }
};

// An exception must not leave an OpenMP region (it would terminate the process): run() keeps
// the first one, rethrow() raises it on the calling thread after the region.
class ExceptionGuard {
 public:
  template <class F> void run(F&& f) noexcept {
    try {
      f();
    } catch (...) {
#ifdef _OPENMP
#pragma omp critical(needle_exception_guard)
#endif
      if (!error_) error_ = std::current_exception();
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
};

// Split [0, n) into chunks (aligned to 64 elements, at least `grain` long) and call
// f(begin, end) on each across threads; below `grain` elements per thread the call stays on
// this thread, because waking the pool costs more than it saves.
void parallel_for(int64_t n, int64_t grain, FnRef<int64_t, int64_t> f);

// f(i) for i in [0, n), dynamically scheduled across threads when n * cost (elements touched)
// is worth it.
void parallel_items(int64_t n, int64_t cost, FnRef<int64_t> f);

// --- streaming stores ------------------------------------------------------------------------
// An output much larger than the caches is written with non-temporal stores where the ISA has
// them (x86): they skip the read-for-ownership of every line, a quarter of the memory traffic
// of a binary op. Elsewhere stream_copy is a memcpy.

constexpr size_t kStreamBytes = size_t(16) << 20;

inline void stream_copy(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__)
  constexpr size_t V = 64;
#elif defined(__AVX__)
  constexpr size_t V = 32;
#elif defined(__SSE2__)
  constexpr size_t V = 16;
#else
  constexpr size_t V = 0;
#endif
  if constexpr (V > 0) {
    const size_t head = std::min(bytes, (V - ((uintptr_t)d & (V - 1))) & (V - 1));
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    for (; bytes >= V; bytes -= V, d += V, s += V) {
#if defined(__AVX512F__)
      _mm512_stream_si512((__m512i*)d, _mm512_loadu_si512((const void*)s));
#elif defined(__AVX__)
      _mm256_stream_si256((__m256i*)d, _mm256_loadu_si256((const __m256i*)s));
#elif defined(__SSE2__)
      _mm_stream_si128((__m128i*)d, _mm_loadu_si128((const __m128i*)s));
#endif
    }
  }
  std::memcpy(d, s, bytes);
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Write out[0..n) across threads: fill(lo, hi, dst) computes elements [lo, hi) into dst[0..).
// Large outputs are computed tile by tile into an L1-sized buffer and streamed to memory.
template <class O, class F> void produce(O* out, int64_t n, int64_t grain, F&& fill) {
  if ((size_t)n * sizeof(O) < kStreamBytes) {
    parallel_for(n, grain, [&](int64_t lo, int64_t hi) { fill(lo, hi, out + lo); });
    return;
  }
  parallel_for(n, grain, [&](int64_t lo, int64_t hi) {
    constexpr int64_t kTile = 1024 / (int64_t)sizeof(O);  // larger tiles measured slower
    alignas(64) O tile[kTile];
    for (int64_t t = lo; t < hi; t += kTile) {
      const int64_t e = std::min(hi, t + kTile);
      fill(t, e, tile);
      stream_copy(out + t, tile, (size_t)(e - t) * sizeof(O));
    }
    stream_fence();
  });
}

// Run f() with the GIL released (kernels touch no Python objects).
template <class F> void without_gil(F&& f) {
  nb::gil_scoped_release release;
  f();
}

// --- registration -----------------------------------------------------------------------------

void bind_memory(nb::module_& m);
void bind_elementwise(nb::module_& m);
void bind_reduce(nb::module_& m);
void bind_matmul(nb::module_& m);
void bind_nn(nb::module_& m);


// The first position a query at p attends to: 0, or with a sliding window (> 0) the window's
// first (the attention kernels' decode and paged forms)
inline int64_t window_start(int64_t p, int64_t window) {
  return window > 0 && p >= window ? p - window + 1 : 0;
}

// Gemma 2's soft-capped attention scores, cap * tanh(s / cap), after the scale; cap 0: s
template <class C> inline C soft_cap(C s, double cap) {
  return cap > 0 ? (C)cap * std::tanh(s / (C)cap) : s;
}

}  // namespace needle
