// The runtime every kernel family uses: dtypes and their names, the Array buffer and its
// pool of large buffers, the errors raised to Python, the thread pool (parallel_for), and
// the kernel registry.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <new>

#include "common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace needle {

// --- dtypes ---------------------------------------------------------------------------------

static const char* const kNames[kNumDTypes] = {"float32", "float16", "bfloat16",
                                               "float64", "int32",   "int64",
                                               "bool",    "uint8",   "int8"};
static const char* const kShort[kNumDTypes] = {"f32", "f16", "bf16", "f64", "i32",
                                               "i64", "b8",  "u8",   "i8"};
static const size_t kSizes[kNumDTypes] = {4, 2, 2, 8, 4, 8, 1, 1, 1};

const char* dtype_name(DType dt) { return kNames[(int)dt]; }
const char* dtype_short(DType dt) { return kShort[(int)dt]; }
size_t dtype_size(DType dt) { return kSizes[(int)dt]; }

DType parse_dtype(const std::string& name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (name == kNames[i]) return (DType)i;
  raise("DTypeError", "unknown dtype '" + name +
                          "'; use one of float32, float16, bfloat16, float64, uint8, int8, int32, int64, "
                          "bool");
}

// numpy's npy_doublebits_to_halfbits: round to nearest even directly from double.
uint16_t f64_to_f16(double d) {
  uint64_t x;
  std::memcpy(&x, &d, 8);
  const uint16_t sign = (uint16_t)((x >> 48) & 0x8000u);
  const uint64_t exp = x & 0x7ff0000000000000ull;
  uint64_t sig = x & 0x000fffffffffffffull;
  if (exp >= 0x40f0000000000000ull) {  // overflow, inf or NaN
    if (exp == 0x7ff0000000000000ull && sig != 0) {
      uint16_t r = (uint16_t)(0x7c00u + (sig >> 42));
      return sign | (r == 0x7c00u ? 0x7c01u : r);
    }
    return sign | 0x7c00u;
  }
  if (exp <= 0x3f00000000000000ull) {  // subnormal half or zero
    if (exp < 0x3e60000000000000ull) return sign;
    sig = (0x0010000000000000ull + sig) << ((exp >> 52) - 998);
    if ((sig & 0x003fffffffffffffull) != 0x0010000000000000ull) sig += 0x0010000000000000ull;
    return sign | (uint16_t)(sig >> 53);  // a carry into the exponent is the right answer
  }
  const uint16_t h_exp = (uint16_t)((exp - 0x3f00000000000000ull) >> 42);
  if ((sig & 0x000007ffffffffffull) != 0x0000020000000000ull) sig += 0x0000020000000000ull;
  return sign | (uint16_t)(h_exp + (uint16_t)(sig >> 42));  // a carry may round up to inf
}

// --- memory ---------------------------------------------------------------------------------

void* aligned_alloc_bytes(size_t bytes) {
  const size_t huge = size_t(2) << 20;
  const size_t align = bytes >= 2 * huge ? huge : 64;
  void* p = nullptr;
  if (posix_memalign(&p, align, std::max<size_t>(bytes, 64)) != 0) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == huge) madvise(p, bytes / huge * huge, MADV_HUGEPAGE);
#endif
  return p;
}

void aligned_free(void* p) { std::free(p); }

// Large buffers are kept after an Array dies and handed to the next Array of the same
// rounded size. A fresh multi-megabyte buffer costs a page fault per 4 KiB on first touch,
// which for a 16M-element add is most of its time; a reused one is already mapped. Only
// Array construction and destruction use the pool, and both run holding the GIL.
namespace {
constexpr size_t kPoolMin = size_t(1) << 20;     // smaller buffers come from malloc's own bins
constexpr size_t kPoolGranule = size_t(1) << 16;
std::multimap<size_t, void*> g_pool;             // rounded size -> free buffer
size_t g_pool_bytes = 0;

size_t pool_limit() {
  static const size_t limit = [] {
    const char* env = std::getenv("NEEDLE_CPU_POOL_MB");
    return (env ? (size_t)std::strtoull(env, nullptr, 10) : 1024) << 20;
  }();
  return limit;
}

size_t pool_round(size_t bytes) { return (bytes + kPoolGranule - 1) / kPoolGranule * kPoolGranule; }

void* pool_take(size_t bytes) {
  if (bytes < kPoolMin) return aligned_alloc_bytes(bytes);
  auto it = g_pool.find(pool_round(bytes));
  if (it == g_pool.end()) return aligned_alloc_bytes(pool_round(bytes));
  void* p = it->second;
  g_pool_bytes -= it->first;
  g_pool.erase(it);
  return p;
}

void pool_give(void* p, size_t bytes) {
  if (bytes < kPoolMin) return aligned_free(p);
  const size_t rounded = pool_round(bytes);
  if (g_pool_bytes + rounded > pool_limit()) return aligned_free(p);
  g_pool.emplace(rounded, p);
  g_pool_bytes += rounded;
}
}  // namespace

size_t pool_cached_bytes() { return g_pool_bytes; }

void pool_empty() {
  for (auto& kv : g_pool) aligned_free(kv.second);
  g_pool.clear();
  g_pool_bytes = 0;
}

Array::Array(int64_t n, const std::string& dt) : size(n), dtype(parse_dtype(dt)), owned(true) {
  if (n < 0) raise("ShapeError", "Array size must be >= 0, got " + std::to_string(n));
  const size_t bytes = (size_t)n * dtype_size(dtype);
  if ((size_t)n > (SIZE_MAX >> 4) || !(data = pool_take(bytes)))
    raise("OutOfMemoryError", "could not allocate " + std::to_string(bytes) + " bytes for " +
                                  std::to_string(n) + " " + dt +
                                  " elements; free some arrays or use smaller ones");
}

Array::Array(void* p, int64_t n, DType dt, nb::object keep)
    : data(p), size(n), dtype(dt), owned(false), owner(std::move(keep)) {}

Array::~Array() {
  if (owned) pool_give(data, (size_t)size * dtype_size(dtype));
}

// --- errors and checks --------------------------------------------------------------------------

void raise(const char* cls, const std::string& msg) {
  nb::object type = nb::module_::import_("needle.errors").attr(cls);
  PyErr_SetString(type.ptr(), msg.c_str());
  throw nb::python_error();
}

void unsupported(const char* op, DType dt) {
  raise("DTypeError", std::string(op) + " has no " + dtype_name(dt) +
                          " kernel on the cpu backend; cast the input first");
}

void check_dtype(const Array& a, DType dt, const char* fn, const char* what) {
  if (a.dtype != dt)
    raise("DTypeError", std::string(fn) + ": " + what + " must be " + dtype_name(dt) +
                            ", got " + dtype_name(a.dtype));
}

void check_same_dtype(const Array& a, const Array& b, const char* fn) {
  if (a.dtype != b.dtype)
    raise("DTypeError", std::string(fn) + " needs buffers of one dtype, got " +
                            dtype_name(a.dtype) + " and " + dtype_name(b.dtype) +
                            " (NDArray promotes before calling the backend)");
}

void check_size(const Array& a, int64_t n, const char* fn, const char* what) {
  if (a.size != n)
    raise("ShapeError", std::string(fn) + ": " + what + " has " + std::to_string(a.size) +
                            " elements, expected " + std::to_string(n));
}

// --- threading ------------------------------------------------------------------------------

void parallel_for(int64_t n, int64_t grain, FnRef<int64_t, int64_t> f) {
  const int64_t nt = std::min<int64_t>(max_threads(), n / std::max<int64_t>(grain, 1));
  if (nt <= 1) {
    if (n > 0) f(0, n);
    return;
  }
#ifdef _OPENMP
  // About eight chunks per thread, handed out dynamically: a thread that the OS preempts
  // (other processes on the machine) delays the call by one chunk, not by half the work.
  const int64_t chunk = std::max(grain, ((n + nt * 8 - 1) / (nt * 8) + 63) / 64 * 64);
  const int64_t chunks = (n + chunk - 1) / chunk;
  ExceptionGuard guard;
#pragma omp parallel for num_threads((int)nt) schedule(dynamic, 1)
  for (int64_t i = 0; i < chunks; ++i) guard.run([&] { f(i * chunk, std::min(n, (i + 1) * chunk)); });
  guard.rethrow();
#endif
}

void parallel_items(int64_t n, int64_t cost, FnRef<int64_t> f) {
  // no more threads than items, nor than work for (a thread per 2^15 elements touched)
  const int64_t nt = std::min<int64_t>({(int64_t)max_threads(), n, n * cost >> 15});
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#ifdef _OPENMP
  ExceptionGuard guard;
#pragma omp parallel for num_threads((int)nt) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) guard.run([&] { f(i); });
  guard.rethrow();
#endif
}

std::vector<std::string>& registry() {
  static std::vector<std::string> names;
  return names;
}
void register_kernel(const std::string& name) { registry().push_back(name); }
const std::vector<std::string>& kernel_names() { return registry(); }

}  // namespace needle
