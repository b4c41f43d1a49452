// needle.backends.cuda._launch: cuLaunchKernel called from Python with nothing in between.
//
// An eager op's host time is bound by its launch: cuda-bindings' cuLaunchKernel wrapper
// spends ~3.5-3.9 us a call on an H100 host converting its arguments (ctypes calling the
// same symbol: ~4.7), torch's whole `a + b` ~6.3 (docs/cuda_notes.md, "Host time of an eager
// op"). This module takes the function, stream and argument-array addresses as integers and
// calls libcuda's cuLaunchKernel directly. It needs no CUDA headers or libraries at build
// time: libcuda (the driver, which cuda-bindings has loaded already) is opened at run time,
// so the module builds everywhere and says `available() == False` where there is no driver.
//
// `dispatch` goes one step further for the eager hot path: it takes the launch's buffers
// (objects with integer `handle` and `offset`) and its packed params struct as Python
// objects and writes the argument block here, instead of the queue packing it with struct
// and copying it into a ctypes block (~1.5 us of Python per launch on an H100 host). Its
// `raw` arguments (by-value structs after the params, e.g. the TMA GEMM's 128-byte tensor
// maps) are copied here too, each to a 64-byte boundary: before, a launch with them took
// the queue's Python path (~5 us of ctypes copies a launch on an H100 host; cuda_notes v29).
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>

#if defined(_WIN32)
#define NEEDLE_NO_DLOPEN 1
#else
#include <dlfcn.h>
#endif

namespace nb = nanobind;

namespace {
// CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ, blockDimX,
// blockDimY, blockDimZ, sharedMemBytes, CUstream hStream, void** kernelParams, void** extra)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
LaunchFn launch_fn = nullptr;
bool tried = false;

bool load() {
  if (!tried) {
    tried = true;
#ifndef NEEDLE_NO_DLOPEN
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // already loaded: reuse it
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != nullptr) launch_fn = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
#endif
  }
  return launch_fn != nullptr;
}

int launch(std::uintptr_t function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
           unsigned by, unsigned bz, unsigned shared, std::uintptr_t stream,
           std::uintptr_t argv) {
  if (!load()) return -1;  // not a CUresult: the caller checks available() first
  return launch_fn(reinterpret_cast<void*>(function), gx, gy, gz, bx, by, bz, shared,
                   reinterpret_cast<void*>(stream), reinterpret_cast<void**>(argv), nullptr);
}

// The argument block of dispatch(), per thread (the driver copies it during the launch, so
// the next launch may reuse it): slot i (8 bytes) holds buffer i's address, and the params
// struct starts at the slot after the last buffer, as in queue.py's own block.
constexpr std::size_t kSlots = 64;
constexpr int kTooLarge = -2;  // not a CUresult: the arguments exceed the block
constexpr std::size_t kRawBytes = 1024;  // raw arguments, each on a kRawAlign boundary
constexpr std::size_t kRawAlign = 64;    // CUtensorMap's alignment
struct ArgBlock {
  alignas(64) unsigned char bytes[8 * kSlots];
  alignas(kRawAlign) unsigned char raw[kRawBytes];
  void* argv[kSlots];
  void* raw_argv[kSlots];  // argv's fixed slots, then one pointer a raw argument
  ArgBlock() {
    for (std::size_t i = 0; i < kSlots; ++i) argv[i] = raw_argv[i] = bytes + 8 * i;
  }
};
thread_local ArgBlock block;

// Copies each bytes object of `raw` into block.raw and points the raw_argv slots after
// the first `fixed` at them. False when they do not fit (nothing launched then).
bool place_raw(PyObject* raw, std::size_t fixed) {
  PyObject* seq = PySequence_Fast(raw, "raw arguments must be a sequence of bytes");
  if (seq == nullptr) throw nb::python_error();
  Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::size_t offset = 0;
  bool fits = fixed + static_cast<std::size_t>(count) <= kSlots;
  // a raw launch with fewer fixed slots may have pointed these at raw copies
  for (std::size_t i = 0; fits && i < fixed; ++i) block.raw_argv[i] = block.bytes + 8 * i;
  for (Py_ssize_t i = 0; fits && i < count; ++i) {
    if (!PyBytes_Check(items[i])) {
      Py_DECREF(seq);
      throw nb::type_error("each raw argument must be a bytes object");
    }
    std::size_t size = static_cast<std::size_t>(PyBytes_GET_SIZE(items[i]));
    if (offset + size > kRawBytes) {
      fits = false;
      break;
    }
    std::memcpy(block.raw + offset, PyBytes_AS_STRING(items[i]), size);
    block.raw_argv[fixed + i] = block.raw + offset;
    offset += (size + kRawAlign - 1) / kRawAlign * kRawAlign;
  }
  Py_DECREF(seq);
  return fits;
}

std::uint64_t int_attr(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) throw nb::python_error();
  std::uint64_t v = PyLong_AsUnsignedLongLong(value);
  Py_DECREF(value);
  if (v == static_cast<std::uint64_t>(-1) && PyErr_Occurred()) throw nb::python_error();
  return v;
}

// The three entries of a (x, y, z) grid or group shape.
void dims(nb::handle shape, unsigned (&out)[3]) {
  PyObject* seq = PySequence_Fast(shape.ptr(), "a launch shape must be a sequence");
  if (seq == nullptr) throw nb::python_error();
  if (PySequence_Fast_GET_SIZE(seq) != 3) {
    Py_DECREF(seq);
    throw nb::value_error("a launch shape has three entries (x, y, z)");
  }
  bool too_large = false;
  for (int i = 0; i < 3; ++i) {
    unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    too_large |= v > 0xffffffffUL && !PyErr_Occurred();
    out[i] = static_cast<unsigned>(v);
  }
  Py_DECREF(seq);
  if (PyErr_Occurred()) throw nb::python_error();
  if (too_large) throw nb::value_error("a launch shape's entries must fit in 32 bits");
}

int dispatch(std::uintptr_t function, nb::handle groups, nb::handle threads, unsigned shared,
             std::uintptr_t stream, nb::handle buffers, nb::bytes params, nb::handle raw) {
  if (!load()) return -1;
  static PyObject* handle_name = PyUnicode_InternFromString("handle");
  static PyObject* offset_name = PyUnicode_InternFromString("offset");
  unsigned g[3], t[3];
  dims(groups, g);
  dims(threads, t);
  PyObject* seq = PySequence_Fast(buffers.ptr(), "buffers must be a sequence");
  if (seq == nullptr) throw nb::python_error();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::size_t nparams = params.size();
  if (8 * static_cast<std::size_t>(n) + nparams > sizeof(block.bytes)) {
    Py_DECREF(seq);
    return kTooLarge;
  }
  PyObject** items = PySequence_Fast_ITEMS(seq);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      std::uint64_t address = int_attr(items[i], handle_name) + int_attr(items[i], offset_name);
      std::memcpy(block.bytes + 8 * i, &address, 8);
    }
  } catch (...) {
    Py_DECREF(seq);
    throw;
  }
  Py_DECREF(seq);
  if (nparams) std::memcpy(block.bytes + 8 * n, params.c_str(), nparams);
  void** argv = block.argv;
  if (!raw.is_none()) {  // the raw arguments' slots follow the buffers' and the params'
    if (!place_raw(raw.ptr(), static_cast<std::size_t>(n) + (nparams ? 1 : 0))) {
      return kTooLarge;
    }
    argv = block.raw_argv;
  }
  return launch_fn(reinterpret_cast<void*>(function), g[0], g[1], g[2], t[0], t[1], t[2],
                   shared, reinterpret_cast<void*>(stream), argv, nullptr);
}
}  // namespace

NB_MODULE(_launch, m) {
  m.doc() = "cuLaunchKernel of libcuda, called directly (see launch.cc)";
  m.def("available", &load, "Whether libcuda's cuLaunchKernel could be found.");
  m.def("launch", &launch, nb::arg("function"), nb::arg("gx"), nb::arg("gy"), nb::arg("gz"),
        nb::arg("bx"), nb::arg("by"), nb::arg("bz"), nb::arg("shared"), nb::arg("stream"),
        nb::arg("argv"),
        "cuLaunchKernel(function, grid, block, shared bytes, stream, void** argv): the "
        "CUresult (0 on success).");
  m.def("dispatch", &dispatch, nb::arg("function"), nb::arg("groups"), nb::arg("threads"),
        nb::arg("shared"), nb::arg("stream"), nb::arg("buffers"), nb::arg("params"),
        nb::arg("raw").none() = nb::none(),
        "cuLaunchKernel(function, (gx, gy, gz), (bx, by, bz), shared bytes, stream, buffers, "
        "params, raw=None) with the argument block built here: each buffer's handle + offset "
        "in an 8-byte slot, then the params bytes; each bytes object of raw (by-value "
        "arguments after the params) copied to a 64-byte boundary of a 1,024-byte block. "
        "The CUresult (0 on success), -1 without a driver, -2 when the arguments exceed "
        "the 512-byte block or the raw ones theirs.");
  m.attr("BLOCK_BYTES") = 8 * kSlots;
  m.attr("RAW_BYTES") = kRawBytes;
}
