"""Products of 2..16 rows with int8 / int4 weights on a GPU (kernels/quant_skinny.cu: a
batched decode step's projections, the weights read once and dequantized in registers)
against the float64 product of the dequantized matrix, and against the forms they replace
(qmv per row, dequantize + GEMM: NEEDLE_QUANT_SKINNY=0): ragged rows and outputs, group
sizes (the GGUF formats' 16 and 32 too), offsets, each load width (qmm{8,4}w{1,2,4})."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.cuda.quant_skinny import _load_width
from needle.quant.format import QuantSpec, pack
from tests.conftest import assert_close

DEV = nd.cuda(0)
RNG = np.random.default_rng(6)  # one test's draws; the parametrized cases seed their own
needs_gpu = pytest.mark.skipif(not (DEV.enabled() and DEV.backend.tuning.quant_skinny),
                               reason="the skinny quantized kernels need an sm_80+ GPU")


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
    sfx = "bf16" if dtype == "bfloat16" else "f16"
    width = _load_width(4, k, group)
    assert kernels == {f"qmm4w{width}_tc{8 if m <= 8 else 16}_{sfx}"}, kernels
    assert_close(got, exact, dtype, "matmul")
    _same_as_before(got, x, packed, m, dtype)


def _same_as_before(got, x, packed, m, dtype):
    """The forms the kernel replaces give the same numbers: qmv per row (W exact) up to 8
    rows; from 9, dequantize + GEMM, which rounds W to x's dtype first (a second rounding
    of about the output's: scale 2)."""
    with DEV.backend.tuned(quant_skinny=False):
        before, old = _kernels(x, packed)
    assert not any(name.startswith("qmm") for name in old), old
    assert_close(got, before, dtype, "matmul", scale=1.0 if m <= 8 else 2.0)


def _packed_case(m, n, k, bits, group, offsets, dtype):
    """Random stored values over the whole range (int8 -128..127, int4 0..15), scales and
    offsets as a GGUF repack makes them."""
    rng = _rng(m, n, k, bits, group, offsets, dtype)
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    values = rng.integers(lo, hi, (n, k))
    groups = -(-k // group)
    # elements of about 1 / sqrt(k), so that the products are about 1
    typical = (64 if bits == 8 else 6) * np.sqrt(k)
    scales = ((rng.random((n, groups)) + 0.5) / typical).astype(np.float32)
    offs = (rng.standard_normal((n, groups)) * 6 / typical).astype(np.float32) if offsets \
        else None
    packed = nd.QuantizedMatrix.from_packed(pack(values, bits), scales, offs,
                                            QuantSpec(bits, group, offsets), k, device=DEV)
    x = nd.array(rng.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
    exact = x.numpy().astype(np.float64) @ packed.dequantize("float32").numpy().astype(
        np.float64).T
    return x, packed, exact


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [2, 7, 8, 9, 16])
@pytest.mark.parametrize("bits,n,k,group,offsets", [
    (8, 70, 256, 256, False),     # per output channel
    (8, 300, 1024, 32, False),    # GGUF Q8_0
    (8, 130, 5632, 32, True),     # GGUF Q5_K (int8 with offsets)
    (8, 96, 2048, 16, False),     # GGUF Q6_K
    (8, 40, 4096, 4096, False),   # few rows, long k: 16 warps a block
    (4, 70, 256, 32, False),      # GGUF Q4_0
    (4, 300, 5632, 32, True),     # GGUF Q4_K
    (4, 33, 96, 32, True),        # k not a multiple of 64
    (4, 64, 14336, 64, False),    # long k (x read through L1, not staged)
    (8, 50, 1024, 64, False),     # sets of 4 words a lane
    (4, 20, 3072, 128, True),
])
def test_int8_and_gguf_groups(m, bits, n, k, group, offsets, dtype):
    """int8 (per channel, groups of 16-64) and int4 in groups of 32, with and without
    offsets: the formats GGUF files repack into, over the whole range of stored values."""
    x, packed, exact = _packed_case(m, n, k, bits, group, offsets, dtype)
    got, kernels = _kernels(x, packed)
    sfx = "bf16" if dtype == "bfloat16" else "f16"
    width = _load_width(bits, k, group)
    assert kernels == {f"qmm{bits}w{width}_tc{8 if m <= 8 else 16}_{sfx}"}, kernels
    assert_close(got, exact, dtype, "matmul")
    _same_as_before(got, x, packed, m, dtype)


@needs_gpu
def test_other_products_keep_their_kernels():
    """One row (the decode step's own kernels), 17 rows, float32 x, int4 groups of 16 and
    int8 rows whose k is not a multiple of 16 take the other forms, with the same numbers."""
    cases = [(1, 64, 256, 4, 64, "bfloat16"), (17, 64, 256, 4, 64, "bfloat16"),
             (1, 64, 256, 8, None, "bfloat16"), (4, 64, 256, 4, 64, "float32"),
             (4, 64, 256, 4, 16, "bfloat16"), (4, 64, 100, 8, None, "bfloat16")]
    for m, n, k, bits, group, dtype in cases:
        w = RNG.standard_normal((n, k)).astype(np.float32)
        packed = nd.QuantizedMatrix.quantize(w, bits, group, True, device=DEV)
        x = nd.array(RNG.standard_normal((m, k)).astype(np.float32), device=DEV, dtype=dtype)
        got, kernels = _kernels(x, packed)
        assert not any(name.startswith("qmm") for name in kernels), (m, bits, dtype, kernels)
        exact = x.numpy().astype(np.float64) @ packed.dequantize("float32").numpy().astype(
            np.float64).T
        assert_close(got, exact, dtype, "matmul", scale=float(np.sqrt(k)))
