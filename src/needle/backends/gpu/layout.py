"""Memory and layout: host copies, fill, compact/setitem of strided views, take and
scatter_add (kernel files ``elementwise`` for fill, ``layout`` for the rest)."""

from __future__ import annotations

import math
import struct

import numpy as np

from ...backend_ndarray.dtypes import ITEMSIZE, to_numpy_dtype
from ...errors import DTypeError
from ...hal import Buffer
from .array import (
    MAX_DIMS,
    S_PARAMS,
    STRIDED,
    STRIDED_S,
    SUFFIX,
    TAKE,
    GpuArray,
    cdiv,
    magic,
    scalar,
    simplify,
)
from .base import GpuBase


class LayoutOps(GpuBase):
    # --- host copies -----------------------------------------------------------------------
    def from_numpy(self, a: np.ndarray, out: GpuArray) -> None:
        src = np.ascontiguousarray(a, dtype=to_numpy_dtype(out.dtype)).reshape(-1)
        self.queue.copy_from_host(out.buffer, 0, src)

    def _contiguous(self, a: GpuArray, shape, strides, offset, size: int):
        """(array, byte offset) where ``a``'s strided elements lie contiguously: ``a`` itself,
        or a compact copy of them made on the device."""
        if _is_contiguous(shape, strides):
            return a, offset * ITEMSIZE[a.dtype]
        tmp = self._new_array(size, a.dtype)
        self.compact(a, tmp, shape, strides, offset)
        return tmp, 0

    def to_numpy(self, a: GpuArray, shape, strides, offset) -> np.ndarray:
        result = np.empty(tuple(shape), dtype=to_numpy_dtype(a.dtype))
        if result.size:
            src, start = self._contiguous(a, shape, strides, offset, result.size)
            self.queue.copy_to_host(src.buffer, start, result.reshape(-1))
        return result

    def to_numpy_later(self, a: GpuArray, shape, strides, offset):
        """Start ``to_numpy``; returns a function that waits for the copy and returns it."""
        dtype = to_numpy_dtype(a.dtype)
        size = math.prod(shape)  # not np.prod: a few us, once a generated token
        if not size:
            return lambda: np.empty(tuple(shape), dtype)
        src, start = self._contiguous(a, shape, strides, offset, size)
        read = self.queue.copy_to_host_later(src.buffer, start, size * ITEMSIZE[a.dtype])
        return lambda: read().view(dtype).reshape(tuple(shape))

    def fill(self, out: GpuArray, value) -> None:
        self._fill(out.buffer, out.size, out.dtype, value)

    def _fill(self, buffer: Buffer, n: int, dtype: str, value) -> None:
        if n:
            self._launch_1d(f"fill_{SUFFIX[dtype]}", cdiv(n, 16 // ITEMSIZE[dtype]),
                            (buffer,), S_PARAMS[dtype].pack(n, scalar(dtype, value)),
                            "elementwise")

    def synchronize(self) -> None:
        self.queue.synchronize()

    # --- strided views ---------------------------------------------------------------------
    def _strided(self, name: str, buffers, shape, strides, offset, n: int, extra=None) -> None:
        nd = len(shape)
        dims = list(shape) + [1] * (MAX_DIMS - nd)
        steps = list(strides) + [0] * (MAX_DIMS - nd)
        magics = [magic(d) for d in dims]
        values = [n, offset, nd, *dims, *steps, *[m for m, _ in magics], *[s for _, s in magics]]
        if extra is None:
            params = struct.pack(STRIDED, *values)
        else:
            dtype, value = extra
            params = STRIDED_S[dtype].pack(*values, scalar(dtype, value))
        self._launch_1d(name, n, buffers, params, "layout")

    def _views(self, shape, strides, offset, dense: GpuArray):
        """Split a view of more than MAX_DIMS dimensions along its leading axes: yields
        (shape, strides, offset, dense_buffer_view) pieces of at most MAX_DIMS dims."""
        if len(shape) <= MAX_DIMS:
            yield shape, strides, offset, dense.buffer
            return
        inner = math.prod(shape[1:])
        item = ITEMSIZE[dense.dtype]
        for i in range(shape[0]):
            sub = GpuArray(dense.buffer.view(i * inner * item, inner * item), inner, dense.dtype)
            yield from self._views(shape[1:], strides[1:], offset + i * strides[0], sub)

    def _compact_special(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> bool:
        """A device's faster kernel for some simplified layouts; True when it ran one."""
        return False

    def compact(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = simplify(shape, strides)
        item = ITEMSIZE[a.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self.queue.copy(a.buffer, offset * item, out.buffer, 0, n * item)
            return
        if self._compact_special(a, out, shape, strides, offset):
            return
        name = f"compact_{SUFFIX[a.dtype]}"
        for sh, st, off, dense in self._views(shape, strides, offset, out):
            self._strided(name, (a.buffer, dense), sh, st, off, math.prod(sh))

    def ewise_setitem(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = simplify(shape, strides)
        item = ITEMSIZE[out.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self.queue.copy(a.buffer, 0, out.buffer, offset * item, n * item)
            return
        name = f"setitem_{SUFFIX[out.dtype]}"
        for sh, st, off, dense in self._views(shape, strides, offset, a):
            self._strided(name, (dense, out.buffer), sh, st, off, math.prod(sh))

    def scalar_setitem(self, size: int, value, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = simplify(shape, strides)
        item = ITEMSIZE[out.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self._fill(out.buffer.view(offset * item, n * item), n, out.dtype, value)
            return
        name = f"scalar_setitem_{SUFFIX[out.dtype]}"
        if len(shape) > MAX_DIMS:  # split on the leading axis; no dense side to offset
            for i in range(shape[0]):
                self.scalar_setitem(0, value, out, shape[1:], strides[1:],
                                    offset + i * strides[0])
            return
        self._strided(name, (out.buffer,), shape, strides, offset, n, (out.dtype, value))

    # --- indexing --------------------------------------------------------------------------
    def take(self, table: GpuArray, indices: GpuArray, out: GpuArray, rows: int,
             dim: int) -> None:
        """out[i, :] = table[indices[i], :]; rows of out-of-range indices are zeros."""
        if out.size == 0:
            return
        name = f"take_{SUFFIX[table.dtype]}_{SUFFIX[indices.dtype]}"
        self._rows_launch("layout", name, indices.size, dim, 16 // ITEMSIZE[table.dtype],
                          (table.buffer, indices.buffer, out.buffer),
                          TAKE.pack(indices.size, rows, dim))

    def _scatter_add_special(self, indices: GpuArray, values: GpuArray, out: GpuArray,
                             rows: int, dim: int) -> bool:
        """A device's kernel for some scatter_adds; True when it ran one."""
        return False

    def scatter_add(self, indices: GpuArray, values: GpuArray, out: GpuArray, rows: int,
                    dim: int) -> None:
        """out[indices[i], :] += values[i, :]; out-of-range indices are skipped."""
        if indices.size == 0 or dim == 0:
            return
        dt = out.dtype
        if dt == "bool":
            raise DTypeError("scatter_add is not defined for bool arrays")
        if self._scatter_add_special(indices, values, out, rows, dim):
            return
        if dt in ("float16", "bfloat16"):  # add in float32, round once at the end
            acc = self._new_array(out.size, "float32")
            vals = self._new_array(values.size, "float32")
            self.ewise_cast(out, acc)
            self.ewise_cast(values, vals)
            self.scatter_add(indices, vals, acc, rows, dim)
            self.ewise_cast(acc, out)
            return
        name = f"scatter_add_{SUFFIX[dt]}_{SUFFIX[indices.dtype]}"
        self._rows_launch("layout", name, indices.size, dim, 1,
                          (indices.buffer, values.buffer, out.buffer),
                          TAKE.pack(indices.size, rows, dim))


def _is_contiguous(shape, strides) -> bool:
    s = simplify(shape, strides)
    return len(s[0]) == 1 and s[1][0] == 1
