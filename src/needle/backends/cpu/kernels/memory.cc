// Memory and layout: the Array buffer, numpy interop (zero-copy where the contract says so),
// fill, and the strided copies behind compact / ewise_setitem / scalar_setitem.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <cstdlib>
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

// --- scalars ----------------------------------------------------------------------------------

double scalar_as_double(nb::handle value) {
  const double d = PyFloat_AsDouble(value.ptr());
  if (d == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return d;
}

int64_t scalar_as_int(nb::handle value) {
  if (!PyFloat_Check(value.ptr())) {
    PyObject* index = PyNumber_Index(value.ptr());
    if (index) {
      const long long v = PyLong_AsLongLong(index);
      Py_DECREF(index);
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
      return v;
    }
    PyErr_Clear();  // a float-like object (numpy floating scalar): truncate it below
  }
  return float_to_int<int64_t>(scalar_as_double(value));
}

// `value` as an 8-bit integer, as numpy's `array.fill(value)` converts it: a Python int out of
// range is an OverflowError, a float truncates and saturates (float_to_int).
template <class I> static I small_int(nb::handle value) {
  const bool is_int = !PyFloat_Check(value.ptr()) && PyIndex_Check(value.ptr());
  if (!is_int) return float_to_int<I>(scalar_as_double(value));
  const int64_t v = scalar_as_int(value);
  if (v < std::numeric_limits<I>::min() || v > std::numeric_limits<I>::max()) {
    PyErr_Format(PyExc_OverflowError, "Python integer %lld out of bounds for %s", (long long)v,
                 std::is_signed_v<I> ? "int8" : "uint8");
    throw nb::python_error();
  }
  return (I)v;
}

// `value` converted to the storage bits of dt, as numpy's `array.fill(value)` converts it.
static uint64_t scalar_bits(DType dt, nb::handle value) {
  uint64_t bits = 0;
  auto put = [&](auto v) { std::memcpy(&bits, &v, sizeof(v)); };
  switch (dt) {
    case DType::f32: put((float)scalar_as_double(value)); break;
    case DType::f64: put(scalar_as_double(value)); break;
    case DType::f16: put(f64_to_f16(scalar_as_double(value))); break;
    case DType::bf16: put(f32_to_bf16((float)scalar_as_double(value))); break;
    case DType::b8: {
      const int truth = PyObject_IsTrue(value.ptr());
      if (truth < 0) throw nb::python_error();
      put((uint8_t)truth);
      break;
    }
    case DType::i32: {
      const bool is_int = !PyFloat_Check(value.ptr()) && PyIndex_Check(value.ptr());
      const int64_t v = scalar_as_int(value);
      if (is_int && (v < INT32_MIN || v > INT32_MAX)) {
        PyErr_Format(PyExc_OverflowError, "Python integer %lld out of bounds for int32",
                     (long long)v);
        throw nb::python_error();
      }
      put(is_int ? (int32_t)v : float_to_int<int32_t>(scalar_as_double(value)));
      break;
    }
    case DType::i64: put(scalar_as_int(value)); break;
    case DType::u8: put(small_int<uint8_t>(value)); break;
    case DType::i8: put(small_int<int8_t>(value)); break;
  }
  return bits;
}

// --- strided copies -----------------------------------------------------------------------------

// A strided view over one element size, simplified: size-1 dimensions dropped and dimensions
// merged where both sides are contiguous across them.
struct Walk {
  std::vector<int64_t> shape, dst, src;  // element strides
};

static Walk simplify(const std::vector<int64_t>& shape, const std::vector<int64_t>& dst,
                     const std::vector<int64_t>& src) {
  Walk w;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    if (!w.shape.empty() && w.dst.back() == dst[i] * shape[i] && w.src.back() == src[i] * shape[i]) {
      w.shape.back() *= shape[i];
      w.dst.back() = dst[i];
      w.src.back() = src[i];
      continue;
    }
    w.shape.push_back(shape[i]);
    w.dst.push_back(dst[i]);
    w.src.push_back(src[i]);
  }
  if (w.shape.empty()) {
    w.shape = {1};
    w.dst = {1};
    w.src = {1};
  }
  return w;
}

// Copy `rows` rows (all dims but the last) starting at row `first`; src stride 0 in every
// dimension makes this a fill.
template <class T>
static void copy_rows(const Walk& w, T* dst, const T* src, int64_t first, int64_t rows) {
  const int nd = (int)w.shape.size();
  const int64_t n = w.shape[nd - 1], ds = w.dst[nd - 1], ss = w.src[nd - 1];
  std::vector<int64_t> idx(nd, 0);
  int64_t r = first, doff = 0, soff = 0;
  for (int d = nd - 2; d >= 0; --d) {
    idx[d] = r % w.shape[d];
    r /= w.shape[d];
    doff += idx[d] * w.dst[d];
    soff += idx[d] * w.src[d];
  }
  for (int64_t row = 0; row < rows; ++row) {
    T* __restrict o = dst + doff;
    const T* __restrict s = src + soff;
    if (ds == 1 && ss == 1) {
      std::memcpy(o, s, n * sizeof(T));
    } else if (ds == 1 && ss == 0) {
      std::fill(o, o + n, *s);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i * ds] = s[i * ss];
    }
    for (int d = nd - 2; d >= 0; --d) {  // advance the multi-index of the outer dims
      doff += w.dst[d];
      soff += w.src[d];
      if (++idx[d] < w.shape[d]) break;
      doff -= w.dst[d] * w.shape[d];
      soff -= w.src[d] * w.shape[d];
      idx[d] = 0;
    }
  }
}

// A transpose-like copy (the source runs contiguously along the second-to-last dimension):
// copy in 32x32 tiles so that both sides stay in cache.
template <class T>
static void copy_tiled(const Walk& w, T* dst, const T* src, int64_t first, int64_t count) {
  const int nd = (int)w.shape.size();
  const int64_t R = w.shape[nd - 2], C = w.shape[nd - 1];
  const int64_t dr = w.dst[nd - 2], dc = w.dst[nd - 1], sr = w.src[nd - 2], sc = w.src[nd - 1];
  const int64_t tiles_c = (C + 31) / 32, tiles = (R + 31) / 32 * tiles_c;
  for (int64_t t = first; t < first + count; ++t) {
    int64_t mat = t / tiles, tile = t % tiles, doff = 0, soff = 0;
    for (int d = nd - 3; d >= 0; --d) {
      const int64_t i = mat % w.shape[d];
      mat /= w.shape[d];
      doff += i * w.dst[d];
      soff += i * w.src[d];
    }
    const int64_t r0 = tile / tiles_c * 32, c0 = tile % tiles_c * 32;
    const int64_t r1 = std::min(R, r0 + 32), c1 = std::min(C, c0 + 32);
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = r0; r < r1; ++r) dst[doff + r * dr + c * dc] = src[soff + r * sr + c * sc];
  }
}

template <class T> static void strided_copy(const Walk& w, T* dst, const T* src) {
  const int nd = (int)w.shape.size();
  int64_t total = 1;
  for (int64_t s : w.shape) total *= s;
  const int64_t last = w.shape[nd - 1];
  if (nd >= 2 && std::llabs(w.src[nd - 1]) > 1 && std::llabs(w.src[nd - 2]) == 1 &&
      w.shape[nd - 2] >= 8 && last >= 8) {
    const int64_t tiles = total / (w.shape[nd - 1] * w.shape[nd - 2]) *
                          ((w.shape[nd - 2] + 31) / 32) * ((last + 31) / 32);
    parallel_for(tiles, std::max<int64_t>(1, (1 << 16) / 1024),
                 [&](int64_t lo, int64_t hi) { copy_tiled(w, dst, src, lo, hi - lo); });
    return;
  }
  const int64_t rows = total / last;
  parallel_for(rows, std::max<int64_t>(1, (1 << 16) / last),
               [&](int64_t lo, int64_t hi) { copy_rows(w, dst, src, lo, hi - lo); });
}

static void copy_bytes(size_t item, const Walk& w, void* dst, const void* src) {
  switch (item) {
    case 1: return strided_copy(w, (uint8_t*)dst, (const uint8_t*)src);
    case 2: return strided_copy(w, (uint16_t*)dst, (const uint16_t*)src);
    case 4: return strided_copy(w, (uint32_t*)dst, (const uint32_t*)src);
    default: return strided_copy(w, (uint64_t*)dst, (const uint64_t*)src);
  }
}

static std::vector<int64_t> compact_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    s[i] = stride;
    stride *= shape[i];
  }
  return s;
}

// Check a strided view against its buffer; returns its element count.
static int64_t check_view(const Array& a, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides, int64_t offset, const char* fn) {
  if (shape.size() != strides.size())
    raise("ShapeError", std::string(fn) + ": shape has " + std::to_string(shape.size()) +
                            " dimensions but strides has " + std::to_string(strides.size()));
  int64_t count = 1, lo = offset, hi = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) raise("ShapeError", std::string(fn) + ": negative dimension in shape");
    count *= shape[i];
    if (shape[i] > 0) (strides[i] < 0 ? lo : hi) += strides[i] * (shape[i] - 1);
  }
  if (count > 0 && (lo < 0 || hi >= a.size))
    raise("IndexOutOfRangeError", std::string(fn) + ": the view (offset " +
                                      std::to_string(offset) + ") reaches elements " +
                                      std::to_string(lo) + ".." + std::to_string(hi) +
                                      " of a buffer of " + std::to_string(a.size));
  return count;
}

static void compact(const Array& a, Array& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  const int64_t count = check_view(a, shape, strides, offset, "compact");
  check_same_dtype(a, out, "compact");
  check_size(out, count, "compact", "out");
  if (!count) return;
  const Walk w = simplify(shape, compact_strides(shape), strides);
  const size_t item = dtype_size(a.dtype);
  without_gil([&] { copy_bytes(item, w, out.data, (const char*)a.data + offset * item); });
}

static void ewise_setitem(const Array& a, Array& out, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides, int64_t offset) {
  const int64_t count = check_view(out, shape, strides, offset, "ewise_setitem");
  check_same_dtype(a, out, "ewise_setitem");
  check_size(a, count, "ewise_setitem", "a");
  if (!count) return;
  const Walk w = simplify(shape, strides, compact_strides(shape));
  const size_t item = dtype_size(a.dtype);
  without_gil([&] { copy_bytes(item, w, (char*)out.data + offset * item, a.data); });
}

static void scalar_setitem(int64_t size, nb::handle value, Array& out,
                           const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                           int64_t offset) {
  const int64_t count = check_view(out, shape, strides, offset, "scalar_setitem");
  if (size != count)
    raise("ShapeError", "scalar_setitem: size " + std::to_string(size) +
                            " does not match the view's " + std::to_string(count) + " elements");
  const uint64_t bits = scalar_bits(out.dtype, value);
  if (!count) return;
  const Walk w = simplify(shape, strides, std::vector<int64_t>(shape.size(), 0));
  const size_t item = dtype_size(out.dtype);
  without_gil([&] { copy_bytes(item, w, (char*)out.data + offset * item, &bits); });
}

static void fill(Array& out, nb::handle value) {
  const uint64_t bits = scalar_bits(out.dtype, value);
  const Walk w = simplify({out.size}, {1}, {0});
  const size_t item = dtype_size(out.dtype);
  if (out.size) without_gil([&] { copy_bytes(item, w, out.data, &bits); });
}

// --- numpy interop --------------------------------------------------------------------------------

static nb::object numpy() { return nb::module_::import_("numpy"); }

// A 1-d numpy array over the buffer of the Array object `self`, which it keeps alive.
static nb::object host_view(nb::handle self) {
  Array& a = nb::cast<Array&>(self);
  const size_t shape[1] = {(size_t)a.size};
  nb::dlpack::dtype dt;
  switch (a.dtype) {
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::f64: dt = nb::dtype<double>(); break;
    case DType::i32: dt = nb::dtype<int32_t>(); break;
    case DType::i64: dt = nb::dtype<int64_t>(); break;
    case DType::b8: dt = nb::dtype<bool>(); break;
    case DType::u8: dt = nb::dtype<uint8_t>(); break;
    case DType::i8: dt = nb::dtype<int8_t>(); break;
    case DType::f16: dt = {(uint8_t)nb::dlpack::dtype_code::Float, 16, 1}; break;
    case DType::bf16: dt = nb::dtype<uint16_t>(); break;  // numpy has no bfloat16 code
  }
  nb::object view = nb::ndarray<nb::numpy>(a.data, 1, shape, self, nullptr, dt).cast();
  if (a.dtype == DType::bf16)
    view = view.attr("view")(nb::module_::import_("ml_dtypes").attr("bfloat16"));
  return view;
}

static Array* wrap(nb::object flat, const std::string& dtype) {
  const DType dt = parse_dtype(dtype);
  nb::object np = numpy();
  if (!nb::isinstance(flat, np.attr("ndarray")) || nb::cast<int>(flat.attr("ndim")) != 1)
    raise("ShapeError", "wrap needs a 1-d numpy array");
  const int64_t n = nb::cast<int64_t>(flat.attr("size"));
  const int64_t item = nb::cast<int64_t>(flat.attr("itemsize"));
  const int64_t stride = nb::cast<int64_t>(flat.attr("strides")[0]);
  if (item != (int64_t)dtype_size(dt) || (n > 1 && stride != item))
    raise("DTypeError", "wrap needs a contiguous array of " + std::string(dtype_name(dt)) +
                            "-sized elements");
  nb::object data = flat.attr("__array_interface__")["data"][0];
  return new Array((void*)nb::cast<uintptr_t>(data), n, dt, flat);
}

static void from_numpy(nb::handle a, nb::handle out) {
  nb::object src = numpy().attr("ascontiguousarray")(a).attr("reshape")(-1);
  host_view(out).attr("__setitem__")(nb::ellipsis(), src);
}

static nb::object to_numpy(const Array& a, const std::vector<int64_t>& shape,
                           const std::vector<int64_t>& strides, int64_t offset) {
  const int64_t count = check_view(a, shape, strides, offset, "to_numpy");
  nb::object result = nb::cast(new Array(count, dtype_name(a.dtype)), nb::rv_policy::take_ownership);
  compact(a, nb::cast<Array&>(result), shape, strides, offset);
  return host_view(result).attr("reshape")(nb::tuple(nb::cast(shape)));
}

void bind_memory(nb::module_& m) {
  nb::class_<Array>(m, "Array", "A flat, 64-byte aligned buffer of `size` elements of `dtype`.")
      .def(nb::init<int64_t, const std::string&>(), nb::arg("size"), nb::arg("dtype") = "float32")
      .def_prop_ro("size", [](const Array& a) { return a.size; })
      .def_prop_ro("dtype", [](const Array& a) { return dtype_name(a.dtype); })
      .def_prop_ro("ptr", [](const Array& a) { return (uintptr_t)a.data; })
      .def("__repr__", [](const Array& a) {
        return "Array(size=" + std::to_string(a.size) + ", dtype=" + dtype_name(a.dtype) + ")";
      });
  m.def("wrap", &wrap, nb::arg("flat"), nb::arg("dtype"), nb::rv_policy::take_ownership,
        "An Array sharing the memory of the 1-d numpy array `flat` (kept alive by it).");
  m.def("host_view", &host_view, nb::arg("a"),
        "A 1-d numpy array aliasing the buffer (zero-copy).");
  m.def("from_numpy", &from_numpy, nb::arg("a"), nb::arg("out"));
  m.def("to_numpy", &to_numpy, nb::arg("a"), nb::arg("shape"), nb::arg("strides"),
        nb::arg("offset"));
  m.def("fill", &fill, nb::arg("out"), nb::arg("value"));
  m.def("synchronize", [] {}, "Kernels run synchronously on the calling thread; nothing waits.");
  m.def("empty_cache", &pool_empty, "Free the large buffers kept for reuse by later Arrays.");
  m.def("cached_bytes", &pool_cached_bytes, "Bytes of freed large buffers kept for reuse.");
  m.def("compact", &compact, nb::arg("a"), nb::arg("out"), nb::arg("shape"), nb::arg("strides"),
        nb::arg("offset"));
  m.def("ewise_setitem", &ewise_setitem, nb::arg("a"), nb::arg("out"), nb::arg("shape"),
        nb::arg("strides"), nb::arg("offset"));
  m.def("scalar_setitem", &scalar_setitem, nb::arg("size"), nb::arg("value"), nb::arg("out"),
        nb::arg("shape"), nb::arg("strides"), nb::arg("offset"));
  m.def("kernels", [] { return kernel_names(); },
        "Stable names ({op}_{dtype}) of every kernel instantiation in the extension.");
}

}  // namespace needle
