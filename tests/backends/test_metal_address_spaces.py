"""MSL's address spaces in the emulator's shim (design §6, layer 1): device, constant,
threadgroup and thread are distinct clang address spaces, so a pointer used in the wrong one
fails to compile here as it does in Apple's compiler, with the address spaces named in the log.

Needs only clang++ (17 or later), not the fake Metal module.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.metal_emulator import harness

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the MSL emulator is Linux test support (macOS tests real Metal)"),
    pytest.mark.skipif(shutil.which(harness.compiler()) is None,
                       reason=f"the MSL emulator needs {harness.compiler()}"),
]

STRICT = ["-Wall", "-Werror", "-Wno-unknown-attributes"]

TEMPLATE = """#include <metal_stdlib>
using namespace metal;
constant float kScale = 2.0f;
constant int kTile = 4;
inline float first(device const float* p) { return p[0]; }
inline float first_shared(threadgroup const float* p) { return p[0]; }
kernel void k(device float* out [[buffer(0)]], constant float* c [[buffer(1)]],
              device atomic_int* counter [[buffer(2)]],
              threadgroup float* tg [[threadgroup(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float buf[32];
  float local[kTile];
  local[0] = kScale; buf[i & 31] = local[0]; (void)tg; (void)c; (void)counter;
  %s
}
"""


@pytest.mark.parametrize("body", [
    "out[i] = first(out) + first_shared(tg) + first_shared(buf) + local[0] + c[i];",
    "threadgroup float* q = buf; q[i] = out[i]; out[i] = q[0] + c[i];",
    "thread float* p = local; out[i] = p[0];",
    "atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);",
    "simdgroup_float8x8 m; simdgroup_load(m, buf); simdgroup_store(m, out);",
])
def test_well_placed_pointers_compile(body):
    harness.check(TEMPLATE % body, STRICT)


@pytest.mark.parametrize("body, message", [
    # a threadgroup pointer passed where a device pointer is expected
    ("out[i] = first(tg);", "cannot pass pointer to address space 'threadgroup' as a pointer to "
                            "address space 'device'"),
    ("out[i] = first(buf);", "no known conversion from 'threadgroup float[32]' to "
                             "'device float const *'"),
    ("device float* q = tg; q[0] = 1.0f;", "cannot initialize a variable of type 'device float *' "
                                           "with an lvalue of type 'threadgroup float *'"),
    # constant memory is read-only, and not device memory
    ("c[i] = 1.0f;", "read-only variable is not assignable"),
    ("out[i] = first(c);", "cannot pass pointer to address space 'constant' as a pointer to "
                           "address space 'device'"),
    ("device float* q = c; out[i] = q[0];", "lvalue of type 'const constant float *'"),
    # a thread's own memory is neither
    ("out[i] = first(local);", "no known conversion from 'float[4]' to 'device float const *'"),
    ("out[i] = first_shared(out);", "cannot pass pointer to address space 'device' as a pointer "
                                    "to address space 'threadgroup'"),
    # MSL's atomics and simdgroup matrix loads take device or threadgroup memory only
    ("atomic_int a; atomic_fetch_add_explicit(&a, 1, memory_order_relaxed);",
     "no matching function for call to 'atomic_fetch_add_explicit'"),
    ("simdgroup_float8x8 m; simdgroup_load(m, c);",
     "no matching function for call to 'simdgroup_load'"),
])
def test_address_space_mistakes_do_not_compile(body, message):
    with pytest.raises(harness.MSLCompileError) as info:
        harness.check(TEMPLATE % body, STRICT)
    assert message in info.value.log
    assert f"{harness.SOURCE_NAME}:13:" in info.value.log  # the line of the mistake
    assert "__attribute__((address_space" not in info.value.log  # spaces go by their MSL names


@pytest.mark.parametrize("param, spaces", [
    ("float* out [[buffer(0)]]", "device or constant"),
    ("thread float* out [[buffer(0)]]", "device or constant"),
    ("device float* out [[threadgroup(0)]]", "threadgroup"),
])
def test_kernel_arguments_need_their_address_space(param, spaces):
    """MSL requires an address space on a kernel's pointer and reference arguments."""
    source = f"#include <metal_stdlib>\nkernel void k({param}) {{ out[0] = 1.0f; }}\n"
    with pytest.raises(harness.MSLCompileError) as info:
        harness.check(source)
    assert f"kernel k: parameter '{param}' must be declared in the {spaces} address space" \
        in info.value.log


def test_kernel_files_compile_with_distinct_address_spaces():
    """The shim really has the four spaces: a device pointer is not a threadgroup one."""
    source = "#include <metal_stdlib>\nusing namespace metal;\n" \
             "static_assert(!__is_same(device float, threadgroup float), \"distinct\");\n" \
             "static_assert(!__is_same(device float, float), \"device is not thread\");\n" \
             "static_assert(!__is_same(constant float, const float), \"constant is not " \
             "thread\");\n" \
             "static_assert(__is_same(thread float, float), \"thread is the default\");\n"
    harness.check(source, STRICT)


def test_compiler_older_than_clang_17_is_named(monkeypatch, tmp_path):
    """The shim needs clang 17 or later; an older compiler stops with what to install."""
    fake = tmp_path / "clang++"
    fake.write_text("#!/bin/sh\nexec " + shutil.which(harness.compiler()) +
                    " -U__clang_major__ -D__clang_major__=14 \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NEEDLE_METAL_EMULATOR_CXX", str(fake))
    assert harness.compiler() == str(fake)
    with pytest.raises(harness.MSLCompileError, match="clang 17 or later.*clang-19"):
        harness.check("#include <metal_stdlib>\n")
