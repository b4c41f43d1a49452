"""dtype names and the promotion rules of ``needle.backend_ndarray.dtypes``, as tables."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backend_ndarray import dtypes
from needle.errors import DTypeError

from ..conftest import check_unsupported_dtype, supports
from .compare import on

ORDER = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32",
         "float64")
B, U8, I8, I32, I64, F16, BF16, F32, F64 = ORDER

# PROMOTE[i][j] = promote(ORDER[i], ORDER[j]) (rule 1)
PROMOTE = [
    [B, U8, I8, I32, I64, F16, BF16, F32, F64],
    [U8, U8, I32, I32, I64, F16, BF16, F32, F64],
    [I8, I32, I8, I32, I64, F16, BF16, F32, F64],
    [I32, I32, I32, I32, I64, F16, BF16, F32, F64],
    [I64, I64, I64, I64, I64, F16, BF16, F32, F64],
    [F16, F16, F16, F16, F16, F16, F32, F32, F64],
    [BF16, BF16, BF16, BF16, BF16, F32, BF16, F32, F64],
    [F32, F32, F32, F32, F32, F32, F32, F32, F64],
    [F64, F64, F64, F64, F64, F64, F64, F64, F64],
]

# array dtype x Python scalar -> dtype the op computes in (rule 2)
SCALARS = (True, 3, 2.5)
PROMOTE_SCALAR = {
    B: (B, I32, F32),
    U8: (U8, U8, F32),
    I8: (I8, I8, F32),
    I32: (I32, I32, F32),
    I64: (I64, I64, F32),
    F16: (F16, F16, F16),
    BF16: (BF16, BF16, BF16),
    F32: (F32, F32, F32),
    F64: (F64, F64, F64),
}


def test_promotion_table_is_symmetric_and_matches():
    for i, a in enumerate(ORDER):
        for j, b in enumerate(ORDER):
            assert dtypes.promote(a, b) == PROMOTE[i][j], (a, b)
            assert dtypes.promote(b, a) == PROMOTE[i][j], (b, a)


@pytest.mark.parametrize("dtype", ORDER)
def test_scalar_promotion_table(dtype):
    for value, want in zip(SCALARS, PROMOTE_SCALAR[dtype]):
        assert dtypes.promote_scalar(dtype, value) == want, (dtype, value)
    # numpy scalars behave as the Python scalars of their kind
    for value, want in zip((np.bool_(True), np.int64(3), np.float32(2.5)), PROMOTE_SCALAR[dtype]):
        assert dtypes.promote_scalar(dtype, value) == want, (dtype, value)


def test_arithmetic_and_floating_rules():
    assert [dtypes.arithmetic(d) for d in ORDER] == [I32, U8, I8, I32, I64, F16, BF16, F32,
                                                     F64]
    assert [dtypes.floating(d) for d in ORDER] == [F32, F32, F32, F32, F32, F16, BF16, F32,
                                                   F64]
    assert [dtypes.sum_dtype(d) for d in ORDER] == [I64, I64, I64, I32, I64, F16, BF16, F32,
                                                    F64]


@pytest.mark.parametrize("a", ORDER)
def test_ops_on_device_follow_the_tables(device, a):
    """Result dtypes of real ops on every device: + (rules 1, 4), / (3), < (6), exp (5),
    and with scalars (2)."""
    if check_unsupported_dtype(device, a):
        return
    x = on(device, np.ones(3, dtypes.to_numpy_dtype(a)))
    for j, b in enumerate(ORDER):
        if check_unsupported_dtype(device, b):
            continue
        y = on(device, np.ones(3, dtypes.to_numpy_dtype(b)))
        want = PROMOTE[ORDER.index(a)][j]
        assert (x + y).dtype == dtypes.arithmetic(want), (a, b)
        assert (x / y).dtype == dtypes.floating(want), (a, b)
        assert (x < y).dtype == "bool"
        assert nd.where(x > 0, x, y).dtype == want
    for value, want in zip(SCALARS, PROMOTE_SCALAR[a]):
        assert (x * value).dtype == dtypes.arithmetic(want), (a, value)
        assert (value - x).dtype == dtypes.arithmetic(want), (a, value)
        assert (x == value).dtype == "bool"
    assert x.exp().dtype == dtypes.floating(a)
    assert (-x).dtype == dtypes.arithmetic(a)


@pytest.mark.parametrize("name,want", [
    ("float32", F32), ("float", F32), ("fp32", F32), ("half", F16), ("fp16", F16),
    ("bf16", BF16), ("double", F64), ("int", I32), ("long", I64), ("bool_", B),
    ("torch.float16", F16), ("numpy.int64", I64), (None, F32),
    (np.float32, F32), (np.dtype("int64"), I64), (np.bool_, B), (ml_dtypes.bfloat16, BF16),
    (np.float16, F16), ("bool", B), ("uint8", U8), ("int8", I8), ("byte", U8), ("char", I8),
    ("torch.uint8", U8), (np.uint8, U8), (np.dtype("int8"), I8),
])
def test_canonical_names(name, want):
    assert dtypes.canonical(name) == want


@pytest.mark.parametrize("bad", ["float8", "complex64", "int16", "", "Float32", np.complex64,
                                 np.uint16, object, 3])
def test_canonical_rejects_unknown_dtypes(bad):
    with pytest.raises(DTypeError) as e:
        dtypes.canonical(bad)
    assert "float32" in str(e.value)  # the message lists what is supported


def test_numpy_dtypes_and_sizes():
    for name in ORDER:
        npdt = dtypes.to_numpy_dtype(name)
        assert dtypes.canonical(npdt) == name
        assert dtypes.ITEMSIZE[name] == npdt.itemsize
    assert dtypes.to_numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert set(nd.ALL_DTYPES) == set(ORDER)
    assert [d for d in ORDER if dtypes.is_floating(d)] == [F16, BF16, F32, F64]
    assert [d for d in ORDER if dtypes.is_integer(d)] == [U8, I8, I32, I64]


def test_promote_scalar_rejects_non_numbers():
    with pytest.raises(DTypeError, match="str"):
        dtypes.promote_scalar("float32", "1")


@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("dst", ["int32", "int64", "uint8", "int8"])
def test_float_to_int_is_one_rule_on_every_device(device, src, dst):
    """docs/dtypes.md: truncate toward zero, saturate at the integer's range, NaN gives 0 —
    the same on every backend (they disagreed: INT_MIN on the CPUs, saturation on GPUs)."""
    if not supports(device, src):
        return
    info = np.iinfo(dst)
    values = np.array([np.nan, np.inf, -np.inf, 3.7, -3.7, 0.0, -0.0, 1e30, -1e30, 2.0**40,
                       -2.0**40, 65504.0, -0.5, 255.5, 256.0, 127.5, 128.0, -128.5, -129.0])
    x = nd.array(values.astype(np.float64), device=device, dtype=src)
    got = x.astype(dst).numpy()
    host = x.numpy().astype(np.float64)
    want = np.where(np.isnan(host), 0, np.clip(np.trunc(np.nan_to_num(host, posinf=1e300,
                                                                       neginf=-1e300)),
                                                 float(info.min), float(info.max)))
    want = [min(int(w), int(info.max)) for w in want]  # float(int64 max) rounds up to 2^63
    assert got.tolist() == want


def test_integer_arithmetic_wraps_on_every_device(device):
    """docs/dtypes.md: integer overflow wraps (two's complement), as numpy arrays do."""
    big = nd.array(np.array([2**31 - 1, -2**31], np.int32), device=device)
    np.testing.assert_array_equal((big + 1).numpy(), [-2**31, -2**31 + 1])
    np.testing.assert_array_equal((big * 2).numpy(), [-2, 0])
