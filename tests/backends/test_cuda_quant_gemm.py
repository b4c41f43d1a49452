"""Prefill products with int8 / int4 weights on Hopper (kernels/quant_gemm.cu: W dequantized in
registers as the warpgroup MMA's operand; opt-in, NEEDLE_QUANT_GEMM=1) against the float64
product of the dequantized matrix, and against the default form (dequantize into a
workspace + the GEMM): ragged tokens and rows, both bit widths, offsets, per-row and grouped
scales, 64- and 128-token tiles, several tiles a group."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import needle.backend_ndarray as nd
from tests.conftest import assert_close

DEV = nd.cuda(0)
needs_hopper = pytest.mark.skipif(not (DEV.enabled() and DEV.backend.tuning.tma),
                                  reason="the quantized GEMM needs an sm_90a GPU (Hopper)")


@pytest.fixture(autouse=True)
def _opted_in():
    """The kernel is opt-in (NEEDLE_QUANT_GEMM=1); these tests switch it on."""
    if not (DEV.enabled() and DEV.backend.tuning.tma):
        yield
        return
    with DEV.backend.tuned(quant_gemm=True):
        yield


def _case(m, n, k, bits, group, symmetric, dtype):
    rng = np.random.default_rng(zlib.crc32(repr((m, n, k, bits, group, symmetric)).encode()))
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w[0, :3] = [0.5, -0.4, 0.0]  # an outlier in the first group
    w[-1, -5:] = [0.3, 0.0, -0.6, 0.1, 0.2]  # and in the last row's last group
    packed = nd.QuantizedMatrix.quantize(w, bits, group, symmetric, device=DEV)
    x = nd.array(rng.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
    return x, packed


def _exact(x, packed, dtype):
    """The float64 product with W's float32 values, or (dtype) with W rounded to dtype."""
    return x.numpy().astype(np.float64) @ packed.dequantize(dtype).numpy().astype(np.float64).T


def _kernels(x, packed):
    with DEV.backend.profile() as prof:
        got = nd.quant_matmul(x, packed).numpy().astype(np.float64)
    return got, set(prof.totals)


def _mode(bits, group, symmetric):
    """The kernel's suffix: offsets ("o"); symmetric groups of whole 64-value k steps or one
    a row summed exactly and scaled once ("g"); smaller groups dequantized value by value."""
    return "o" if not symmetric else "g" if group is None or group >= 64 else ""


@needs_hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k,bits,group,symmetric", [
    (17, 128, 64, 4, 64, True),  # the fewest rows it takes, one k step, one group a row
    (130, 200, 256, 4, 32, False),  # ragged tokens and rows, two groups a k step, offsets
    (512, 384, 2048, 4, 128, True),  # a prefill's shape: a group over two k steps
    (300, 130, 256, 4, 16, True),  # four groups a k step
    (257, 256, 5632, 4, 64, False),  # the down projection's k
    (64, 136, 320, 8, None, True),  # int8 per row (one scale a row)
    (200, 300, 512, 8, 32, True),  # int8 in groups of 32 (GGUF Q8_0's form)
    (129, 64, 1024, 8, 256, True),  # int8 in groups over four k steps
    (1100, 2048, 512, 4, 128, True),  # 128-token tiles, more than multiprocessors
])
def test_many_rows_dequantize_in_registers(m, n, k, bits, group, symmetric, dtype):
    x, packed = _case(m, n, k, bits, group, symmetric, dtype)
    got, kernels = _kernels(x, packed)
    mode = _mode(bits, group, symmetric)
    (name,) = kernels
    assert name.startswith(f"qgemm{bits}{mode}_"), kernels
    # "g" multiplies W's float32 values (rounded nowhere); the others W rounded to dtype
    assert_close(got, _exact(x, packed, "float32" if mode == "g" else dtype), dtype, "matmul")
    with DEV.backend.tuned(quant_gemm=False):
        before, old = _kernels(x, packed)
    assert not any(name.startswith("qgemm") for name in old), old
    # the workspace form's products are those of W rounded to dtype: the same as the
    # dequantizing modes' (sums in another order); "g" is a weight's rounding from it
    assert_close(got, before, dtype, "matmul", scale=2.0 if mode == "g" else None)


@needs_hopper
def test_tiles_follow_the_product_size():
    """128-token tiles where they fill the multiprocessors, 64-token ones where not."""
    for m, n, wide in [(64, 256, False), (128 * 4, 128 * DEV.backend.device.compute_units, True)]:
        x, packed = _case(m, n, 256, 4, 64, True, "bfloat16")
        got, kernels = _kernels(x, packed)
        assert kernels == {"qgemm4g_bf16" if wide else "qgemm4g_t64_bf16"}, kernels
        assert_close(got, _exact(x, packed, "float32"), "bfloat16", "matmul")


@needs_hopper
@pytest.mark.parametrize("group,name", [(64, "qgemm4g_t64_bf16"), (32, "qgemm4_t64_bf16")])
def test_non_finite_x_gives_non_finite_rows(group, name):
    x, packed = _case(40, 128, 256, 4, group, True, "bfloat16")
    host = x.numpy().astype(np.float32)
    host[3, 5], host[7, 100] = np.inf, np.nan
    got, kernels = _kernels(nd.array(host, device=DEV, dtype="bfloat16"), packed)
    assert kernels == {name}
    assert not np.isfinite(got[3]).any() and np.isnan(got[7]).all()
    assert np.isfinite(np.delete(got, [3, 7], axis=0)).all()


@needs_hopper
def test_other_products_keep_their_forms():
    """float32 x, k not a multiple of 64, groups that are no power of two and a group count
    that is no multiple of 4 take the workspace form, with the same numbers."""
    for m, n, k, bits, group, dtype in [(40, 64, 256, 4, 64, "float32"),
                                        (40, 64, 96, 4, 32, "bfloat16"),
                                        (40, 64, 384, 8, 48, "bfloat16"),
                                        (40, 64, 384, 4, 64, "bfloat16")]:
        x, packed = _case(m, n, k, bits, group, True, dtype)
        got, kernels = _kernels(x, packed)
        assert not any(name.startswith("qgemm") for name in kernels), (m, k, group, kernels)
        assert_close(got, _exact(x, packed, dtype), dtype, "matmul", scale=float(np.sqrt(k)))
