"""Elementwise functions: binary and scalar maps, unary maps, casts, where."""

from __future__ import annotations

import math

import numpy as np

from .core import _HALF, Array, _f, _store

# --- elementwise ------------------------------------------------------------------------

def _binary(fn):
    # IEEE results (inf - inf is nan, 1 / 0 is inf) are the contract, not warnings
    def ewise(a: Array, b: Array, out: Array) -> None:
        with np.errstate(all="ignore"):
            _store(out, fn(_f(a.array), _f(b.array)))

    def scalar(a: Array, value, out: Array) -> None:
        x = _f(a.array)
        with np.errstate(all="ignore"):
            _store(out, fn(x, np.asarray(value, dtype=x.dtype)))

    return ewise, scalar


def _div(x, y):
    if x.dtype.kind in "iu":  # integer division truncates toward zero, as in C
        with np.errstate(divide="ignore", over="ignore"):
            q = np.where(y == 0, 0, x // np.where(y == 0, 1, y))
            r = x - q * y
        # floor division rounded a negative inexact quotient down: step back toward zero
        return q + ((r != 0) & (y != 0) & ((x < 0) != (y < 0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        return x / y


def _power(x, y):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if x.dtype.kind in "iu":
            return np.power(x, np.maximum(y, 0))
        return np.power(x, y)


ewise_add, scalar_add = _binary(np.add)
ewise_sub, scalar_sub = _binary(np.subtract)
ewise_mul, scalar_mul = _binary(np.multiply)
ewise_div, scalar_div = _binary(_div)
ewise_power, scalar_power = _binary(_power)
ewise_maximum, scalar_maximum = _binary(np.maximum)
ewise_minimum, scalar_minimum = _binary(np.minimum)
ewise_eq, scalar_eq = _binary(np.equal)
ewise_ne, scalar_ne = _binary(np.not_equal)
ewise_lt, scalar_lt = _binary(np.less)
ewise_le, scalar_le = _binary(np.less_equal)
ewise_gt, scalar_gt = _binary(np.greater)
ewise_ge, scalar_ge = _binary(np.greater_equal)


def _unary(fn):
    def ewise(a: Array, out: Array) -> None:
        with np.errstate(all="ignore"):
            _store(out, fn(_f(a.array)))

    return ewise


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1)


def _gelu(x):  # exact (erf) form, as torch.nn.GELU()
    erf = np.vectorize(math.erf, otypes=[x.dtype]) if x.size else (lambda v: v)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


ewise_neg = _unary(np.negative)
ewise_abs = _unary(np.abs)
ewise_exp = _unary(np.exp)
ewise_log = _unary(np.log)
ewise_sqrt = _unary(np.sqrt)
ewise_rsqrt = _unary(lambda x: 1 / np.sqrt(x))
ewise_sin = _unary(np.sin)
ewise_cos = _unary(np.cos)
ewise_tanh = _unary(np.tanh)
ewise_sigmoid = _unary(_sigmoid)
ewise_relu = _unary(lambda x: np.maximum(x, 0))
ewise_silu = _unary(lambda x: x * _sigmoid(x))
ewise_gelu = _unary(_gelu)


def ewise_cast(a: Array, out: Array) -> None:
    """Convert ``a`` to ``out.dtype``. Floats to ints truncate toward zero and saturate at
    the integer's range, NaN giving 0 (docs/dtypes.md: the rule of every backend); to bool,
    nonzero (NaN included) is true; float overflow gives inf."""
    if a.array.dtype.kind == "f" or a.array.dtype == _HALF[1]:
        if out.array.dtype.kind in "iu":
            out.array[:] = _saturating_int(a.array.astype(np.float64), out.array.dtype)
            return
    with np.errstate(invalid="ignore", over="ignore"):  # overflow to inf is the contract
        out.array[:] = a.array.astype(out.array.dtype)


def _saturating_int(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    hi, lo = float(int(info.max) + 1), float(info.min)  # powers of two or 0: exact
    out = np.zeros(x.shape, dtype)
    inside = (x >= lo) & (x < hi)  # NaN is neither: stays 0
    out[inside] = np.trunc(x[inside]).astype(dtype)
    out[x >= hi] = info.max
    out[x < lo] = info.min  # (lo - 1, lo) truncates to lo as well
    return out


def where(cond: Array, a: Array, b: Array, out: Array) -> None:
    out.array[:] = np.where(cond.array, a.array, b.array)
