"""Device tuning objects: read once from the environment, changed for a block by
``backend.tuned(...)``; CudaTuning needs no GPU to test (it is pure configuration)."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import DeviceError


def test_cuda_tuning_from_the_device_and_the_environment():
    from needle.backends.cuda.tuning import CudaTuning

    hopper = CudaTuning.for_device(90, "sm_90a", env={})
    assert (hopper.wgmma, hopper.tma, hopper.pdl, hopper.mma, hopper.gemm) == \
        (True, True, True, True, "tma")
    ampere = CudaTuning.for_device(80, "sm_80", env={})
    assert (ampere.wgmma, ampere.tma, ampere.pdl, ampere.mma) == (False, False, False, True)
    assert not CudaTuning.for_device(75, "sm_75", env={}).mma
    env = {"NEEDLE_WGMMA": "0", "NEEDLE_PDL": "0", "NEEDLE_GEMM": "wgmma",
           "NEEDLE_TC_TILE": "256", "NEEDLE_WGMMA_TILE": "128",
           "NEEDLE_CUDA_OPTIONS": "-DTC_STAGES=3 -DWG_STAGES=2 -DGEMM_TMA_STAGES=5 -DOTHER=1"}
    t = CudaTuning.for_device(90, "sm_90a", env=env)
    assert (t.wgmma, t.tma, t.pdl, t.gemm, t.tc_tile, t.wgmma_tile) == \
        (False, False, False, "wgmma", 256, "128")
    assert (t.tc_stages, t.wg_stages) == (3, 2)
    assert dict(t.tma_stages) == {256: 5, 176: 6, 160: 6, 128: 7, 80: 9, 64: 10}
    one = CudaTuning.for_device(90, "sm_90a",
                                env={"NEEDLE_CUDA_OPTIONS": "-DGEMM_TMA_STAGES_80=4"})
    assert dict(one.tma_stages) == {**dict(hopper.tma_stages), 80: 4}
    assert CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_TMA_TILE": "128"}).tma_tile == 128
    assert hopper.tma_tile is None
    with pytest.raises(DeviceError, match="NEEDLE_TMA_TILE='96' is not a TMA GEMM tile width"):
        CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_TMA_TILE": "96"})
    assert hopper.tma_groups is None  # one persistent group an SM
    assert CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_TMA_GROUPS": "7"}).tma_groups == 7
    for bad in ("0", "-2", "many"):
        with pytest.raises(DeviceError, match=f"NEEDLE_TMA_GROUPS='{bad}': use a positive"):
            CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_TMA_GROUPS": bad})
    # the quantized prefill GEMM: "auto" on Hopper, never elsewhere (its kernels need sm_90a)
    assert (hopper.quant_gemm, ampere.quant_gemm) == ("auto", "off")
    for value, choice in [("always", "always"), ("1", "always"), ("off", "off"), ("0", "off")]:
        assert CudaTuning.for_device(90, "sm_90a",
                                     env={"NEEDLE_QUANT_GEMM": value}).quant_gemm == choice
    assert CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_WGMMA": "0"}).quant_gemm == "off"
    with pytest.raises(DeviceError, match="NEEDLE_QUANT_GEMM='yes': use auto, always or off"):
        CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_QUANT_GEMM": "yes"})
    # one token's streamed quantized projections: "auto" on sm_90 (bulk copies, mbarriers)
    assert (hopper.quant_stream, ampere.quant_stream) == ("auto", "off")
    assert CudaTuning.for_device(90, "sm_90", env={}).quant_stream == "auto"
    assert CudaTuning.for_device(90, "sm_90a",
                                 env={"NEEDLE_QUANT_STREAM": "0"}).quant_stream == "off"
    with pytest.raises(DeviceError, match="NEEDLE_QUANT_STREAM='on': use auto, always or off"):
        CudaTuning.for_device(90, "sm_90a", env={"NEEDLE_QUANT_STREAM": "on"})


def test_float32_on_fp64_tensor_cores_follows_the_model_and_the_environment():
    """On by default only for sm_90 parts whose FP64 tensor cores run at full rate (the
    export parts' ~1 TFLOP/s would make every large float32 product 50x slower)."""
    from needle.backends.cuda.tuning import CudaTuning

    def on(capability, arch, model, **env):
        return CudaTuning.for_device(capability, arch, env=env, model=model).f32_on_f64

    assert on(90, "sm_90a", "NVIDIA H100 80GB HBM3")
    assert on(90, "sm_90a", "NVIDIA GH200 480GB") and on(90, "sm_90a", "NVIDIA H200")
    assert not on(90, "sm_90a", "NVIDIA H800") and not on(90, "sm_90a", "NVIDIA H20")
    assert on(90, "sm_90a", "NVIDIA H20", NEEDLE_F32_ON_F64="1")
    assert not on(90, "sm_90a", "NVIDIA H100 80GB HBM3", NEEDLE_F32_ON_F64="0")
    assert not on(89, "sm_89", "NVIDIA L4", NEEDLE_F32_ON_F64="1")  # no f64 m16n8k16
    assert not CudaTuning.for_device(90, "sm_90a", env={}).f32_on_f64  # model unknown
    with pytest.raises(DeviceError, match="NEEDLE_F32_ON_F64='yes'"):
        on(90, "sm_90a", "NVIDIA H100", NEEDLE_F32_ON_F64="yes")


@pytest.mark.parametrize("m,p,batch,width", [
    (1024, 1024, 1, 64),     # 32 tiles of 128x256 for 132 SMs; 128 tiles of 128x64: one wave
    (4096, 4096, 1, 256),    # 512 wide tiles: 4 waves; narrower ones need as many columns more
    (2048, 2048, 1, 256),    # 128 wide tiles: one wave
    (2048, 2560, 1, 128),    # 160 wide tiles: 2 waves; 320 of 128: 3 waves of a tile half as wide
    (128, 64, 1, 64),        # narrower than a 128-wide tile
    (128, 100, 3, 64),
])
def test_tma_tile_width_counts_waves(m, p, batch, width):
    from needle.backends.cuda.tuning import tma_stages, tma_width

    assert tma_width(m, p, batch, 132) == width
    assert [tma_stages(w) for w in (256, 176, 160, 128, 80, 64)] == [4, 5, 4, 4, 6, 8]


def test_tma_stage_table_is_the_kernels():
    """The host sizes each TMA GEMM launch's shared memory from tuning.TMA_STAGES; the
    kernel lays its stages out from gemm_tma.cu's GEMM_TMA_DEFAULT_<W>: a kernel with more
    stages than the host reserved for would write past its shared memory."""
    import re

    from needle.backends.cuda.compiler import KERNEL_DIR
    from needle.backends.cuda.tuning import TMA_STAGES

    source = (KERNEL_DIR / "gemm_tma.cu").read_text()
    kernel = {int(w): int(s) for w, s in re.findall(r"#define GEMM_TMA_DEFAULT_(\d+) (\d+)",
                                                   source)}
    assert kernel == dict(TMA_STAGES)


@pytest.mark.parametrize("m,p,width", [
    (2048, 2560, 160),  # 256 tiles of 128x160: 2 waves (160 of 256: 2, 320 of 128: 3)
    (1024, 2560, 160),  # 128 tiles: one wave (80 of 256 wide: one wave of a wider tile)
    (512, 2560, 80),    # 128 tiles of 80 wide: one wave (80 of 128 wide: one wave of a wider
                        # tile; 160 of 64 wide: two)
    (512, 2048, 64),    # 128 tiles of 64 wide: one wave (104 of 80 wide: one wave, wider)
    (640, 2048, 80),    # 130 tiles of 80 wide: one wave (160 of 64 wide: two)
    (512, 11264, 176),  # 256 tiles of 128x176: 2 waves (352 of 128: 3)
    (2048, 11264, 256),  # 704 of 256: 6 waves; 1,024 of 176: 8
    (2048, 2048, 256),  # 2,048 columns are 13 tiles of 160, 8 of 256
    (4096, 4096, 256),
])
def test_k_major_products_may_take_80_160_and_176_wide_tiles(m, p, width):
    from needle.backends.cuda.tuning import K_MAJOR_WIDTHS, tma_width

    assert tma_width(m, p, 1, 132, K_MAJOR_WIDTHS) == width


def test_metal_tuning_reads_and_checks_its_variables():
    from needle.backends.metal.backend import MetalTuning

    t = MetalTuning.from_env({"NEEDLE_METAL_COMMIT_EVERY": "16", "NEEDLE_METAL_IN_FLIGHT": "2"})
    assert (t.commit_every, t.max_in_flight) == (16, 2)
    assert MetalTuning.from_env({}) == MetalTuning()
    with pytest.raises(DeviceError, match="NEEDLE_METAL_IN_FLIGHT must be a positive integer"):
        MetalTuning.from_env({"NEEDLE_METAL_IN_FLIGHT": "0"})


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_tuned_changes_a_block_and_restores(kind):
    """``tuned`` swaps the tuning for a block (and the queue follows it) and results stay
    right with the other choice: CUDA's split-K float32 product on and off; Metal's command
    buffers committed after every dispatch."""
    device = nd.device_from_name(kind)
    if not device.enabled():
        pytest.skip(f"{kind} disabled: {device.reason}")
    backend = device.backend
    before = backend.tuning
    change = {"split_k": not before.split_k} if kind == "cuda" else {"commit_every": 1}
    a = np.random.default_rng(0).standard_normal((64, 700)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((700, 48)).astype(np.float32)
    x, y = nd.array(a, device=device), nd.array(b, device=device)
    with backend.tuned(**change) as changed:
        assert backend.tuning is changed and changed != before
        if kind == "metal":
            assert backend.queue.commit_every == 1
        np.testing.assert_allclose((x @ y).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert backend.tuning is before
    if kind == "metal":
        assert backend.queue.commit_every == before.commit_every
