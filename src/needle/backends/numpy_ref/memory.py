"""Memory, layout and indexing: copies, fill, strided views, take and scatter_add."""

from __future__ import annotations

import numpy as np

from .core import Array, _f, _store, _view

# --- memory -----------------------------------------------------------------------------

def from_numpy(a: np.ndarray, out: Array) -> None:
    out.array[:] = np.ascontiguousarray(a).reshape(-1).astype(out.array.dtype, copy=False)


def wrap(flat: np.ndarray, dtype: str) -> Array:
    """An Array sharing the memory of the 1-d numpy array ``flat`` (DLPack import)."""
    arr = Array.__new__(Array)
    arr.array, arr.dtype = flat, dtype
    return arr


def host_view(a: Array) -> np.ndarray:
    """A 1-d numpy array aliasing the buffer (DLPack export, zero-copy)."""
    return a.array


def to_numpy(a: Array, shape, strides, offset) -> np.ndarray:
    return _view(a, shape, strides, offset).copy()


def fill(out: Array, value) -> None:
    out.array.fill(value)


def synchronize() -> None:
    """Wait for queued work; numpy runs eagerly, so there is none."""


# --- layout -----------------------------------------------------------------------------

def compact(a: Array, out: Array, shape, strides, offset) -> None:
    """Copy the strided view (shape, strides, offset) of ``a`` into compact ``out``."""
    out.array[:] = _view(a, shape, strides, offset).reshape(-1)


def ewise_setitem(a: Array, out: Array, shape, strides, offset) -> None:
    """Write compact ``a`` into the strided view (shape, strides, offset) of ``out``."""
    view = _view(out, shape, strides, offset)
    view[...] = a.array.reshape(shape)


def scalar_setitem(size: int, value, out: Array, shape, strides, offset) -> None:
    """Write ``value`` into every element of the strided view of ``out``."""
    view = _view(out, shape, strides, offset)
    view[...] = value


# --- indexing ---------------------------------------------------------------------------

def take(table: Array, indices: Array, out: Array, rows: int, dim: int) -> None:
    """out[i, :] = table[indices[i], :]; table is (rows, dim), indices int32/int64."""
    out.array[:] = table.array.reshape(rows, dim)[indices.array].reshape(-1)


def scatter_add(indices: Array, values: Array, out: Array, rows: int, dim: int) -> None:
    """out[indices[i], :] += values[i, :] (the gradient of ``take``); out is (rows, dim)."""
    acc = _f(out.array).reshape(rows, dim).copy()
    np.add.at(acc, indices.array, _f(values.array).reshape(-1, dim))
    _store(out, acc.reshape(-1))
