"""Quantized weights on every device against the reference (numpy_ref/quant.py): odd
shapes, group boundaries, both bit widths, symmetric and offset formats, every activation
dtype; the packing round-trips; bad inputs are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.api import has
from needle.errors import DeviceError, DTypeError, ShapeError
from needle.quant.format import QuantSpec, dequantize, pack, quantize, unpack
from tests.conftest import assert_close

# (m, n, k, bits, group, symmetric): odd k (a partial last word and group), k a multiple of
# the 16-byte chunk (the fast GPU path), per-channel int8 (group None), GGUF's int8 groups of 16
CASES = [
    (1, 37, 100, 8, None, True), (3, 5, 61, 8, 16, True), (1, 64, 256, 8, 32, True),
    (1, 33, 100, 4, 32, True), (2, 7, 75, 4, 64, False), (1, 70, 512, 4, 128, True),
    (1, 16, 256, 4, 64, False), (12, 9, 128, 4, 32, True), (12, 9, 96, 8, None, True),
    # groups that are no multiple of 8 (int4's start mid-word: the CPU's general path;
    # int8's start at any byte), five rows (the CPU's four-row blocks and a remainder)
    (1, 5, 50, 4, 12, True), (2, 13, 77, 4, 20, False), (1, 11, 90, 8, 12, True),
    # int4 groups of whole 64-value blocks (the CPU's transposed-x path) with a partial block
    # in the last group, and a batched decode of five rows
    (1, 9, 200, 4, 128, False), (5, 6, 320, 4, 64, True),
    # int4 in 128-value steps (x86 with AVX-512 VNNI): groups of 32 over whole steps, a
    # last block of 64 and a ragged end; groups of 256 spanning two steps, the last one short
    (1, 11, 352, 4, 32, False), (3, 6, 384, 4, 32, True), (1, 5, 640, 4, 256, True),
]


def _matrix(rng, n, k, bits, group, symmetric, device):
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :3] = [4.0, -3.0, 0.0]  # an outlier in the first group
    return nd.QuantizedMatrix.quantize(w, bits, group, symmetric, device=device)


def _copy(w, device):
    """The packed matrix ``w`` (its very words, scales and offsets) on ``device``."""
    return nd.QuantizedMatrix(*(nd.array(a.numpy(), device=device) if a is not None else None
                                for a in (w.qweight, w.scales, w.offsets)), w.spec, w.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_quant_matmul_matches_the_reference(device, reference, rng, case, dtype):
    m, n, k, bits, group, symmetric = case
    w_ref = _matrix(rng, n, k, bits, group, symmetric, reference)
    w_dev = _copy(w_ref, device)
    x = rng.standard_normal((m, k)).astype(np.float32)
    expected = nd.quant_matmul(nd.array(x, device=reference, dtype=dtype), w_ref)
    got = nd.quant_matmul(nd.array(x, device=device, dtype=dtype), w_dev)
    assert got.shape == (m, n) and got.dtype == dtype
    # bf16/fp16 prefill products may round W to the dtype first: the dtype's matmul
    # tolerance relative to the size of the terms' sum (sqrt(k) for unit-variance data)
    assert_close(got, expected, dtype, kind="matmul", scale=float(np.sqrt(k)))


@pytest.mark.parametrize("k", [83, 256])  # rows that split a word; whole words and groups
@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (8, 16, True),
                                                  (4, 32, True), (4, 64, False)])
def test_dequantize_matches_the_reference(device, reference, rng, bits, group, symmetric, k):
    w_ref = _matrix(rng, 11, k, bits, group, symmetric, reference)
    w_dev = _copy(w_ref, device)
    for dtype in ("float32", "bfloat16"):
        assert_close(w_dev.dequantize(dtype), w_ref.dequantize(dtype), dtype)


@pytest.mark.parametrize("n,k,bits,group,symmetric", [(300, 2048, 4, 128, True),
                                                    (130, 1024, 8, None, True),
                                                    (77, 640, 4, 32, False)])
def test_dequantize_a_layer_sized_matrix(device, reference, rng, n, k, bits, group, symmetric):
    """Matrices of many warps' blocks of words with a partial last block (the GPU's fast path
    gives each warp 128 consecutive words): every value as the reference makes it."""
    w_ref = _matrix(rng, n, k, bits, group, symmetric, reference)
    w_dev = _copy(w_ref, device)
    for dtype in ("float32", "bfloat16"):
        got, want = w_dev.dequantize(dtype).numpy(), w_ref.dequantize(dtype).numpy()
        if symmetric:  # one product, one rounding: the same bits
            np.testing.assert_array_equal(got, want)
        else:  # a fused multiply-add where the reference may round twice
            assert_close(got, want, dtype)


def test_quant_matmul_on_a_batch_of_sequences(device, rng):
    w = _matrix(rng, 24, 64, 4, 32, False, device)
    x = nd.array(rng.standard_normal((2, 3, 64)).astype(np.float32), device=device)
    y = nd.quant_matmul(x, w)
    assert y.shape == (2, 3, 24)
    expected = x.numpy().reshape(6, 64) @ w.dequantize().numpy().T
    np.testing.assert_allclose(y.numpy().reshape(6, 24), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_round_trips_and_numbers_follow_the_documented_rule(rng, bits):
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    values = rng.integers(lo, hi, size=(5, 19))
    q = pack(values, bits)
    assert q.dtype == np.int32 and q.shape == (5, -(-19 // (32 // bits)))
    np.testing.assert_array_equal(unpack(q, bits, 19), values)
    # element j sits in bits (j % per) * bits of word j // per, little end first
    per = 32 // bits
    word = int(q.view(np.uint32)[1, 0])
    assert (word >> ((3 % per) * bits)) & ((1 << bits) - 1) == values[1, 3] & ((1 << bits) - 1)
    scales = rng.random((5, 2)).astype(np.float32)
    w = dequantize(q, scales, None, bits, 10, 19)
    shift = 8 if bits == 4 else 0
    assert w[2, 12] == np.float32(values[2, 12] - shift) * scales[2, 1]


def test_quantization_error_is_bounded(rng):
    w = rng.standard_normal((8, 256)).astype(np.float32)
    for bits, group, sym, bound in ((8, None, True, 1 / 127), (4, 64, True, 1 / 7),
                                    (4, 64, False, 1 / 15)):
        q, s, b = quantize(w, bits, group, sym)
        back = dequantize(q, s, b, bits, group or 256, 256)
        groups = w.reshape(8, -1, group or 256)
        span = np.abs(groups).max(2) if sym else np.ptp(groups, axis=2)
        err = np.abs(back - w).reshape(groups.shape).max(2)
        assert np.all(err <= span * bound * 0.5001 + 1e-7)


def test_bad_arguments_are_clear_errors(rng):
    dev = nd.cpu_numpy()
    w = _matrix(rng, 4, 64, 4, 32, True, dev)
    with pytest.raises(ShapeError, match="end in the matrix's k = 64"):
        nd.quant_matmul(nd.zeros((2, 63), device=dev), w)
    with pytest.raises(DTypeError, match="not float64"):
        nd.quant_matmul(nd.zeros((2, 64), dtype="float64", device=dev), w)
    with pytest.raises(ShapeError, match="8 or 4 bits"):
        QuantSpec(3, 32)
    with pytest.raises(ShapeError, match="qweight must be int32"):
        nd.QuantizedMatrix(w.scales, w.scales, None, w.spec, w.shape)
    with pytest.raises(ShapeError, match="4-bit values must lie in 0..15"):
        pack(np.full((1, 8), 16), 4)


def test_a_device_without_the_capability_says_so(rng):
    for dev in nd.all_devices():
        if dev.enabled() and not has(dev.backend, "int4"):
            w = _matrix(rng, 4, 64, 4, 32, True, dev)
            with pytest.raises(DeviceError, match="capability 'int4'"):
                nd.quant_matmul(nd.zeros((1, 64), device=dev), w)
    assert has(nd.cpu_numpy().backend, "int4") and has(nd.cpu_numpy().backend, "int8")


def test_a_matrix_of_row_views_reads_its_own_rows(device, reference, rng):
    """A QuantizedMatrix built from views (rows 3.. of a packed matrix) multiplies by those
    rows, as the matrix packed from them does."""
    w = rng.standard_normal((9, 64)).astype(np.float32)
    full = nd.QuantizedMatrix.quantize(w, 4, 32, False, device=device)
    part = nd.QuantizedMatrix(full.qweight[3:], full.scales[3:], full.offsets[3:], full.spec,
                              (6, 64))
    alone = nd.QuantizedMatrix.quantize(w[3:], 4, 32, False, device=device)
    x = nd.array(rng.standard_normal((1, 64)).astype(np.float32), device=device)
    assert_close(nd.quant_matmul(x, part), nd.quant_matmul(x, alone), "float32")
