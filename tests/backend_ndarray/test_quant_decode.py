"""The decode step's fused projections with packed weights: ``nd.rmsnorm_matvec`` (and with
``activation="swiglu"``) and ``nd.matvec_add`` given a ``QuantizedMatrix``, on every device.

Each result is checked against a float64 computation from the matrix's exact values
(``needle.quant.format.dequantize``, float32) and the roundings of the definition
(numpy_ref/quant.py: the norm rounded to x's dtype, the product rounded once), and against
the composed ops on the same device (``quant_matmul`` of ``rmsnorm``). Formats: int8 per
channel and in groups, int4 symmetric and with offsets; sizes: k a whole number of 16-byte
chunks (CUDA's one-kernel path, quant_decode.cu) and not (the composed path), output counts
that leave a warp's last step partly empty, one row and several.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import DeviceError, DTypeError, ShapeError
from needle.quant.format import dequantize

from ..conftest import assert_close, assert_equal, check_unsupported_dtype, tolerance
from .compare import np_dtype, on, random

EPS = 1e-5
# (bits, group (None: per channel), symmetric, k)
FORMATS = [(8, None, True, 256), (8, 32, True, 512), (4, 64, True, 256), (4, 128, True, 384),
           (4, 32, False, 256), (4, 64, True, 200), (8, 16, True, 72), (4, 32, True, 224)]
OUTS = (37, 260)
QUANT_FLOATS = ("float32", "bfloat16", "float16")


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np_dtype(dtype)).astype(np.float64)


def _normed(x: np.ndarray, w: np.ndarray, dtype: str) -> np.ndarray:
    v = x.astype(np.float64)
    return _rounded(v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * w.astype(np.float64),
                    dtype)


def _packed(rng, n: int, k: int, bits: int, group, symmetric: bool, device):
    """A packed matrix on ``device`` and its exact values (float64) for the references."""
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    qm = nd.QuantizedMatrix.quantize(w, bits, group, symmetric, device=device)
    q, s = qm.qweight.numpy(), qm.scales.numpy()
    b = None if qm.offsets is None else qm.offsets.numpy()
    exact = dequantize(q, s, b, bits, qm.spec.group_size, k).astype(np.float64)
    return qm, exact


def every_format(test):
    for name, values in (("p", OUTS), ("fmt", FORMATS), ("dtype", QUANT_FLOATS)):
        ids = [str(v) for v in values] if name == "fmt" else None
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


@every_format
@pytest.mark.parametrize("rows", [1, 3])
def test_rmsnorm_matvec_with_packed_weights(device, dtype, fmt, p, rows, rng):
    bits, group, symmetric, k = fmt
    if check_unsupported_dtype(device, dtype):
        return
    x, w = random(rng, (rows, k), dtype, -2, 2), random(rng, (k,), dtype, 0.5, 1.5)
    qm, exact = _packed(rng, p, k, bits, group, symmetric, device)
    X, Wn = on(device, x), on(device, w)
    got = nd.rmsnorm_matvec(X, Wn, qm, EPS)
    assert (got.shape, got.dtype, got.device) == ((rows, p), dtype, device)
    assert_close(got, _normed(x, w, dtype) @ exact.T, dtype, "matmul")
    assert_close(got, nd.quant_matmul(X.rmsnorm(Wn, EPS), qm), dtype, "matmul")
    assert_equal(X, x)


@every_format
def test_rmsnorm_matvec_swiglu_with_packed_weights(device, dtype, fmt, p, rng):
    bits, group, symmetric, k = fmt
    if check_unsupported_dtype(device, dtype):
        return
    x, w = random(rng, (1, 1, k), dtype, -2, 2), random(rng, (k,), dtype, 0.5, 1.5)
    qm, exact = _packed(rng, 2 * p, k, bits, group, symmetric, device)
    got = nd.rmsnorm_matvec(on(device, x), on(device, w), qm, EPS, activation="swiglu")
    assert (got.shape, got.dtype) == ((1, 1, p), dtype)
    gu = _rounded(_normed(x, w, dtype) @ exact.T, dtype)
    g, u = gu[..., :p], gu[..., p:]
    assert_close(got, g / (1 + np.exp(-g)) * u, dtype, "matmul")


@every_format
def test_matvec_add_with_packed_weights(device, dtype, fmt, p, rng):
    bits, group, symmetric, k = fmt
    if check_unsupported_dtype(device, dtype):
        return
    a, t0 = random(rng, (1, 1, k), dtype, -2, 2), random(rng, (1, 1, p), dtype, -2, 2)
    qm, exact = _packed(rng, p, k, bits, group, symmetric, device)
    A, T = on(device, a), on(device, t0)
    assert nd.matvec_add(A, qm, T) is T  # in place
    y = _rounded(a.astype(np.float64) @ exact.T, dtype)
    # the add cancels: a product rounded the other way at a tie is an ulp of |y|, not of
    # the sum's
    assert_close(T, t0.astype(np.float64) + y, dtype, "matmul",
                 scale=max(1.0, float(np.abs(y).max())))
    assert_equal(A, a)


def test_packed_weights_of_the_wrong_shape_or_device_are_clear_errors(device, rng):
    qm, _ = _packed(rng, 10, 64, 8, None, True, device)
    x = on(device, random(rng, (1, 64), "float32"))
    w = on(device, random(rng, (64,), "float32"))
    with pytest.raises(ShapeError, match="gate rows then up rows"):
        nd.rmsnorm_matvec(x, w, nd.QuantizedMatrix.quantize(np.ones((9, 64), np.float32), 8,
                                                            device=device), activation="swiglu")
    with pytest.raises(ShapeError, match=r"dim = 32"):
        nd.matvec_add(x[:, :32], qm, on(device, np.zeros((1, 10), np.float32)))
    if device.kind != "metal":  # Metal has no float64
        with pytest.raises(DTypeError, match="quantized weights work with"):
            nd.rmsnorm_matvec(x.astype("float64"), w, qm)
    other = nd.cpu_numpy() if device.kind != "cpu_numpy" else nd.cpu()
    with pytest.raises(DeviceError):
        nd.rmsnorm_matvec(on(other, random(rng, (1, 64), "float32")),
                          on(other, random(rng, (64,), "float32")), qm)


CUDA = nd.cuda()


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("fmt", [(8, None, True, 512), (4, 64, True, 256), (4, 32, False, 384),
                                 (8, 16, True, 1536), (4, 128, True, 4352)], ids=str)
@pytest.mark.parametrize("stream", ["off", "always"])
def test_cuda_runs_each_projection_as_one_kernel(dtype, fmt, stream, rng):
    """On CUDA each packed projection of one row is one kernel (the model's decode step
    relies on it: five launches a layer): quant_decode.cu's, or with 16-bit x on sm_90
    quant_stream.cu's (NEEDLE_QUANT_STREAM); right against the float64 reference; a matrix
    of row views (qweight[:70]) reads its own rows."""
    if stream != "off" and CUDA.backend.device.capability < 90:
        pytest.skip("quant_stream.cu needs an sm_90 GPU")
    bits, group, symmetric, k = fmt
    sfx = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    x, w = random(rng, (1, k), dtype, -2, 2), random(rng, (k,), dtype, 0.5, 1.5)
    t0 = random(rng, (1, 70), dtype, -2, 2)
    qm, exact = _packed(rng, 140, k, bits, group, symmetric, CUDA)
    w70 = nd.QuantizedMatrix(qm.qweight[:70], qm.scales[:70],
                             None if qm.offsets is None else qm.offsets[:70], qm.spec, (70, k))
    X, Wn, T = on(CUDA, x), on(CUDA, w), on(CUDA, t0)
    with CUDA.backend.tuned(quant_stream=stream), CUDA.backend.profile() as prof:
        plain = nd.rmsnorm_matvec(X, Wn, qm, EPS)
        act = nd.rmsnorm_matvec(X, Wn, qm, EPS, activation="swiglu")
        nd.matvec_add(X, w70, T)
    calls = {name: t.calls for name, t in prof.totals.items()}
    o = "" if symmetric else "o"  # the kernels for offsets
    if stream != "off" and dtype != "float32":
        names = (f"qstream_norm{bits}{o}", f"qstream_swiglu{bits}{o}", f"qstream_add{bits}{o}")
    else:
        names = (f"rmsnorm_qmv{bits}{o}", f"rmsnorm_qmv_swiglu{bits}{o}", f"qmv_add{bits}{o}")
    assert calls == {f"{name}_{sfx}": 1 for name in names}, prof.table()
    h = _normed(x, w, dtype)
    assert_close(plain, h @ exact.T, dtype, "matmul")
    gu = _rounded(h @ exact.T, dtype)
    assert_close(act, gu[:, :70] / (1 + np.exp(-gu[:, :70])) * gu[:, 70:], dtype, "matmul")
    want = t0.astype(np.float64) + _rounded(x.astype(np.float64) @ exact[:70].T, dtype)
    assert_close(T, want, dtype, "matmul")


def _integer_x_slack(a: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """What 16-bit x taken as integers may add to each product (docs/quantization.md: each x
    value within 2^-15 of its 32-value chunk's largest |x|): 2^-15 sum_j |w_j| max_chunk(j)."""
    chunk_max = np.abs(a.astype(np.float64)).reshape(-1, 32).max(1).repeat(32)
    return (np.abs(exact) * chunk_max).sum(1) * 2.0 ** -15


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", [(8, None, True, 512), (4, 64, True, 256), (4, 32, False, 256)],
                         ids=str)
def test_packed_projection_of_x_with_wide_and_tiny_values(device, dtype, fmt, rng):
    """16-bit x holding values 10^4-10^6 apart inside one chunk of weights, and an x of
    subnormal-range values: the CUDA and CPU (AVX2, int4) kernels take x as integers with a
    power-of-two scale a chunk (kernels/quant_intx.cuh), so a wrong scale, a chunk's values
    beyond the documented rounding or a lost tiny x shows here."""
    bits, group, symmetric, k = fmt
    if check_unsupported_dtype(device, dtype):
        return
    qm, exact = _packed(rng, 70, k, bits, group, symmetric, device)
    big = 100.0 if dtype == "float16" else 1e4
    a = random(rng, (1, k), dtype, -1, 1) * np.where(np.arange(k) % 7 == 0, big, 1e-2)
    a = a.astype(np_dtype(dtype))
    t0 = np.zeros((1, 70), np_dtype(dtype))
    T = on(device, t0)
    nd.matvec_add(on(device, a), qm, T)
    want = _rounded(a.astype(np.float64) @ exact.T, dtype)[0]
    err = np.abs(T.numpy().astype(np.float64)[0] - want)
    bound = tolerance(dtype, "matmul") * np.maximum(np.abs(want), 1) + _integer_x_slack(a, exact)
    assert (err <= bound).all(), (err - bound).max()
    tiny = 1e-35 if dtype == "bfloat16" else 1e-6  # bf16 keeps float32's range
    a = (random(rng, (1, k), dtype, -1, 1) * tiny).astype(np_dtype(dtype))
    T = on(device, t0)
    nd.matvec_add(on(device, a), qm, T)
    want = _rounded(a.astype(np.float64) @ exact.T, dtype)
    assert_close(T, want, dtype, "matmul", scale=float(np.abs(want).max()))


@pytest.mark.parametrize("dtype", QUANT_FLOATS)
def test_packed_projection_of_x_with_an_infinity_or_nan_is_not_finite(device, dtype, rng):
    """A non-finite x value makes the products it enters non-finite (never a finite,
    silently wrong number)."""
    if check_unsupported_dtype(device, dtype):
        return
    qm, _ = _packed(rng, 40, 256, 4, 64, True, device)
    for bad in (np.inf, np.nan):
        a = random(rng, (1, 256), dtype, -1, 1)
        a[0, 37] = bad
        T = on(device, np.zeros((1, 40), np_dtype(dtype)))
        nd.matvec_add(on(device, a), qm, T)
        assert not np.isfinite(T.numpy().astype(np.float64)).any(), bad
