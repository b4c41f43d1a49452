// needle.backends.cuda._launch: cuLaunchKernel called from Python with nothing in between.
//
// An eager op's host time is bound by its launch: cuda-bindings' cuLaunchKernel wrapper
// spends ~3.5-3.9 us a call on an H100 host converting its arguments (ctypes calling the
// same symbol: ~4.7), torch's whole `a + b` ~6.3 (docs/cuda_notes.md, "Host time of an eager
// op"). This module takes the function, stream and argument-array addresses as integers and
// calls libcuda's cuLaunchKernel directly. It needs no CUDA headers or libraries at build
// time: libcuda (the driver, which cuda-bindings has loaded already) is opened at run time,
// so the module builds everywhere and says `available() == False` where there is no driver.
#include <nanobind/nanobind.h>

#include <cstdint>

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
}  // namespace

NB_MODULE(_launch, m) {
  m.doc() = "cuLaunchKernel of libcuda, called directly (see launch.cc)";
  m.def("available", &load, "Whether libcuda's cuLaunchKernel could be found.");
  m.def("launch", &launch, nb::arg("function"), nb::arg("gx"), nb::arg("gy"), nb::arg("gz"),
        nb::arg("bx"), nb::arg("by"), nb::arg("bz"), nb::arg("shared"), nb::arg("stream"),
        nb::arg("argv"),
        "cuLaunchKernel(function, grid, block, shared bytes, stream, void** argv): the "
        "CUresult (0 on success).");
}
