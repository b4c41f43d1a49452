"""Products of 2..16 rows with int4 weights on a GPU (kernels/quant_skinny.cu: a batched
decode step's projections, the weights read once and dequantized in registers) against the
float64 product of the dequantized matrix, and against the forms they replace (qmv per row,
dequantize + GEMM: NEEDLE_QUANT_SKINNY=0): ragged rows and outputs, group sizes, offsets."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import needle.backend_ndarray as nd
from tests.conftest import assert_close

DEV = nd.cuda(0)
RNG = np.random.default_rng(6)  # one test's draws; the parametrized cases seed their own
needs_gpu = pytest.mark.skipif(not (DEV.enabled() and DEV.backend.tuning.quant_skinny),
                               reason="the skinny int4 kernels need an sm_80+ GPU")


def _rng(*case) -> np.random.Generator:
    """The same data for a case whichever tests ran before it in its worker (a module-wide
    generator gave each case other data under xdist, and one float16 case a tolerance
    miss that other orders did not show)."""
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def _case(m, n, k, group, symmetric, dtype):
    rng = _rng(m, n, k, group, symmetric, dtype)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w[0, :3] = [0.5, -0.4, 0.0]  # an outlier in the first group
    packed = nd.QuantizedMatrix.quantize(w, 4, group, symmetric, device=DEV)
    x = nd.array(rng.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
    exact = x.numpy().astype(np.float64) @ packed.dequantize("float32").numpy().astype(
        np.float64).T
    return x, packed, exact


def _kernels(x, packed):
    with DEV.backend.profile() as prof:
        got = nd.quant_matmul(x, packed).numpy().astype(np.float64)
    return got, set(prof.totals)


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [2, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k,group,symmetric", [(70, 256, 64, True), (2048, 2048, 128, True),
                                                 (300, 1024, 128, False), (130, 5632, 64, False)])
def test_a_few_rows_read_the_weights_once(m, n, k, group, symmetric, dtype):
    x, packed, exact = _case(m, n, k, group, symmetric, dtype)
    got, kernels = _kernels(x, packed)
    assert kernels == {f"qmm4_tc{8 if m <= 8 else 16}_{'bf16' if dtype == 'bfloat16' else 'f16'}"}
    assert_close(got, exact, dtype, "matmul")
    with DEV.backend.tuned(quant_skinny=False):
        before, old = _kernels(x, packed)
    assert not any(name.startswith("qmm4") for name in old), old
    assert_close(got, before, dtype, "matmul")


@needs_gpu
def test_other_products_keep_their_kernels():
    """One row (the decode step's own kernels), 17 rows, int8, float32 x, groups of 32 and k
    not a multiple of 64 take the other forms, with the same numbers."""
    cases = [(1, 64, 256, 4, 64, "bfloat16"), (17, 64, 256, 4, 64, "bfloat16"),
             (4, 64, 256, 8, None, "bfloat16"), (4, 64, 256, 4, 64, "float32"),
             (4, 64, 256, 4, 32, "bfloat16"), (4, 64, 96, 4, 32, "bfloat16")]
    for m, n, k, bits, group, dtype in cases:
        w = RNG.standard_normal((n, k)).astype(np.float32)
        packed = nd.QuantizedMatrix.quantize(w, bits, group, True, device=DEV)
        x = nd.array(RNG.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
        got, kernels = _kernels(x, packed)
        assert not any(name.startswith("qmm4") for name in kernels), (m, bits, dtype, kernels)
        exact = x.numpy().astype(np.float64) @ packed.dequantize("float32").numpy().astype(
            np.float64).T
        assert_close(got, exact, dtype, "matmul", scale=float(np.sqrt(k)))
