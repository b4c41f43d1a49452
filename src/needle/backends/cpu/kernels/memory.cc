// Memory and layout: numpy interop (zero-copy where the contract says so), fill, and the
// strided copies behind compact / ewise_setitem / scalar_setitem (the Array buffer itself is
// runtime.cc's).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>

#include "common.h"

namespace needle {

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
