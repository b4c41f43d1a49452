"""Reductions and matrix products."""

from __future__ import annotations

import numpy as np

from .core import Array, _f, _store

# --- reductions -------------------------------------------------------------------------
# ``a`` is compact with logical shape (outer, reduce_size, inner); ``out`` is (outer, inner).
# inner == 1 is the common "last axis" case; inner > 1 reduces a middle axis in place.

def _r(a: Array, outer: int, reduce_size: int, inner: int) -> np.ndarray:
    return _f(a.array).reshape(outer, reduce_size, inner)


def reduce_sum(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    x = _r(a, outer, reduce_size, inner)
    acc = x.dtype if x.dtype.kind in "iub" or x.dtype == np.float64 else np.float32
    if x.dtype.itemsize == 1:  # bool and 8-bit integers count in int64 rather than wrap
        acc = np.int64
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is nan, by contract
        _store(out, x.sum(axis=1, dtype=acc))


def reduce_max(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    _store(out, _r(a, outer, reduce_size, inner).max(axis=1))


def reduce_min(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    _store(out, _r(a, outer, reduce_size, inner).min(axis=1))


def reduce_argmax(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    """Index of the first maximum (NaN counts as the maximum); ``out`` is int64."""
    x = _r(a, outer, reduce_size, inner)
    out.array[:] = np.argmax(x, axis=1).reshape(-1)


# --- matmul -----------------------------------------------------------------------------

def matmul(a: Array, b: Array, out: Array, m: int, n: int, p: int, *, batch: int = 1,
           stride_a: int | None = None, stride_b: int | None = None,
           transpose_a: bool = False, transpose_b: bool = False) -> None:
    """out[i] = A[i] @ B[i] for i < batch; out is compact (batch, m, p).

    A[i] starts at element ``i * stride_a`` of ``a`` and is stored (m, n) row-major, or
    (n, m) when ``transpose_a``; likewise B[i] is (n, p), or (p, n) when ``transpose_b``.
    A stride of 0 broadcasts one matrix over the batch. Default strides are compact.
    """
    stride_a = m * n if stride_a is None else stride_a
    stride_b = n * p if stride_b is None else stride_b
    ra, ca = (n, m) if transpose_a else (m, n)
    rb, cb = (p, n) if transpose_b else (n, p)
    fa, fb = _f(a.array), _f(b.array)
    x = np.lib.stride_tricks.as_strided(fa, (batch, ra, ca), _strides(fa, stride_a, ca))
    y = np.lib.stride_tricks.as_strided(fb, (batch, rb, cb), _strides(fb, stride_b, cb))
    if transpose_a:
        x = x.transpose(0, 2, 1)
    if transpose_b:
        y = y.transpose(0, 2, 1)
    with np.errstate(over="ignore"):  # integer products wrap, by contract (docs/dtypes.md)
        _store(out, np.matmul(x, y).reshape(-1))


def _strides(x: np.ndarray, batch_stride: int, cols: int) -> tuple[int, int, int]:
    return batch_stride * x.itemsize, cols * x.itemsize, x.itemsize
