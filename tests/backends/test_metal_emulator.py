"""The MSL emulation harness itself (design §6, layers 1 and 2): every kernel file compiles as
C++ against the shim, and the harness runs threadgroups with MSL's semantics (barriers,
simd-group functions, threadgroup memory, atomics, half/bfloat rounding).

These need only clang++, not the fake Metal module, so they run in every CI job.
"""

from __future__ import annotations

import shutil
import sys

import ml_dtypes
import numpy as np
import pytest

from needle.backends.metal.compiler import COMMON, KERNEL_DIR, library_source
from tests.metal_emulator import harness

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the MSL emulator is Linux test support (macOS tests real Metal)"),
    pytest.mark.skipif(shutil.which(harness.compiler()) is None,
                       reason=f"the MSL emulator needs {harness.compiler()}"),
]

FAMILIES = sorted(p.stem for p in KERNEL_DIR.glob("*.metal"))
STRICT = ["-Wall", "-Werror", "-Wno-unknown-attributes"]


# ---- layer 1: compile ------------------------------------------------------------------------

def test_every_kernel_family_is_checked():
    assert {"elementwise", "layout", "reduce", "matmul", "nn", "optim"} <= set(FAMILIES)


@pytest.mark.parametrize("msl", [300, 310])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_file_compiles_as_cpp(family, msl):
    """What Metal compiles (common.h + the family file) is valid C++ against the shim, at MSL
    3.0 (macOS 13: no bfloat) and 3.1 (macOS 14+)."""
    harness.check(library_source(family), STRICT, msl=msl)


def test_msl_3_0_has_no_bfloat():
    source = "#include <metal_stdlib>\nusing namespace metal;\n" \
             "kernel void k(device bfloat* out [[buffer(0)]]) { out[0] = bfloat(1.0f); }\n"
    harness.check(source, msl=310)
    with pytest.raises(harness.MSLCompileError, match="bfloat"):
        harness.check(source, msl=300)
    version = "#include <metal_stdlib>\n" \
              "static_assert(__METAL_VERSION__ == 300, \"MSL 3.0\");\n" \
              "#ifdef __HAVE_BFLOAT__\n#error bfloat at 3.0\n#endif\n"
    harness.check(version, msl=300)


def test_common_header_compiles_alone():
    harness.check((KERNEL_DIR / COMMON).read_text(), STRICT)


@pytest.mark.parametrize("snippet, name", [
    ("double x = 1.0; out[i] = float(x);", "double"),
    ("out[i] = erf(out[i]);", "erf"),
    ("out[i] = std::max(out[i], 0.0f);", "std"),
])
def test_what_msl_lacks_does_not_compile(snippet, name):
    """The shim poisons C++ that MSL rejects, so it cannot slip through the emulator."""
    source = f"""#include <metal_stdlib>
using namespace metal;
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {{
  {snippet}
}}"""
    with pytest.raises(harness.MSLCompileError, match="poisoned"):
        harness.check(source)


def test_compile_errors_point_at_the_source_line():
    source = "#include <metal_stdlib>\nkernel void k(device float* out [[buffer(0)]]) {\n" \
             "  out[0] = undefined_name;\n}\n"
    with pytest.raises(harness.MSLCompileError) as info:
        harness.build(source)
    assert f"{harness.SOURCE_NAME}:3:" in info.value.log
    assert "undefined_name" in info.value.log


# ---- layer 2: execute ------------------------------------------------------------------------

def _run(lib, name, buffers, groups, threads, tg=None, workers=None):
    pointers = {i: b.ctypes.data for i, b in buffers.items()}
    return lib.run(name, pointers, tg or {}, groups, threads, workers=workers)


SYNC_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// every simd-group function the kernels use, against values numpy can check
kernel void simd_ops(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[gid];
  out[gid * 6 + 0] = simd_sum(v);
  out[gid * 6 + 1] = simd_max(v);
  out[gid * 6 + 2] = simd_prefix_exclusive_sum(v);
  out[gid * 6 + 3] = simd_shuffle_xor(v, ushort(5));
  out[gid * 6 + 4] = simd_broadcast(v, ushort(7));
  out[gid * 6 + 5] = float(simd_any(v > 30.0f)) + 2.0f * float(simd_all(v >= 0.0f));
}

// threadgroup memory through a barrier: a declared array is shared by the threadgroup, a
// pointer into it is each thread's own
kernel void reverse(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                    device float* own [[buffer(2)]], uint t [[thread_index_in_threadgroup]],
                    uint g [[threadgroup_position_in_grid]], uint n [[threads_per_threadgroup]],
                    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float buf[256];
  threadgroup float* mine = buf + sg * 32;
  buf[t] = x[g * n + t];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[g * n + t] = buf[n - 1 - t];
  own[g * n + t] = mine[t % 32];
}

// dynamic threadgroup memory sized at dispatch, and a tree reduction over it
kernel void tree_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     threadgroup float* smem [[threadgroup(0)]],
                     uint t [[thread_index_in_threadgroup]],
                     uint g [[threadgroup_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  smem[t] = x[g * n + t];
  for (uint s = n / 2; s > 0; s /= 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t < s) smem[t] += smem[t + s];
  }
  if (t == 0) out[g] = smem[0];
}

kernel void divergent(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {
  if (t < 3) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = 1.0f;
}

// atomics across threadgroups that run on several OS threads
kernel void histogram(device const int* x [[buffer(0)]], device int* bins [[buffer(1)]],
                      device float* total [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit((device atomic_int*)(bins + x[gid]), 1, memory_order_relaxed);
  device atomic_uint* word = (device atomic_uint*)total;
  uint old = atomic_load_explicit(word, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(word, &old,
                                                as_type<uint>(as_type<float>(old) + 1.0f),
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
}

// simdgroup matrices: an 8x8 product per simd-group
kernel void mma(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                device float* c [[buffer(2)]]) {
  simdgroup_float8x8 x, y, acc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_load(x, a, 8);
  simdgroup_load(y, b, 8, ulong2(0), true);
  simdgroup_multiply_accumulate(acc, x, y, acc);
  simdgroup_store(acc, c, 8);
}

template <class From, class To>
kernel void convert(device const From* x [[buffer(0)]], device To* out [[buffer(1)]],
                    uint gid [[thread_position_in_grid]]) {
  out[gid] = To(float(x[gid]));
}
#define CONVERT(NAME, A, B) \
  template [[host_name(NAME)]] [[kernel]] decltype(convert<A, B>) convert<A, B>;
CONVERT("f32_to_f16", float, half)
CONVERT("f32_to_bf16", float, bfloat)
CONVERT("f16_to_f32", half, float)
"""


@pytest.fixture(scope="module")
def lib():
    return harness.build(SYNC_SOURCE)


def test_scan_finds_kernels_and_which_synchronise(lib):
    k = lib.kernels
    assert {"simd_ops", "reverse", "tree_sum", "divergent", "histogram", "mma", "f32_to_f16",
            "f32_to_bf16", "f16_to_f32"} == set(k)
    assert k["tree_sum"].synchronises and k["simd_ops"].synchronises
    assert not k["histogram"].synchronises and not k["f32_to_f16"].synchronises
    assert k["tree_sum"].threadgroup_blocks == [0] and k["histogram"].buffers == [0, 1, 2]
    assert k["f32_to_bf16"].call == "convert<float, bfloat>"


def test_simd_group_functions(lib):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, 64).astype(np.float32)  # two simd-groups of 32
    out = np.zeros(64 * 6, np.float32)
    assert _run(lib, "simd_ops", {0: x, 1: out}, (1, 1, 1), (64, 1, 1)) is None
    out = out.reshape(64, 6)
    for g in range(2):
        v, o = x[32 * g:32 * g + 32], out[32 * g:32 * g + 32]
        np.testing.assert_array_equal(o[:, 0], v.sum())
        np.testing.assert_array_equal(o[:, 1], v.max())
        np.testing.assert_array_equal(o[:, 2], np.concatenate([[0], np.cumsum(v)[:-1]]))
        np.testing.assert_array_equal(o[:, 3], v[np.arange(32) ^ 5])
        np.testing.assert_array_equal(o[:, 4], v[7])
        np.testing.assert_array_equal(o[:, 5], float((v > 30).any()) + 2.0)


@pytest.mark.parametrize("workers", [1, 2])
def test_barriers_and_threadgroup_memory(lib, workers):
    x = np.arange(4 * 256, dtype=np.float32)
    out, own = np.zeros_like(x), np.zeros_like(x)
    assert _run(lib, "reverse", {0: x, 1: out, 2: own}, (4, 1, 1), (256, 1, 1),
                workers=workers) is None
    np.testing.assert_array_equal(out.reshape(4, 256), x.reshape(4, 256)[:, ::-1])
    np.testing.assert_array_equal(own, x)
    sums = np.zeros(4, np.float32)
    assert _run(lib, "tree_sum", {0: x, 1: sums}, (4, 1, 1), (256, 1, 1), {0: 1024},
                workers=workers) is None
    np.testing.assert_array_equal(sums, x.reshape(4, 256).sum(axis=1))


def test_divergent_barrier_fails_the_dispatch(lib):
    out = np.zeros(64, np.float32)
    error = _run(lib, "divergent", {0: out}, (1, 1, 1), (64, 1, 1))
    assert "deadlocked" in error and "3 threads wait at threadgroup_barrier" in error


def test_unbound_buffers_and_memory_are_reported(lib):
    x = np.zeros(4, np.float32)
    assert "buffer index 1" in _run(lib, "reverse", {0: x, 2: x}, (1, 1, 1), (4, 1, 1))
    assert "threadgroup memory index 0" in _run(lib, "tree_sum", {0: x, 1: x}, (1, 1, 1),
                                                 (4, 1, 1))


def test_atomics_across_worker_threads(lib):
    n = 1 << 17
    x = (np.arange(n) % 7).astype(np.int32)
    bins = np.zeros(7, np.int32)
    total = np.zeros(1, np.float32)
    assert _run(lib, "histogram", {0: x, 1: bins, 2: total}, (n // 256, 1, 1), (256, 1, 1),
                workers=2) is None
    np.testing.assert_array_equal(bins, np.bincount(x, minlength=7))
    assert total[0] == n


def test_simdgroup_matrix_product(lib):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = np.zeros((8, 8), np.float32)
    assert _run(lib, "mma", {0: a, 1: b, 2: c}, (1, 1, 1), (32, 1, 1)) is None
    np.testing.assert_allclose(c, a @ b.T + 1.0, rtol=1e-5)


def test_simdgroup_matrix_product_needs_the_whole_simd_group(lib):
    """A matrix is spread over the 32 lanes (two elements each): a simd-group of 16 threads
    cannot hold one, and MSL requires every lane to take part."""
    a, b, c = (np.zeros((8, 8), np.float32) for _ in range(3))
    error = _run(lib, "mma", {0: a, 1: b, 2: c}, (1, 1, 1), (16, 1, 1))
    assert "kernel mma" in error and "simdgroup_multiply_accumulate" in error
    assert "all 32 lanes" in error


def test_half_and_bfloat_round_to_nearest_even(lib):
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e-8, 6e-8,
               2.0**-24 * 1.5, 2.0**-14, 3.0e38, -1.0000001, 1 + 2.0**-11, 1 + 3 * 2.0**-11]
    rng = np.random.default_rng(2)
    x = np.concatenate([special, rng.standard_normal(4000) * 10.0**rng.integers(-9, 6, 4000),
                        rng.random(1000).astype(np.float32) * 2.0**-14]).astype(np.float32)
    x = np.pad(x, (0, -x.size % 256))
    groups = (x.size // 256, 1, 1)
    for name, dtype in (("f32_to_f16", np.float16), ("f32_to_bf16", ml_dtypes.bfloat16)):
        out = np.zeros(x.size, dtype)
        assert _run(lib, name, {0: x, 1: out}, groups, (256, 1, 1)) is None
        with np.errstate(over="ignore"):
            expected = x.astype(dtype)
        np.testing.assert_array_equal(out.view(np.uint16)[~np.isnan(x)],
                                      expected.view(np.uint16)[~np.isnan(x)])
        assert np.isnan(out[np.isnan(x)].astype(np.float32)).all()
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    back = np.zeros(x.size, np.float32)
    assert _run(lib, "f16_to_f32", {0: h, 1: back}, groups, (256, 1, 1)) is None
    np.testing.assert_array_equal(back, h.astype(np.float32))


def test_ucontext_fibers_match(monkeypatch):
    """The portable context switch (ucontext) gives the same results as the x86-64 one."""
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_UCONTEXT", "1")
    lib = harness.build(SYNC_SOURCE)
    x = np.arange(2 * 128, dtype=np.float32)
    sums = np.zeros(2, np.float32)
    assert _run(lib, "tree_sum", {0: x, 1: sums}, (2, 1, 1), (128, 1, 1), {0: 512}) is None
    np.testing.assert_array_equal(sums, x.reshape(2, 128).sum(axis=1))
