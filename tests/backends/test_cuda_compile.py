"""Every CUDA kernel file compiles with NVRTC for sm_80 and sm_90 (no GPU or driver needed).

NVRTC ships as a wheel that needle's install brings (the ``cuda`` extra, in ``all``), so a
missing one fails the tests with the reason. A compile error must come back as
KernelCompileError carrying NVRTC's log and the kernel file's name.
"""

from __future__ import annotations

import re

import pytest

from needle.backends.cuda import compiler
from needle.errors import DeviceError, KernelCompileError

try:
    compiler.nvrtc_version()
    NVRTC = None
except DeviceError as e:
    NVRTC = str(e)

@pytest.fixture
def nvrtc():
    assert NVRTC is None, f"NVRTC unavailable: {NVRTC} (pip install 'needle[cuda]')"


needs_nvrtc = pytest.mark.usefixtures("nvrtc")
FAMILIES = sorted(p.stem for p in compiler.KERNEL_DIR.glob("*.cu"))


def test_the_kernel_families_exist():
    assert FAMILIES == ["attention_simt", "attention_simt_bwd", "attention_tc_bwd", "decode",
                        "decode_mega", "decode_tc", "elementwise", "gemm_tma", "layout",
                        "matmul",
                        "nn", "optim", "paged", "quant", "quant_decode", "quant_gemm",
                        "quant_skinny", "quant_stream", "reduce", "sampling", "skinny"]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_file_compiles(family, arch):
    """Every shard of every file (what a device compiles) builds a CUBIN."""
    source = (compiler.KERNEL_DIR / f"{family}.cu").read_text()
    for shard in compiler.SHARDS:
        cubin = compiler.compile_source(source, family, arch,
                                        options=compiler.shard_options(shard))
        assert cubin[:4] == b"\x7fELF"  # a CUBIN is an ELF image


def _entries(ptx: bytes) -> list[str]:
    return re.findall(r"\.entry (\w+)\(", ptx.decode(errors="replace"))


@needs_nvrtc
@pytest.mark.parametrize("family", FAMILIES)
def test_shards_partition_each_file(family):
    """Compiled one dtype at a time, a file's kernels are exactly the whole file's, each in
    the shard its name says (shard_of), so a lookup by name finds its kernel."""
    source = (compiler.KERNEL_DIR / f"{family}.cu").read_text()
    whole = _entries(compiler.compile_source(source, family, "compute_90", ptx=True))
    found = []
    for shard in compiler.SHARDS:
        names = _entries(compiler.compile_source(source, family, "compute_90", ptx=True,
                                                 options=compiler.shard_options(shard)))
        assert all(compiler.shard_of(n) == shard for n in names), (shard, names)
        found += names
    assert sorted(found) == sorted(whole) and len(whole) == len(set(whole))


@needs_nvrtc
def test_precompile_ahead_fills_the_disk_cache(tmp_path, monkeypatch):
    """The compile a model starts while its weights load: shards of the dtypes asked for,
    on threads, into the disk cache (no driver needed), keyed by shard."""
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    cache = compiler.CudaExecutableCache("test", 90, 1)
    started = cache.precompile_async(["bfloat16", "int32"], ["layout", "reduce"])
    assert sorted(started) == ["layout:bf16", "layout:i32", "reduce:bf16", "reduce:i32"]
    assert cache.precompile_async(["bfloat16"], ["layout"]) == []  # already under way
    cache.wait_precompiled()
    assert len(list((tmp_path / "cuda").glob("*.cubin"))) == 4
    assert cache.unit_of("layout", "take_bf16_i64") == "layout:bf16"
    image = cache._image("layout:bf16")  # a hit now: the same bytes, no compile
    assert image == cache._pending["layout:bf16"].result()


@needs_nvrtc
def test_matmul_compiles_for_hopper_wgmma():
    """sm_90a (what an H100/H200 gets) builds the warpgroup-MMA kernels of matmul.cu."""
    source = (compiler.KERNEL_DIR / "matmul.cu").read_text()
    ptx = compiler.compile_source(source, "matmul", "compute_90a", ptx=True).decode()
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert compiler.compile_source(source, "matmul", "sm_90a")[:4] == b"\x7fELF"


@needs_nvrtc
def test_compile_error_carries_log_and_name():
    bad = ('#include "common.cuh"\n'
           'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(KernelCompileError, match=r"(?s)broken\.cu.*sm_90.*undefined_name"):
        compiler.compile_source(bad, "broken", "sm_90")


@needs_nvrtc
def test_ptx_fallback_for_archs_nvrtc_does_not_know():
    assert compiler.target_for(90) == ("sm_90a", False)  # Hopper: wgmma needs the "a" target
    assert compiler.target_for(80) == ("sm_80", False)
    newest = max(compiler.supported_archs())
    arch, ptx = compiler.target_for(newest + 1)
    assert ptx and arch == f"compute_{newest}"


@needs_nvrtc
def test_kernel_lookup_compiles_the_shard_it_needs(tmp_path, monkeypatch):
    """A lookup by kernel name compiles (or waits for) only that kernel's shard."""
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    loaded = []

    class Loaded:  # stands in for the driver's module load (no GPU here)
        def __init__(self, unit, image, sm_count, context):
            loaded.append(unit)
            self.image = image

        def kernel(self, name):
            return (name, self.image[:4])

    monkeypatch.setattr(compiler, "CudaExecutable", Loaded)
    cache = compiler.CudaExecutableCache("test", 90, 1)
    cache.precompile_async(["float32"], ["reduce"])
    assert cache.kernel("reduce", "reduce_rows_sum_f32") == ("reduce_rows_sum_f32", b"\x7fELF")
    assert cache.kernel("layout", "take_bf16_i32") == ("take_bf16_i32", b"\x7fELF")
    assert cache.kernel("reduce", "reduce_rows_max_f32")[1] == b"\x7fELF"
    assert loaded == ["reduce:f32", "layout:bf16"]
