"""Pipeline thread limits derived from the kernel (tests/metal_emulator/harness.py,
``derived_thread_limit``; docs/metal.md, "Pipeline thread limits"): a pipeline reports the
``maxTotalThreadsPerThreadgroup`` that the emulator's register model gives its kernel, capped by
``[[max_total_threads_per_threadgroup(N)]]``, unless a test replaces it.

These need clang++ only, not ``NEEDLE_METAL_EMULATOR=1``.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.metal_emulator import fake_metal, harness

pytestmark = pytest.mark.skipif(shutil.which(harness.compiler()) is None,
                                reason="the MSL emulator needs clang++")

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

kernel void light(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] += 1.0f;
}

[[max_total_threads_per_threadgroup(96)]]
kernel void capped(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] += 1.0f;
}

// 512 floats a thread, indexed at run time: far more than a thread's registers at 1024 threads
kernel void heavy(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  float acc[512];
  for (uint k = 0; k < 512; k++) acc[k] = x[(i + k * 7) & 1023];
  float s = 0.0f;
  for (uint k = 0; k < 512; k++) s += acc[(k * 13 + i) & 511] * float(k);
  out[i] = s;
}

// the same in a helper: helpers are inlined into their kernel, as a GPU compiler does
inline float gather(device const float* x, uint i) {
  float acc[512];
  for (uint k = 0; k < 512; k++) acc[k] = x[(i + k * 7) & 1023];
  float s = 0.0f;
  for (uint k = 0; k < 512; k++) s += acc[(k * 13 + i) & 511] * float(k);
  return s;
}

kernel void heavy_helper(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  out[i] = gather(x, i);
}

template <class T>
[[max_total_threads_per_threadgroup(64)]]
kernel void capped_template(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = T(1);
}
template [[host_name("capped_f32")]] [[kernel]] decltype(capped_template<float>)
    capped_template<float>;
"""


@pytest.fixture(scope="module")
def lib():
    return harness.build(SOURCE)


def test_the_register_model():
    """384 KiB of registers shared by the threadgroup, a thread needing its stack frame plus
    128 bytes; multiples of 32 from 32 to 1024, capped by the attribute."""
    assert harness.derived_thread_limit(0) == 1024
    assert harness.derived_thread_limit(256) == 1024  # 384 KiB / 384 B
    assert harness.derived_thread_limit(1024) == 320  # 341 threads fit, rounded down to 32s
    assert harness.derived_thread_limit(5000) == 64
    assert harness.derived_thread_limit(10**6) == 32  # never below one simd-group
    assert harness.derived_thread_limit(0, 96) == 96
    assert harness.derived_thread_limit(1024, 512) == 320


def test_light_kernels_get_the_device_limit(lib):
    assert lib.max_threads["light"] == 1024


def test_register_heavy_kernels_get_fewer_threads(lib):
    for name in ("heavy", "heavy_helper"):
        k = lib.kernels[name]
        assert k.frame_bytes >= 1024, (name, k.frame_bytes)  # the 512 floats are counted
        assert lib.max_threads[name] == harness.derived_thread_limit(k.frame_bytes)
        assert 32 <= lib.max_threads[name] <= 320 and lib.max_threads[name] % 32 == 0


def test_limits_do_not_depend_on_the_memory_checks(lib, monkeypatch):
    """Frames are measured on the code without the checks' hooks, whether or not the library
    runs with them."""
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_CHECKS", "none")
    unchecked = harness.build(SOURCE)
    assert unchecked.max_threads == lib.max_threads
    assert {k.name: k.frame_bytes for k in unchecked.kernels.values()} == \
        {k.name: k.frame_bytes for k in lib.kernels.values()}


def test_the_attribute_caps_the_limit(lib):
    assert lib.kernels["capped"].max_threads_attr == 96
    assert lib.max_threads["capped"] == 96
    assert lib.max_threads["capped_f32"] == 64  # on a template, for its instantiations


def test_an_attribute_out_of_range_does_not_compile():
    source = "#include <metal_stdlib>\n[[max_total_threads_per_threadgroup(2048)]]\n" \
             "kernel void k(device float* out [[buffer(0)]]) { out[0] = 1.0f; }\n"
    with pytest.raises(harness.MSLCompileError, match="from 1 to 1024"):
        harness.build(source)


def _pipeline(name, limits=None, monkeypatch=None):
    if limits is not None:
        monkeypatch.setattr(fake_metal, "pipeline_limits", limits)
    device = fake_metal.MTLCreateSystemDefaultDevice()
    options = fake_metal.MTLCompileOptions.new()
    library, error = device.newLibraryWithSource_options_error_(SOURCE, options, None)
    assert error is None, error
    pipeline, error = device.newComputePipelineStateWithFunction_error_(
        library.newFunctionWithName_(name), None)
    assert error is None, error
    return device, pipeline


def test_pipelines_report_the_derived_limit_and_refuse_more(lib, monkeypatch):
    monkeypatch.delenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", raising=False)
    device, pipeline = _pipeline("heavy")
    limit = pipeline.maxTotalThreadsPerThreadgroup()
    assert limit == lib.max_threads["heavy"] < 1024
    x = device.newBufferWithLength_options_(4 * 1024, 0)
    out = device.newBufferWithLength_options_(4 * 1024, 0)
    np.frombuffer(x.contents().as_buffer(4096), np.float32)[:] = np.arange(1024)
    for threads, refused in ((limit, False), (limit + 32, True)):
        enc = device.newCommandQueue().commandBuffer().computeCommandEncoder()
        enc.setComputePipelineState_(pipeline)
        enc.setBuffer_offset_atIndex_(x, 0, 0)
        enc.setBuffer_offset_atIndex_(out, 0, 1)
        size = fake_metal.MTLSizeMake
        if refused:
            with pytest.raises(fake_metal.MetalValidationError, match="exceeds the pipeline's"):
                enc.dispatchThreadgroups_threadsPerThreadgroup_(size(1, 1, 1),
                                                                size(threads, 1, 1))
        else:
            enc.dispatchThreadgroups_threadsPerThreadgroup_(size(1, 1, 1), size(threads, 1, 1))
        enc.endEncoding()


def test_tests_may_replace_the_derived_limit(monkeypatch):
    monkeypatch.delenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", raising=False)
    _, pipeline = _pipeline("light", {"light": 128}, monkeypatch)
    assert pipeline.maxTotalThreadsPerThreadgroup() == 128
    _, pipeline = _pipeline("capped", {"light": 128}, monkeypatch)
    assert pipeline.maxTotalThreadsPerThreadgroup() == 96
