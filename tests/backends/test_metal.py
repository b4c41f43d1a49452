"""The Metal backend's own behaviour, on real Metal (macOS) or through the MSL emulator
(``NEEDLE_METAL_EMULATOR=1``): dtypes, compile and launch errors, failed command buffers,
launch geometry, shared memory, ordering of uploads, recording, profiling, the KV cache.

What every op computes is the conformance suite's job (tests/backend_ndarray); these tests
are about how the backend maps onto Metal.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import DeviceError, DTypeError, KernelCompileError, KernelLaunchError
from needle.hal import trace

METAL = nd.metal()
pytestmark = pytest.mark.skipif(not METAL.enabled(), reason=f"metal disabled: {METAL.reason}")


def _emulated() -> bool:
    return getattr(sys.modules.get("Metal"), "__name__", "").endswith("fake_metal")


emulator_only = pytest.mark.skipif(not METAL.enabled() or not _emulated(),
                                   reason="needs the MSL emulator (real GPUs do not fail on cue)")


@pytest.fixture
def backend():
    return METAL.backend


@pytest.fixture
def device(backend):
    return backend.device


def test_float64_is_refused_with_the_reason():
    with pytest.raises(DTypeError, match="float64"):
        nd.array(np.zeros(3), device=METAL, dtype="float64")
    x = nd.array(np.ones(3, np.float32), device=METAL)
    with pytest.raises(DTypeError, match="float64"):
        x.astype("float64")


def _broken_kernels(tmp_path):
    """A kernel directory whose one file does not compile."""
    from needle.backends.metal.compiler import COMMON, KERNEL_DIR

    (tmp_path / COMMON).write_text((KERNEL_DIR / COMMON).read_text())
    (tmp_path / "broken.metal").write_text(
        "kernel void oops_f32(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]])"
        " {\n  out[i] = undefined_thing;\n}\n")
    return tmp_path


def test_compile_error_carries_the_log_and_the_kernel_name(device, tmp_path):
    from needle.backends.metal.compiler import MetalExecutableCache

    cache = MetalExecutableCache("metal", device.mtl, device.api)
    cache.source_dir = _broken_kernels(tmp_path)
    with pytest.raises(KernelCompileError) as info:
        cache.kernel("broken", "oops_f32")
    message = str(info.value)
    assert "oops_f32" in message and "broken.metal" in message
    assert "undefined_thing" in message  # the compiler's own log, pointing at the culprit


def test_unknown_kernel_name_is_a_clear_error(backend):
    with pytest.raises(KernelCompileError, match="ewise_nope_f32 is not in elementwise.metal"):
        backend.device.executables.kernel("elementwise", "ewise_nope_f32")


def test_oversized_threadgroup_is_refused_before_dispatch(backend, device):
    kernel = device.executables.kernel("elementwise", "fill_f32")
    device.queue.synchronize()
    out = device.allocator.allocate(64 * 4)
    too_many = kernel.max_threads + kernel.simd_width
    with pytest.raises(KernelLaunchError, match="maxTotalThreadsPerThreadgroup"):
        device.queue.dispatch(kernel, (1, 1, 1), (too_many, 1, 1), [out],
                              np.array([64, 0], np.int64).tobytes())
    assert device.queue.idle()  # nothing was encoded


def test_threadgroup_memory_over_the_device_limit_is_refused(device):
    kernel = device.executables.kernel("nn", "softmax_f32")
    buf = device.allocator.allocate(1024)
    with pytest.raises(KernelLaunchError, match="threadgroup memory"):
        device.queue.dispatch(kernel, (1, 1, 1), (32, 1, 1), [buf, buf], bytes(16),
                              shared_bytes=device.max_shared_bytes + 16)


@emulator_only
def test_dynamic_threadgroup_memory_does_not_stay_set_for_later_dispatches(backend):
    """An encoder keeps the threadgroup memory length set for one dispatch, and Metal counts
    it against the next: a kernel with 24 KB of dynamic memory followed in the same encoder
    by an fp32 matmul (16 KB static) was refused (found by a GGUF model test)."""
    x = nd.array(np.ones((4, 64), np.float32), device=METAL)
    w = nd.array(np.ones((64, 64), np.float32), device=METAL)  # uploads before the dispatches
    kernel = backend.device.executables.kernel("nn", "softmax_f32")
    buf = backend.device.allocator.allocate(1024)
    backend.queue.dispatch(kernel, (1, 1, 1), (32, 1, 1), [buf, buf], bytes(16),
                           shared_bytes=24 * 1024)
    np.testing.assert_array_equal((x @ w).numpy(), np.full((4, 64), 64.0, np.float32))


_DIVERGENT = """#include <metal_stdlib>
using namespace metal;
kernel void divergent(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {
  if (t < 3) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = 1.0f;
}
"""


@emulator_only
def test_failed_command_buffer_raises_with_its_kernels(device):
    """A GPU fault marks the command buffer failed; the host sees KernelLaunchError naming the
    kernels it ran. The emulator faults on a divergent barrier (undefined on a real GPU)."""
    from needle.backends.metal.compiler import MetalExecutable, compile_library

    library = compile_library(device.mtl, device.api, _DIVERGENT, "divergent")
    kernel = MetalExecutable("divergent", library, device.mtl).kernel("divergent")
    out = device.allocator.allocate(64 * 4)
    device.queue.dispatch(kernel, (1, 1, 1), (64, 1, 1), [out])
    with pytest.raises(KernelLaunchError, match="divergent") as info:
        device.queue.synchronize()
    assert "command buffer" in str(info.value) and "deadlocked" in str(info.value)
    device.queue.synchronize()  # the queue is usable afterwards
    np.testing.assert_array_equal(nd.array([1.0, 2.0], device=METAL).numpy() * 2, [2.0, 4.0])


@emulator_only
def test_launch_geometry_follows_the_pipeline_limits(monkeypatch):
    """With pipelines that allow only 96 threads (not a power of two), every launch still
    fits and results stay right: group sizes come from maxTotalThreadsPerThreadgroup."""
    import Metal

    from needle.backends.metal.backend import MetalBackend
    from needle.backends.metal.device import MetalDevice

    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MAX_THREADS", "96")
    small = MetalBackend(MetalDevice(Metal))
    kernel = small.device.executables.kernel("elementwise", "ewise_add_f32")
    assert kernel.max_threads == 96 and kernel.preferred_threads == 96
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 300)).astype(np.float32)
    x = small.Array(a.size, "float32")
    small.from_numpy(a, x)
    out = small.Array(37, "float32")
    small.reduce_sum(x, out, 37, 300, 1)
    np.testing.assert_allclose(small.to_numpy(out, (37,), (1,), 0), a.sum(axis=1), rtol=1e-4)
    small.softmax(x, x, 300)
    e = np.exp(a - a.max(axis=1, keepdims=True))
    np.testing.assert_allclose(small.to_numpy(x, a.shape, (300, 1), 0),
                               e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-7)


def test_upload_while_the_gpu_is_busy_keeps_program_order(backend):
    """Shared memory: an upload into a buffer that queued kernels still read must not change
    what they read (the queue stages it and copies in order)."""
    a = nd.array(np.ones(1000, np.float32), device=METAL)
    b = a * 2  # queued: reads a
    backend.from_numpy(np.full(1000, 5, np.float32), a.handle)
    np.testing.assert_array_equal(b.numpy(), 2.0)
    np.testing.assert_array_equal(a.numpy(), 5.0)


def test_host_view_aliases_the_buffer(backend, device):
    buf = device.allocator.allocate(16)
    device.queue.synchronize()
    view = buf.host_view().view(np.float32)
    view[:] = [1, 2, 3, 4]
    out = np.zeros(4, np.float32)
    device.queue.copy_to_host(buf, 0, out)
    np.testing.assert_array_equal(out, [1, 2, 3, 4])  # no copy in between: same memory


def test_pool_reuses_freed_buffers(backend):
    backend.synchronize()
    before = backend.memory_stats()
    for _ in range(3):
        x = nd.array(np.ones(4096, np.float32), device=METAL)
        del x
    after = backend.memory_stats()
    assert after.hits - before.hits >= 2
    assert after.peak >= 4096 * 4 and after.reserved >= after.in_use


def test_recorded_command_buffer_replays_with_new_inputs(backend):
    x = nd.array(np.arange(8, dtype=np.float32), device=METAL)
    with backend.capture() as recording:
        y = (x * 2 + 1).exp()
    recording.replay()
    np.testing.assert_allclose(y.numpy(), np.exp(np.arange(8) * 2 + 1), rtol=1e-6)
    x[...] = np.full(8, -1.0, np.float32)
    recording.replay()
    np.testing.assert_allclose(y.numpy(), np.exp(-1.0), rtol=1e-6)
    recording.close()


def test_a_recording_closed_early_says_why_it_cannot_replay(backend):
    x = nd.array(np.ones(4, np.float32), device=METAL)
    with backend.capture() as recording:
        x * 2
    recording.close(because="its owner was torn down")
    with pytest.raises(DeviceError, match="closed: its owner was torn down"):
        recording.replay()
    with backend.capture() as plain:
        x * 3
    plain.close()
    with pytest.raises(DeviceError, match="this recording is closed$"):
        plain.replay()


def test_profiler_times_each_kernel(backend):
    x = nd.array(np.ones((64, 64), np.float32), device=METAL)
    tiles = backend.device.executables.kernel("matmul", "matmul_nn_f32")
    # pipelines allowing fewer than 256 threads take the 16x16 fallback tile
    name = "matmul_nn_f32" if tiles.max_threads >= 256 else "matmul_f32"
    with backend.profile() as prof:
        (x @ x).sum()
    assert name in prof.totals and prof.totals[name].calls == 1
    assert prof.total_ms >= 0.0 and name in prof.table()


def test_trace_prints_dispatches_and_copies(capsys):
    trace.set_enabled(True)
    try:
        (nd.array(np.ones(4, np.float32), device=METAL) + 1).numpy()
    finally:
        trace.set_enabled(False)
    err = capsys.readouterr().err
    assert "dispatch" in err and "scalar_add_f32" in err
    assert "copy" in err


def test_kv_cache_lives_on_the_device_and_updates_in_place():
    """A preallocated (batch, kv_heads, capacity, head_dim) cache: each step writes its keys
    and values into a view of it (setitem kernels, in place), and attention reads the first
    kv_len positions of the views."""
    rng = np.random.default_rng(0)
    batch, heads, capacity, dim = 1, 2, 16, 32
    k_cache = nd.zeros((batch, heads, capacity, dim), device=METAL)
    v_cache = nd.zeros((batch, heads, capacity, dim), device=METAL)
    handle = k_cache.handle
    keys = rng.standard_normal((batch, heads, 5, dim)).astype(np.float32)
    values = rng.standard_normal((batch, heads, 5, dim)).astype(np.float32)
    for pos in range(5):
        k_cache[:, :, pos:pos + 1, :] = nd.array(keys[:, :, pos:pos + 1], device=METAL)
        v_cache[:, :, pos:pos + 1, :] = nd.array(values[:, :, pos:pos + 1], device=METAL)
    assert k_cache.handle is handle
    q = rng.standard_normal((batch, 4, 1, dim)).astype(np.float32)  # 4 query heads, 2 kv
    out = nd.attention(nd.array(q, device=METAL), k_cache, v_cache, kv_len=5).numpy()
    kk = np.repeat(keys, 2, axis=1)
    vv = np.repeat(values, 2, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(dim)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out, (p / p.sum(axis=-1, keepdims=True)) @ vv, rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_out_of_range_device_indices_give_zero_rows_and_are_skipped(dtype):
    """Indices already in device memory are not read back to be checked (that would stall
    the queue): take gives a zero row for one out of range, scatter_add skips it."""
    table = nd.array(np.arange(12).reshape(4, 3), device=METAL, dtype=dtype)
    idx = nd.array(np.array([1, 7, -1, 1], np.int32), device=METAL)
    np.testing.assert_array_equal(table.take(idx).numpy(),
                                  [[3, 4, 5], [0, 0, 0], [0, 0, 0], [3, 4, 5]])
    values = nd.array(np.ones((4, 3)), device=METAL, dtype=dtype)
    np.testing.assert_array_equal(nd.scatter_add(idx, values, 4).numpy(),
                                  [[0, 0, 0], [2, 2, 2], [0, 0, 0], [0, 0, 0]])


@emulator_only
def test_per_dispatch_objects_are_made_inside_autorelease_pools(backend):
    """Command buffers, encoders and errors come back autoreleased: the queue makes them inside
    objc.autorelease_pool() (on a Mac, outside one they would never be freed)."""
    import Metal

    before = dict(Metal.unpooled)
    a = nd.array(np.arange(12, dtype=np.float32).reshape(3, 4), device=METAL)
    busy = a @ a.T  # queued work, so the next upload goes through a staging blit
    a[0:1, :] = nd.array(np.zeros((1, 4), np.float32), device=METAL)
    np.testing.assert_array_equal((busy.sum() + a.sum()).numpy().shape, ())
    backend.synchronize()
    assert Metal.unpooled == before


@emulator_only
@pytest.mark.parametrize("macos, msl, setter", [("15.1", 310, "mathMode"),
                                                ("14.5", 310, "fastMathEnabled"),
                                                ("13.6", 300, "fastMathEnabled")])
def test_compile_options_set_the_language_version_and_ieee_math(monkeypatch, macos, msl, setter):
    """languageVersion is set explicitly (3.1 from macOS 14, else 3.0), and IEEE math through
    mathMode where it exists (macOS 15), the deprecated fastMathEnabled before."""
    import Metal

    from needle.backends.metal.compiler import compile_options

    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MACOS", macos)
    options = compile_options(Metal)
    assert options.msl() == msl and not options.effective_fast_math()
    if setter == "mathMode":
        assert options.mathMode() == Metal.MTLMathModeSafe and options.fastMathEnabled()
    else:
        assert not options.fastMathEnabled()
        with pytest.raises(AttributeError):
            options.setMathMode_(Metal.MTLMathModeSafe)


@emulator_only
def test_msl_3_0_systems_run_without_bfloat16(monkeypatch):
    """On macOS 13 the kernels compile at MSL 3.0: float32 and float16 run, and a bfloat16 kernel
    is a DTypeError naming what it needs."""
    import Metal

    from needle.backends.metal.backend import MetalBackend
    from needle.backends.metal.device import MetalDevice

    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_MACOS", "13.6")
    old = MetalBackend(MetalDevice(Metal))
    for dtype in ("float32", "float16"):
        x = old.Array(8, dtype)
        old.from_numpy(np.arange(8, dtype=dtype), x)
        old.ewise_add(x, x, x)
        np.testing.assert_array_equal(old.to_numpy(x, (8,), (1,), 0), 2 * np.arange(8))
    with pytest.raises(DTypeError, match="Metal 3.1"):
        old.device.executables.kernel("elementwise", "ewise_add_bf16")
