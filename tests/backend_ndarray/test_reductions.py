"""Reductions: sum, max, min, argmax and mean over any axis, tuples of axes, keepdims and
negative axes, on compact and strided inputs, at odd and large sizes and with inf and nan."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd

from ..conftest import check_unsupported_dtype
from .compare import FLOATS, LAYOUTS, compare, grid, layout, random

ALL = nd.ALL_DTYPES


def _num(x):
    """bools and 8-bit integers sum in int64 (docs/dtypes.md)."""
    return x.astype(np.int64) if x.dtype.itemsize == 1 else x


def _argmax(x, axis, keepdims):
    """numpy's argmax, NaN counting as the maximum (numpy already does so)."""
    if axis is None:
        out = np.argmax(x)
        return np.reshape(out, (1,) * x.ndim) if keepdims else out
    return np.argmax(x, axis=axis, keepdims=keepdims)


# name: (needle call, numpy in exact arithmetic, exact result?)
REDUCTIONS = {
    "sum": (lambda a, ax, k: a.sum(ax, k), lambda x, ax, k: np.sum(_num(x), ax, keepdims=k), False),
    "max": (lambda a, ax, k: a.max(ax, k), lambda x, ax, k: np.max(x, ax, keepdims=k), True),
    "min": (lambda a, ax, k: a.min(ax, k), lambda x, ax, k: np.min(x, ax, keepdims=k), True),
    "mean": (lambda a, ax, k: a.mean(ax, k),
             lambda x, ax, k: np.mean(_num(x).astype(np.float64), ax, keepdims=k), False),
    "argmax": (lambda a, ax, k: a.argmax(ax, k), _argmax, True),
}
AXES = [None, 0, 1, 2, -1, -3, (0, 2), (2, 0), (1, 2), (0, 1, 2), (-1, 0), ()]


def _result_dtype(op: str, dtype: str) -> str:
    if op == "argmax":
        return "int64"
    if op == "mean":
        return nd.dtypes.floating(dtype)
    return nd.dtypes.sum_dtype(dtype) if op == "sum" else dtype


def _reduced(shape, axis) -> int:
    if axis is None:
        return math.prod(shape)
    axes = (axis,) if isinstance(axis, int) else axis
    return math.prod(shape[a] for a in axes)


def _check(device, op, x, axis, keepdims, view=None):
    fn, want, exact = REDUCTIONS[op]
    shape = (view(x) if view else x).shape
    n = max(_reduced(shape, axis), 1)
    got = compare(device, lambda a: fn(a, axis, keepdims), [x], views=[view] if view else None,
                  expected=lambda w: want(w, axis, keepdims), kind="reduction",
                  scale=None if op != "sum" else 2.0 * n, rtol=0.0 if exact else None)
    return got


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", list(REDUCTIONS))
@pytest.mark.parametrize("axis", AXES, ids=repr)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduce(device, dtype, op, axis, keepdims, rng):
    if check_unsupported_dtype(device, dtype):
        return
    if op == "argmax" and isinstance(axis, tuple):
        return  # argmax takes one axis (tuples are a bad-input test)
    x = grid(rng, (3, 4, 5), dtype)  # many ties: argmax must pick the first
    got = _check(device, op, x, axis, keepdims)
    assert got.dtype == _result_dtype(op, dtype)


@pytest.mark.parametrize("op", list(REDUCTIONS))
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_reduce_non_compact(device, op, kind, axis, rng):
    base, view = layout((5, 6), kind)
    _check(device, op, random(rng, base, "float32"), axis, False, view)


@pytest.mark.parametrize("op", list(REDUCTIONS))
@pytest.mark.parametrize("shape", [(1,), (7,), (33,), (1, 1), (7, 33), (33, 7), (2, 1, 1025)])
def test_reduce_odd_sizes(device, op, shape, rng):
    x = random(rng, shape, "float32")
    for axis in {None, 0, len(shape) - 1}:
        _check(device, op, x, axis, False)


@pytest.mark.parametrize("op", ["sum", "max", "argmax"])
def test_reduce_big(device, op, rng):
    """1000003 elements, positive so that a sum's relative error is meaningful."""
    x = random(rng, (1_000_003,), "float32", 0.0, 1.0)
    _check(device, op, x, None, False)


@pytest.mark.parametrize("op", list(REDUCTIONS))
@pytest.mark.parametrize("shape, axis", [((2, 70001), 0), ((3, 5, 30000), 1),
                                         ((16, 65536), 0), ((65, 70000), 0)], ids=str)
def test_short_wide_columns(device, op, shape, axis, rng):
    """A few rows of many columns (split-K slabs, a node's gradients summed): the GPUs take
    a thread per output below 65 rows and 65,536 outputs (gpu/reduce.py)."""
    x = random(rng, shape, "float32", -1.0, 1.0)
    x.reshape(-1)[::9973] = x.max() + 1  # ties and clear maxima for the arg- ops
    _check(device, op, x, axis, False)


@pytest.mark.parametrize("axis", [0, 1])
def test_sum_big_2d(device, axis, rng):
    x = random(rng, (1001, 999), "float32", 0.0, 1.0)
    _check(device, "sum", x, axis, False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_sums_accumulate_in_float32(device, dtype, rng):
    """4099 values near 1 sum to about 4099, where a half-precision running sum would have
    stopped growing by small steps long before."""
    x = random(rng, (4099,), dtype, 0.5, 1.5)
    got = compare(device, lambda a: a.sum(), [x], expected=lambda w: w.sum(), kind="reduction")
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_edge_values(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    rows = np.array([
        [1.0, np.nan, 3.0, -1.0],  # NaN wins max, min and argmax, poisons sum and mean
        [np.inf, 1.0, -np.inf, 2.0],
        [-np.inf, -np.inf, -np.inf, -np.inf],
        [np.nan, 2.0, np.nan, np.inf],
        [-0.0, 0.0, -0.0, 0.0],
        [3.0, 3.0, 1.0, 3.0],
    ], dtype=nd.dtypes.to_numpy_dtype(dtype))
    for op in REDUCTIONS:
        for axis in (1, 0):
            _check(device, op, rows, axis, False)


def test_reduce_empty_and_zero_dim(device):
    x = np.zeros((0, 3), np.float32)
    _check(device, "sum", x, 0, False)
    _check(device, "sum", x, 1, True)
    _check(device, "sum", x, None, False)
    _check(device, "max", x, 1, False)  # reducing a size-3 axis of an empty array is fine
    s = np.array(2.5, np.float32)
    for op in REDUCTIONS:
        _check(device, op, s, None, False)


def test_module_level_sum_and_max(device, rng):
    x = random(rng, (3, 4), "float32")
    compare(device, lambda a: nd.sum(a, axis=1), [x], expected=lambda w: w.sum(1),
            kind="reduction")
    compare(device, lambda a: nd.max(a, axis=0, keepdims=True), [x],
            expected=lambda w: w.max(0, keepdims=True))
