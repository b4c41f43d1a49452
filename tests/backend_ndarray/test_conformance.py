"""Conformance of the memory, layout, elementwise, cast and where functions of the array API.

Each test runs one op on every device (the ``device`` fixture) for every dtype the op accepts,
and compares with the reference backend and with plain numpy in float64 (design §7).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import DTypeError

from ..conftest import assert_close, assert_equal, check_unsupported_dtype
from .compare import FLOATS, INTS, LAYOUTS, compare, grid, layout, np_dtype, on, random

ALL = nd.ALL_DTYPES
SIZES = (0, 1, 7, 33)
BIG = 1_000_003


def _num(x: np.ndarray) -> np.ndarray:
    """bools as ints: needle does arithmetic on bools in int32 (dtypes rule 4)."""
    return x.astype(np.int64) if x.dtype == np.bool_ else x


# --- memory -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("size", SIZES)
def test_from_numpy_to_numpy_roundtrip(device, dtype, size, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (size,), dtype, -100, 100)
    a = on(device, x)
    assert (a.shape, a.dtype, a.size, a.device) == ((size,), dtype, size, device)
    out = a.numpy()
    assert out.dtype == np_dtype(dtype)
    assert_equal(out, x)


def test_roundtrip_big(device, rng):
    x = random(rng, (BIG,), "float32")
    assert_equal(on(device, x).numpy(), x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_roundtrip_keeps_special_values(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    x = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1.0], dtype=np_dtype(dtype))
    out = on(device, x).numpy()
    assert_equal(out, x)
    assert np.signbit(out[3]) and not np.signbit(out[4])


@pytest.mark.parametrize("dtype", ALL)
def test_zero_dim_array(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    x = np.array(3, dtype=np_dtype(dtype)) if dtype != "bool" else np.array(True)
    a = on(device, x)
    assert a.shape == () and a.size == 1
    assert a.item() == x.item()
    assert_equal(a.numpy(), x)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (33, 3), (2, 0, 3), ()])
def test_fill_and_constructors(device, dtype, shape):
    if check_unsupported_dtype(device, dtype):
        return
    values = {"bool": [True, False], "int32": [0, -7, 2**31 - 1], "int64": [0, -7, 2**40],
              "uint8": [0, 7, 255], "int8": [0, -7, -128, 127]}
    for v in values.get(dtype, [0, 1, -2.5, 1e4]):
        a = nd.full(shape, v, dtype=dtype, device=device)
        assert (a.shape, a.dtype, a.device) == (shape, dtype, device)
        assert_equal(a.numpy(), np.full(shape, v, dtype=np_dtype(dtype)))
    assert_equal(nd.zeros(shape, dtype, device).numpy(), np.zeros(shape))
    assert_equal(nd.ones(shape, dtype, device).numpy(), np.ones(shape))
    e = nd.empty(shape, dtype, device)
    assert (e.shape, e.dtype) == (shape, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_fill_special_values(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    for v in (math.inf, -math.inf, math.nan, -0.0):
        got = nd.full((5,), v, dtype=dtype, device=device).numpy()
        assert_equal(got, np.full(5, v, dtype=np_dtype(dtype)))


def test_fill_non_compact_writes_only_the_view(device):
    a = nd.zeros((4, 6), "float32", device)
    a[1:3, ::2].fill(5.0)
    want = np.zeros((4, 6), np.float32)
    want[1:3, ::2] = 5
    assert_equal(a.numpy(), want)


# --- layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (1, 7), (4, 1, 1, 2)])
def test_compact(device, dtype, kind, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    base, view = layout(shape, kind)
    x = random(rng, base, dtype, -50, 50)
    v = view(on(device, x))
    assert v.shape == shape
    c = v.compact()
    assert c.is_compact() and c.shape == shape and c.dtype == dtype
    assert_equal(c.numpy(), view(x))
    assert_equal(v.numpy(), view(x))  # to_numpy reads strided views too


SETITEM_INDICES = [
    (slice(None),),
    (1,),
    (-1, slice(None, None, 2)),
    (slice(1, 4), slice(None, None, -1)),
    (slice(None, None, -2), 2),
    (Ellipsis, 0),
    (slice(3, 1, -1), slice(1, 5, 3)),
    (slice(0, 0),),
    (None, slice(1, 3)),
]


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("index", SETITEM_INDICES, ids=repr)
def test_setitem_scalar(device, dtype, index, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (5, 6), dtype, -9, 9)
    a = on(device, x)
    value = True if dtype == "bool" else 3
    a[index] = value
    x[index] = value
    assert_equal(a.numpy(), x)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("index", SETITEM_INDICES, ids=repr)
def test_setitem_array(device, dtype, index, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (5, 6), dtype, -9, 9)
    a = on(device, x)
    target_shape = x[index].shape
    src = random(rng, target_shape, dtype, -9, 9)
    a[index] = on(device, src)
    x[index] = src
    assert_equal(a.numpy(), x)


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "bfloat16"])
def test_setitem_broadcast_cast_and_noncompact_source(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (4, 5, 6), dtype, -9, 9)
    a = on(device, x)
    row = random(rng, (6,), "float32", -9, 9)  # another dtype: cast on assignment
    a[1:3, ::-2] = on(device, row)
    x[1:3, ::-2] = row.astype(x.dtype)
    src = random(rng, (7, 5), dtype, -9, 9)  # a transposed, sliced (non-compact) source
    a[2] = on(device, src).transpose((1, 0))[:, :6]
    x[2] = src.T[:, :6]
    a[..., 0] = [1, 0, 1, 1, 0]  # a Python list, broadcast over the first axis
    x[..., 0] = np.array([1, 0, 1, 1, 0]).astype(x.dtype)
    assert_equal(a.numpy(), x)


def test_setitem_into_view_changes_base(device):
    a = nd.zeros((3, 4), "float32", device)
    v = a[1:, ::-1]
    v[0, 0] = 7.0
    v[1] = on(device, np.arange(4, dtype=np.float32))
    want = np.zeros((3, 4), np.float32)
    want[1, 3] = 7
    want[2, ::-1] = np.arange(4)
    assert_equal(a.numpy(), want)


# --- binary ops ---------------------------------------------------------------------------

def _power(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Integer powers clamp negative exponents to 0 (the reference's rule: no int results
    for 1 / x**n)."""
    if x.dtype.kind == "i" and y.dtype.kind == "i":
        return np.power(x, np.maximum(y, 0))
    return np.power(x, y)


BINARY = {
    "add": (lambda a, b: a + b, lambda x, y: _num(x) + _num(y)),
    "sub": (lambda a, b: a - b, lambda x, y: _num(x) - _num(y)),
    "mul": (lambda a, b: a * b, lambda x, y: _num(x) * _num(y)),
    "div": (lambda a, b: a / b, lambda x, y: _num(x) / _num(y)),
    "power": (lambda a, b: a ** b, lambda x, y: _power(_num(x), _num(y))),
    "maximum": (lambda a, b: a.maximum(b), lambda x, y: np.maximum(_num(x), _num(y))),
    "minimum": (lambda a, b: a.minimum(b), lambda x, y: np.minimum(_num(x), _num(y))),
    "eq": (lambda a, b: a == b, np.equal),
    "ne": (lambda a, b: a != b, np.not_equal),
    "lt": (lambda a, b: a < b, np.less),
    "le": (lambda a, b: a <= b, np.less_equal),
    "gt": (lambda a, b: a > b, np.greater),
    "ge": (lambda a, b: a >= b, np.greater_equal),
}
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _result_dtype(op: str, dtype: str) -> str:
    if op in COMPARISONS:
        return "bool"
    if op == "div":
        return dtype if dtype in FLOATS else "float32"
    return "int32" if dtype == "bool" else dtype


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", list(BINARY))
def test_binary_array_array(device, dtype, op, rng):
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = BINARY[op]
    x, y = grid(rng, (3, 1, 5), dtype), grid(rng, (4, 5), dtype)  # broadcast both ways
    got = compare(device, fn, [x, y], expected=want)
    assert got.shape == (3, 4, 5) and got.dtype == _result_dtype(op, dtype)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool", "float16"])
@pytest.mark.parametrize("op", ["add", "mul", "maximum", "lt", "div", "eq"])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_binary_non_compact(device, dtype, op, kind, rng):
    fn, want = BINARY[op]
    base, view = layout((4, 6), kind)
    x, y = grid(rng, base, dtype), grid(rng, (6, 4), dtype)
    compare(device, fn, [x, y], views=[view, lambda t: t.transpose((1, 0))], expected=want)


SCALARS = (2, -3, 2.5, True, 0.1)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("scalar", SCALARS, ids=repr)
def test_binary_array_scalar(device, dtype, op, scalar, rng):
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = BINARY[op]
    x = grid(rng, (2, 9), dtype)
    if dtype == "uint8" and scalar == -3 and op != "div":  # must fit (docs/dtypes.md)
        with pytest.raises(DTypeError, match="does not fit uint8"):
            fn(on(device, x), scalar)
        return
    got = compare(device, lambda a: fn(a, scalar), [x],
                  expected=lambda w: want(w, np.asarray(scalar)))
    promoted = nd.dtypes.promote_scalar(dtype, scalar)
    assert got.dtype == _result_dtype(op, promoted)


REFLECTED = {
    "radd": (lambda s, a: s + a, lambda s, x: s + _num(x)),
    "rsub": (lambda s, a: s - a, lambda s, x: s - _num(x)),
    "rmul": (lambda s, a: s * a, lambda s, x: s * _num(x)),
    "rtruediv": (lambda s, a: s / a, lambda s, x: s / _num(x)),
    "rpow": (lambda s, a: s ** a, lambda s, x: _power(np.asarray(s), _num(x))),
    "rlt": (lambda s, a: s < a, lambda s, x: s < x),
    "req": (lambda s, a: s == a, lambda s, x: s == x),
}


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", list(REFLECTED))
@pytest.mark.parametrize("scalar", (2, 1.5, -0.5), ids=repr)
def test_binary_reflected(device, dtype, op, scalar, rng):
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = REFLECTED[op]
    x = grid(rng, (3, 4), dtype)
    compare(device, lambda a: fn(scalar, a), [x], expected=lambda w: want(scalar, w))


@pytest.mark.parametrize("a_dtype", ALL)
@pytest.mark.parametrize("b_dtype", ALL)
def test_binary_mixed_dtypes_promote(device, a_dtype, b_dtype, rng):
    if check_unsupported_dtype(device, a_dtype) or check_unsupported_dtype(device, b_dtype):
        return
    x, y = grid(rng, (2, 5), a_dtype), grid(rng, (2, 5), b_dtype)
    got = compare(device, lambda a, b: a + b, [x, y], expected=lambda u, v: _num(u) + _num(v))
    assert got.dtype == nd.dtypes.arithmetic(nd.promote(a_dtype, b_dtype))
    lt = compare(device, lambda a, b: a < b, [x, y], expected=np.less)
    assert lt.dtype == "bool"


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_edge_values(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    vals = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.0], dtype=np_dtype(dtype))
    x, y = np.meshgrid(vals, vals)  # every pair of special values
    for op in BINARY:
        fn, want = BINARY[op]
        compare(device, fn, [x, y], expected=want)


def test_int64_arithmetic_is_exact(device):
    """Big int64 values are not squeezed through a float on the way."""
    x = np.array([2**40 + 1, -(2**41) - 3, 2**53 + 1], dtype=np.int64)
    y = np.array([3, 7, 1], dtype=np.int64)
    for fn, want in (BINARY["add"], BINARY["mul"], BINARY["sub"], BINARY["maximum"]):
        compare(device, fn, [x, y], expected=want)


# --- unary ops ----------------------------------------------------------------------------

def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x) if x.size else x


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


UNARY = {
    "neg": (lambda a: -a, lambda x: -_num(x)),
    "abs": (lambda a: a.abs(), lambda x: np.abs(_num(x))),
    "relu": (lambda a: a.relu(), lambda x: np.maximum(_num(x), 0)),
    "exp": (lambda a: a.exp(), np.exp),
    "log": (lambda a: a.log(), np.log),
    "sqrt": (lambda a: a.sqrt(), np.sqrt),
    "rsqrt": (lambda a: a.rsqrt(), lambda x: 1 / np.sqrt(x)),
    "sin": (lambda a: a.sin(), np.sin),
    "cos": (lambda a: a.cos(), np.cos),
    "tanh": (lambda a: a.tanh(), np.tanh),
    "sigmoid": (lambda a: a.sigmoid(), _sigmoid),
    "silu": (lambda a: a.silu(), lambda x: x * _sigmoid(x)),
    "gelu": (lambda a: a.gelu(), lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
}
POSITIVE_DOMAIN = ("log", "sqrt", "rsqrt")
ARITHMETIC_UNARY = ("neg", "abs", "relu")


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary(device, dtype, op, rng):
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = UNARY[op]
    low, high = (0.05, 6) if op in POSITIVE_DOMAIN else (-5, 5)
    if dtype in INTS:
        low, high = (1, 9) if op in POSITIVE_DOMAIN else (-9, 9)
    x = random(rng, (5, 13), dtype, low, high)

    def expected(w):  # transcendental ops of ints and bools compute in floats (rule 5)
        return want(w if op in ARITHMETIC_UNARY else w.astype(np.float64))

    got = compare(device, fn, [x], expected=expected)
    if op in ARITHMETIC_UNARY:
        assert got.dtype == nd.dtypes.arithmetic(dtype)
    else:
        assert got.dtype == nd.dtypes.floating(dtype)


@pytest.mark.parametrize("op", list(UNARY))
@pytest.mark.parametrize("kind", LAYOUTS)
def test_unary_non_compact(device, op, kind, rng):
    fn, want = UNARY[op]
    base, view = layout((6, 5), kind)
    x = random(rng, base, "float32", *((0.05, 6) if op in POSITIVE_DOMAIN else (-5, 5)))
    compare(device, fn, [x], views=[view], expected=want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary_edge_values(device, dtype, op):
    """inf, nan, signed zeros and values whose exp over- or underflows."""
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = UNARY[op]
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-3, -1e-3, 30.0, -30.0, 100.0, -100.0,
            1e4, -1e4]
    if op in ("silu", "gelu"):  # x * sigmoid(x) at -inf is inf * 0: left undefined
        vals = [v for v in vals if not np.isinf(v)]
    x = np.array(vals, dtype=np_dtype(dtype))
    compare(device, fn, [x], expected=want)


# --- cast ---------------------------------------------------------------------------------

@pytest.mark.parametrize("src", ALL)
@pytest.mark.parametrize("dst", ALL)
def test_cast_all_pairs(device, src, dst, rng):
    if check_unsupported_dtype(device, src) or check_unsupported_dtype(device, dst):
        return
    if src == "bool":
        x = rng.random((4, 9)) < 0.5
    elif src in INTS:  # to a narrower integer wraps (as numpy and C)
        x = rng.integers(-1000, 1000, (4, 9)).astype(np_dtype(src))
    elif dst in ("uint8", "int8"):  # in range: test_float_to_int_saturates has the rest
        lo, hi = (0, 255 * 8) if dst == "uint8" else (-127 * 8, 127 * 8)
        x = (rng.integers(lo, hi, (4, 9)) / 8).astype(np_dtype(src))
    else:  # fractions and negatives: float to int truncates toward zero
        x = (rng.integers(-4000, 4000, (4, 9)) / 8).astype(np_dtype(src))
    x[0, :3] = 0
    got = compare(device, lambda a: a.astype(dst), [x],
                  expected=lambda w: w.astype(np_dtype(dst)))
    assert got.dtype == dst
    assert_equal(got.numpy(), x.astype(np_dtype(dst)))


@pytest.mark.parametrize("dst", ["float16", "bfloat16", "float32"])
def test_cast_rounds_to_nearest_even_and_overflows_to_inf(device, dst, rng):
    """Narrowing floats round to nearest (ties to even), keep nan and overflow to inf."""
    x = np.concatenate([
        rng.standard_normal(200) * 10.0 ** rng.integers(-6, 6, 200),
        [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 1e5, -1e5, 1e39, np.nan,
         np.inf, -np.inf, 6e-8, 1e-40],
    ])
    for src in ("float32", "float64"):
        if check_unsupported_dtype(device, src):
            continue
        with np.errstate(over="ignore"):
            xs = x.astype(np_dtype(src))
            want = xs.astype(np_dtype(dst))
        assert_equal(on(device, xs).astype(dst).numpy(), want)


@pytest.mark.parametrize("dst", ["int32", "int64", "bool"])
def test_cast_float_to_int_truncates_toward_zero(device, dst):
    x = np.array([2.7, -2.7, 0.5, -0.5, -0.0, 1e6 + 0.5, -1e6 - 0.5], np.float32)
    compare(device, lambda a: a.astype(dst), [x], expected=lambda w: w.astype(np_dtype(dst)))


# --- where --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL)
def test_where(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    c = rng.random((3, 1, 6)) < 0.5
    x, y = random(rng, (4, 6), dtype, -9, 9), random(rng, (3, 4, 1), dtype, -9, 9)
    got = compare(device, nd.where, [c, x, y], expected=np.where)
    assert got.dtype == dtype and got.shape == (3, 4, 6)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_where_non_compact_and_scalars(device, kind, rng):
    base, view = layout((5, 4), kind)
    c = rng.random(base) < 0.5
    x = random(rng, base, "float32")
    compare(device, nd.where, [c, x, x[::-1].copy()], views=[view, view, view],
            expected=np.where)
    compare(device, lambda cc, a: nd.where(cc, a, -1.5), [c, x], views=[view, view],
            expected=lambda cc, a: np.where(cc, a, -1.5))
    compare(device, lambda cc, a: nd.where(cc, 2.0, a), [c, x], views=[view, view],
            expected=lambda cc, a: np.where(cc, 2.0, a))


def test_where_mixed_dtypes_promote(device, rng):
    c = rng.random(8) < 0.5
    x = random(rng, 8, "int32", -9, 9)
    y = random(rng, 8, "float16")
    got = compare(device, nd.where, [c, x, y], expected=np.where)
    assert got.dtype == "float16"
    cond_from_float = compare(device, nd.where, [y, x, x[::-1].copy()],
                              expected=lambda cc, a, b: np.where(cc != 0, a, b))
    assert cond_from_float.dtype == "int32"


# --- sizes --------------------------------------------------------------------------------

SIZE_OPS = {
    "add": (lambda a: a + a[::-1], lambda x: x + x[::-1]),
    "mul_scalar": (lambda a: a * 3.0, lambda x: x * 3.0),
    "exp": (lambda a: a.exp(), np.exp),
    "cast_f16": (lambda a: a.astype("float16").astype("float32"),
                 lambda x: x.astype(np.float16).astype(np.float64)),
    "where": (lambda a: nd.where(a > 0, a, 0.0), lambda x: np.where(x > 0, x, 0.0)),
    "compact_reversed": (lambda a: a[::-1].compact(), lambda x: x[::-1]),
}


@pytest.mark.parametrize("op", list(SIZE_OPS))
@pytest.mark.parametrize("size", SIZES + (1024, 4099))
def test_sizes(device, op, size, rng):
    fn, want = SIZE_OPS[op]
    compare(device, fn, [random(rng, (size,), "float32")], expected=want)


@pytest.mark.parametrize("op", ["add", "exp", "cast_f16"])
def test_big_size(device, op, rng):
    """1000003 elements: more than any tile, thread block or simd group, and odd."""
    fn, want = SIZE_OPS[op]
    compare(device, fn, [random(rng, (BIG,), "float32")], expected=want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32"])
def test_odd_sizes_narrow_dtypes(device, dtype, rng):
    """2-byte and 4-byte types at odd sizes, where vectorized loads need a tail."""
    for size in (1, 7, 33, 1001):
        x = random(rng, (size,), dtype, -9, 9)
        compare(device, lambda a: a + a[::-1], [x], expected=lambda w: w + w[::-1])
        compare(device, lambda a: a.maximum(a * 2), [x],
                expected=lambda w: np.maximum(w, w * 2))


def test_results_are_fresh_arrays(device, rng):
    """An op never writes into its inputs, and results do not alias each other."""
    x = random(rng, (4, 4), "float32")
    a = on(device, x)
    b = a + 1.0
    c = a.exp()
    b[0, 0] = 100.0
    assert_equal(a.numpy(), x)
    assert_close(c, np.exp(x.astype(np.float64)), "float32")
