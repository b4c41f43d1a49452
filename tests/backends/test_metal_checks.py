"""The MSL emulator's memory checks (tests/metal_emulator/include/emulator_checks.h): planted
out-of-bounds accesses and data races fail their dispatch with a message naming the kernel,
the buffer or threadgroup array, the index and the threads; undefined shuffles give poison.

Kernels run through the fake Metal API (the backend's own path) or through needle's queue.
These need clang++ only, not ``NEEDLE_METAL_EMULATOR=1``.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.metal_emulator import fake_metal, harness

pytestmark = pytest.mark.skipif(shutil.which(harness.compiler()) is None,
                                reason="the MSL emulator needs clang++")

PLANTED = r"""
#include <metal_stdlib>
using namespace metal;

struct Shift { int by; };

// writes out[gid + by]: past the end when by > 0, before the start when negative
kernel void overrun(device float* out [[buffer(0)]], constant Shift& s [[buffer(1)]],
                    uint gid [[thread_position_in_grid]]) {
  out[int(gid) + s.by] = 1.0f;
}

kernel void over_read(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                      constant Shift& s [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = x[int(gid) + s.by];
}

// a threadgroup array indexed one past its end by the last thread
kernel void tg_overrun(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]],
                       uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[64];
  buf[t + (t == n - 1 ? 1 : 0)] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = buf[t];
}

kernel void dyn_overrun(device float* out [[buffer(0)]],
                        threadgroup float* smem [[threadgroup(0)]],
                        uint t [[thread_index_in_threadgroup]]) {
  smem[t + 4] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = smem[t];
}

// read-after-write through threadgroup memory: racy without the barrier
kernel void reverse_racy(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         uint t [[thread_index_in_threadgroup]],
                         uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[t] = x[t];
  out[t] = buf[n - 1 - t];
}

// write-after-read: every thread reads a neighbour, then overwrites its own word (the race the
// row reduction would have without its first barrier)
kernel void shift_racy(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]],
                       uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[t] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float v = buf[(t + 1) % n];
  buf[t] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = buf[t];
}

// within one simd-group a simdgroup_barrier orders threadgroup memory; across simd-groups only
// a threadgroup_barrier does. `stride` picks the partner: 1 (same simd-group) or 32 (the next).
struct Partner { uint stride; uint sync; };
kernel void simd_exchange(device float* out [[buffer(0)]], constant Partner& p [[buffer(1)]],
                          uint t [[thread_index_in_threadgroup]],
                          uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[t] = float(t);
  if (p.sync == 1) simdgroup_barrier(mem_flags::mem_threadgroup);
  if (p.sync == 2) threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint partner = p.stride < 32 ? (t & ~31u) | ((t + p.stride) & 31u) : (t + p.stride) % n;
  out[t] = buf[partner];
}

// lanes 16-31 leave before the simdgroup_barrier: it releases when they finish, and still
// orders the memory of the lanes that wait in it
kernel void early_exit(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float buf[32];
  if (lane >= 16) return;
  buf[t] = float(t);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = buf[t ^ 1];
}

// every thread of every threadgroup stores to one device word
kernel void device_racy(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[0] = float(gid);
}

// the same through an atomic: no race
kernel void device_atomic(device int* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit((device atomic_int*)out, 1, memory_order_relaxed);
}

// shuffles from lanes that do not exist, or have finished
kernel void shuffles(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                     uint t [[thread_index_in_threadgroup]]) {
  const float v = float(lane);
  out[t * 2] = simd_shuffle_down(v, ushort(16));
  if (t >= 40) return;
  out[t * 2 + 1] = simd_shuffle(v, ushort(lane ^ 16));
}
"""


@pytest.fixture(scope="module")
def mtl():
    return fake_metal.MTLCreateSystemDefaultDevice()


@pytest.fixture(scope="module")
def library(mtl):
    options = fake_metal.MTLCompileOptions.new()
    options.setFastMathEnabled_(False)
    lib, error = mtl.newLibraryWithSource_options_error_(PLANTED, options, None)
    assert error is None, error
    return lib


def _dispatch(mtl, library, name, buffers, groups=(1, 1, 1), threads=(64, 1, 1),
              params=None, tg=None, lengths=None):
    """Run one dispatch through the fake Metal API; the command buffer's error text or None."""
    pipeline, _ = mtl.newComputePipelineStateWithFunction_error_(
        library.newFunctionWithName_(name), None)
    cb = mtl.newCommandQueue().commandBuffer()
    enc = cb.computeCommandEncoder()
    enc.setComputePipelineState_(pipeline)
    for i, buf in enumerate(buffers):
        enc.setBuffer_offset_atIndex_(buf, 0, i)
    for i, n in (lengths or {}).items():
        enc.needleSetArgumentLength_atIndex_(n, i)
    if params is not None:
        data = np.asarray(params, np.int32).tobytes()
        enc.setBytes_length_atIndex_(data, len(data), len(buffers))
    for i, n in (tg or {}).items():
        enc.setThreadgroupMemoryLength_atIndex_(n, i)
    size = fake_metal.MTLSizeMake
    enc.dispatchThreadgroups_threadsPerThreadgroup_(size(*groups), size(*threads))
    enc.endEncoding()
    cb.commit()
    cb.waitUntilCompleted()
    if cb.status() == fake_metal.MTLCommandBufferStatusError:
        return cb.error().localizedDescription()
    return None


def _floats(mtl, n):
    return mtl.newBufferWithLength_options_(4 * n, 0)


def _array(buf, dtype=np.float32):
    return np.frombuffer(buf.contents().as_buffer(buf.length()), dtype=dtype)


# ---- out-of-bounds access ------------------------------------------------------------------

def test_in_bounds_dispatch_passes(mtl, library):
    out = _floats(mtl, 64)
    assert _dispatch(mtl, library, "overrun", [out], params=[0]) is None
    np.testing.assert_array_equal(_array(out), 1.0)


@pytest.mark.parametrize("by, offset", [(1, 256), (2000, 8000)])
def test_write_past_the_end_names_kernel_buffer_and_index(mtl, library, by, offset):
    """Even 8,000 bytes past the end (which used to land in slack unseen) is caught, and the
    bad write never happens."""
    out = _floats(mtl, 64)
    error = _dispatch(mtl, library, "overrun", [out], params=[by])
    assert error is not None
    assert "kernel overrun" in error and "out-of-bounds write" in error
    assert "[[buffer(0)]] 'out'" in error and "which has 256 bytes" in error
    assert f"byte offset {offset}" in error and f"index {offset // 4}" in error
    whole = np.frombuffer(out._map, dtype=np.uint8)
    start = fake_metal.GUARD_BYTES
    assert (whole[:start] == 0).all() and (whole[start + 256:] == 0).all()  # nothing written


def test_read_before_the_start_is_caught(mtl, library):
    x, out = _floats(mtl, 64), _floats(mtl, 64)
    error = _dispatch(mtl, library, "over_read", [x, out], params=[-3])
    assert "kernel over_read" in error and "out-of-bounds read" in error
    assert "'x'" in error and "byte offset -12" in error


def test_argument_length_not_the_pool_block_bounds_the_access(mtl, library):
    """The pool serves 400 bytes from a 512-byte block: the 401st byte is out of bounds."""
    out = mtl.newBufferWithLength_options_(512, 0)
    assert _dispatch(mtl, library, "overrun", [out], params=[0], threads=(100, 1, 1),
                     lengths={0: 400}) is None
    error = _dispatch(mtl, library, "overrun", [out], params=[1], threads=(100, 1, 1),
                      lengths={0: 400})
    assert "out-of-bounds write" in error and "byte offset 400" in error
    assert "which has 400 bytes" in error


def test_threadgroup_array_overrun_names_the_array(mtl, library):
    error = _dispatch(mtl, library, "tg_overrun", [_floats(mtl, 64)])
    assert "kernel tg_overrun" in error and "threadgroup variable 'buf'" in error
    assert "byte offset 256" in error and "thread 63" in error


def test_dynamic_threadgroup_memory_overrun_names_the_block(mtl, library):
    error = _dispatch(mtl, library, "dyn_overrun", [_floats(mtl, 64)], tg={0: 256})
    assert "kernel dyn_overrun" in error and "[[threadgroup(0)]] 'smem'" in error
    assert "byte offset 256" in error


def test_backend_queue_bounds_arguments_by_their_own_length():
    """Through needle's queue: an array of 100 floats sits in a 512-byte pool block, and a
    kernel writing its 101st element fails with KernelLaunchError naming the kernel."""
    import needle.backend_ndarray as nd
    from needle.backends.metal.compiler import MetalExecutable, compile_library
    from needle.errors import KernelLaunchError

    metal = nd.metal()
    if not metal.enabled() or fake_metal.NEEDLE_EMULATOR is not getattr(
            metal.backend.device.api, "NEEDLE_EMULATOR", None):
        pytest.skip("needs metal() through the emulator (NEEDLE_METAL_EMULATOR=1)")
    device = metal.backend.device
    library = compile_library(device.mtl, device.api, PLANTED, "planted")
    kernel = MetalExecutable("planted", library, device.mtl).kernel("overrun")
    out = device.allocator.allocate(400)
    assert out.capacity == 512
    device.queue.dispatch(kernel, (1, 1, 1), (100, 1, 1), [out], np.int32(1).tobytes())
    with pytest.raises(KernelLaunchError, match="kernel overrun.*out-of-bounds write"):
        device.queue.synchronize()


# ---- data races ----------------------------------------------------------------------------

def test_read_after_write_race_names_kernel_address_and_both_threads(mtl, library):
    x, out = _floats(mtl, 64), _floats(mtl, 64)
    error = _dispatch(mtl, library, "reverse_racy", [x, out])
    assert "kernel reverse_racy: data race on threadgroup variable 'buf'" in error
    assert "address 0x" in error
    # threads run in order here: thread 31 reads buf[32] before thread 32 writes it
    assert ("thread 31 (simd-group 0) of threadgroup (0,0,0) read it and thread 32 (simd-group "
            "1) of threadgroup (0,0,0) wrote it") in error


def test_write_after_read_race(mtl, library):
    error = _dispatch(mtl, library, "shift_racy", [_floats(mtl, 64)])
    assert "kernel shift_racy: data race" in error and "read it and" in error


@pytest.mark.parametrize("stride, sync, racy", [
    (1, 0, True), (1, 1, False), (32, 1, True), (32, 2, False)])
def test_simdgroup_barrier_orders_only_its_simd_group(mtl, library, stride, sync, racy):
    out = _floats(mtl, 64)
    error = _dispatch(mtl, library, "simd_exchange", [out], params=[stride, sync])
    assert (error is not None) == racy, error
    if not racy:
        t = np.arange(64)
        partner = (t & ~31) | ((t + stride) & 31) if stride < 32 else (t + stride) % 64
        np.testing.assert_array_equal(_array(out), partner)


def test_simdgroup_barrier_completed_by_finished_lanes_still_orders(mtl, library):
    out = _floats(mtl, 32)
    assert _dispatch(mtl, library, "early_exit", [out], threads=(32, 1, 1)) is None
    np.testing.assert_array_equal(_array(out)[:16], np.arange(16) ^ 1)


def test_device_word_written_by_two_threadgroups_is_a_race(mtl, library):
    error = _dispatch(mtl, library, "device_racy", [_floats(mtl, 4)], groups=(2, 1, 1),
                      threads=(1, 1, 1))
    assert "kernel device_racy: data race on buffer [[buffer(0)]] 'out'" in error
    assert "threadgroup (0,0,0) wrote" in error and "threadgroup (1,0,0) wrote" in error


def test_atomics_do_not_race(mtl, library):
    out = mtl.newBufferWithLength_options_(16, 0)
    _array(out, np.int32)[:] = 0
    assert _dispatch(mtl, library, "device_atomic", [out], groups=(4, 1, 1)) is None
    assert _array(out, np.int32)[0] == 256


def test_checks_can_be_turned_off(mtl, library, monkeypatch):
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_CHECKS", "bounds")
    assert _dispatch(mtl, library, "reverse_racy", [_floats(mtl, 64), _floats(mtl, 64)]) is None
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_CHECKS", "none")
    assert _dispatch(mtl, library, "overrun", [_floats(mtl, 64)], params=[1]) is None
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_CHECKS", "bounds,typo")
    with pytest.raises(ValueError, match="typo"):
        harness.default_checks()


# ---- undefined values ----------------------------------------------------------------------

def test_shuffles_from_missing_or_inactive_lanes_are_poison(mtl, library):
    out = _floats(mtl, 128)
    assert _dispatch(mtl, library, "shuffles", [out]) is None
    got = _array(out).reshape(64, 2)
    lane = np.arange(64) % 32
    down = got[:, 0]
    np.testing.assert_array_equal(down[lane < 16], lane[lane < 16] + 16)
    assert np.isnan(down[lane >= 16]).all()  # lanes 32.. beyond the simd-group
    partner = got[:40, 1]  # threads 40..63 returned first: lanes 8..31 of simd-group 1
    np.testing.assert_array_equal(partner[:32], lane[:32] ^ 16)
    assert np.isnan(partner[32:]).all()  # lanes 0..7 of simd-group 1 read lanes 16..23, gone
