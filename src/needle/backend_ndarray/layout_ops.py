"""NDArray's layout and indexing methods: compactness, views (as_strided, reshape, permute,
transpose, swapaxes, broadcast_to, flip), pad, the course's ``flat`` and ``process_slice``,
and basic indexing (``__getitem__``, ``__setitem__``). A mixin of NDArray, split from
ndarray.py for its length; views share the array's buffer and copy nothing."""

from __future__ import annotations

import builtins
import numbers
import operator
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AxisError, IndexOutOfRangeError, ShapeError
from . import course
from .shapes import _check_shape, _compact_strides, _normalize_axes, _prod

if TYPE_CHECKING:
    from .ndarray import NDArray
else:
    # ndarray.py imports this module before it defines NDArray, then binds it here: a module
    # global, looked up as cheaply as in ndarray.py itself (views are made on every op)
    NDArray = None


class LayoutOps:
    """Methods NDArray mixes in; they use its ``_handle``, ``_be``, ``copy``, ``astype``,
    ``_empty_like`` and ``_check_device``."""

    __slots__ = ()

    # --- layout --------------------------------------------------------------------------
    def is_compact(self) -> bool:
        return self._is_plain()

    def _is_plain(self) -> bool:
        """Compact and starting at the buffer's first element (cheap form of is_compact)."""
        return self._offset == 0 and self._handle.size == _prod(self._shape) and (
            self._strides == _compact_strides(self._shape))

    def compact(self) -> NDArray:
        return self if self.is_compact() else self.copy()

    def as_strided(self, shape, strides) -> NDArray:
        """A view of this array's buffer; it must stay inside the buffer (no wild reads)."""
        shape = _check_shape(shape)
        try:
            strides = tuple(operator.index(s) for s in strides)
        except TypeError:
            raise ShapeError(f"strides must be a tuple of ints, got {strides!r}") from None
        if len(strides) != len(shape):
            raise ShapeError(f"as_strided: {len(strides)} strides for {len(shape)} dimensions")
        if _prod(shape):
            reach = [(d - 1) * s for d, s in zip(shape, strides)]
            lo = self._offset + builtins.sum(r for r in reach if r < 0)
            hi = self._offset + builtins.sum(r for r in reach if r > 0)
            if lo < 0 or hi >= self._handle.size:
                raise IndexOutOfRangeError(
                    f"as_strided: shape {shape} with strides {strides} reads elements {lo}..{hi}"
                    f" of a buffer of {self._handle.size}")
        return self._view(shape, strides)

    def _view(self, shape: tuple[int, ...], strides: tuple[int, ...],
              offset: int | None = None) -> NDArray:
        """A view of this buffer, unchecked: for shapes and strides derived from this array's
        own (permute, broadcast, reshape, indexing), which are valid by construction. Views
        are made on every op of a training step, so their cost is per-op host time."""
        arr = NDArray.__new__(NDArray)
        arr._shape, arr._strides = shape, strides
        arr._offset = self._offset if offset is None else offset
        arr._device, arr._handle = self._device, self._handle
        return arr

    def reshape(self, new_shape) -> NDArray:
        """A view with ``new_shape`` when the strides allow one, else a compact copy."""
        if isinstance(new_shape, numbers.Integral):
            new_shape = (new_shape,)
        try:
            new_shape = [operator.index(d) for d in new_shape]
        except TypeError:
            raise ShapeError(f"reshape needs a shape (an int or a tuple of ints), got "
                             f"{new_shape!r}") from None
        if new_shape.count(-1) > 1:
            raise ShapeError(f"only one dimension can be -1 in reshape, got {tuple(new_shape)}")
        if -1 in new_shape:
            known = _prod(d for d in new_shape if d != -1)
            if known == 0 or self.size % known:
                raise ShapeError(f"cannot reshape array of size {self.size} into "
                                 f"{tuple(new_shape)}")
            new_shape[new_shape.index(-1)] = self.size // known
        new_shape = _check_shape(new_shape)
        if _prod(new_shape) != self.size:
            raise ShapeError(f"cannot reshape array of shape {self.shape} (size {self.size}) "
                             f"into shape {new_shape} (size {_prod(new_shape)})")
        if self._strides == _compact_strides(self._shape):  # contiguous: no numpy probe
            return self._view(new_shape, _compact_strides(new_shape))
        strides = self._view_strides(new_shape)
        if strides is None:
            return self.compact().reshape(new_shape)
        return self._view(new_shape, strides)

    def _view_strides(self, new_shape) -> tuple[int, ...] | None:
        """Strides that read this array's elements in order under ``new_shape``, or None.

        numpy already knows when a reshape can be a view; ask it on a probe array with
        itemsize 1 whose byte strides are our element strides (no data is ever read).
        """
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), self._shape, self._strides)
        try:
            return np.reshape(probe, new_shape, copy=False).strides
        except ValueError:
            return None

    def permute(self, new_axes) -> NDArray:
        axes = _normalize_axes(new_axes, self.ndim)
        if len(axes) != self.ndim:
            raise AxisError(f"permute needs all {self.ndim} axes, got {new_axes!r}")
        return self._view(tuple(self._shape[a] for a in axes),
                          tuple(self._strides[a] for a in axes))

    def transpose(self, axes=None) -> NDArray:
        if axes is None:
            return self.permute(tuple(reversed(range(self.ndim))))
        return self.permute(axes)

    def swapaxes(self, a: int, b: int) -> NDArray:
        a, b = _normalize_axes((a, b), self.ndim) if a != b else (_normalize_axes(a, self.ndim) * 2)
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.permute(axes)

    @property
    def T(self) -> NDArray:  # noqa: N802
        return self.transpose()

    # the needle course's names (backend_ndarray/course.py)
    @property
    def flat(self) -> course.FlatView:
        """Row-major element access, as numpy's ``flat``: ``a.flat[i] += eps`` updates a."""
        return course.FlatView(self)

    def process_slice(self, sl: slice, dim: int) -> slice:
        """``sl`` with explicit start, stop and step for axis ``dim``."""
        return course.process_slice(self.shape, sl, dim)

    def broadcast_to(self, new_shape) -> NDArray:
        new_shape = _check_shape(new_shape)
        if len(new_shape) < self.ndim:
            raise ShapeError(f"cannot broadcast shape {self.shape} to fewer dimensions {new_shape}")
        lead = len(new_shape) - self.ndim
        strides = [0] * lead
        for i, (d, s) in enumerate(zip(self._shape, self._strides)):
            if d == new_shape[lead + i]:
                strides.append(s)
            elif d == 1:
                strides.append(0)
            else:
                raise ShapeError(f"cannot broadcast shape {self.shape} to {new_shape}")
        return self._view(new_shape, tuple(strides))

    def flip(self, axes=None) -> NDArray:
        axes = _normalize_axes(axes, self.ndim)
        offset, strides = self._offset, list(self._strides)
        for ax in axes:
            if self._shape[ax] > 0:
                offset += (self._shape[ax] - 1) * strides[ax]
            strides[ax] = -strides[ax]
        return self._view(self._shape, tuple(strides), offset)

    def pad(self, axes) -> NDArray:
        """Zero-pad: ``axes`` gives (before, after) for each dimension."""
        try:
            axes = tuple(tuple(operator.index(x) for x in p) for p in axes)
        except TypeError:
            axes = None
        if axes is None or len(axes) != self.ndim or any(len(p) != 2 or min(p) < 0
                                                          for p in axes):
            raise ShapeError(f"pad needs a (before, after) pair of non-negative ints for each of "
                             f"the {self.ndim} dimensions, e.g. {((0, 0),) * self.ndim}")
        out = self._empty_like(tuple(d + a + b for d, (a, b) in zip(self._shape, axes)))
        out.fill(0)
        out[tuple(slice(a, a + d) for d, (a, _) in zip(self._shape, axes))] = self
        return out

    # --- indexing ------------------------------------------------------------------------
    def _parse_index(self, idxs):
        """Turn an index into (view, squeeze_axes): basic indexing only."""
        if not isinstance(idxs, tuple):
            idxs = (idxs,)
        n_ell = builtins.sum(1 for i in idxs if i is Ellipsis)
        if n_ell > 1:
            raise IndexOutOfRangeError("an index can only have a single ellipsis ('...')")
        n_real = builtins.sum(1 for i in idxs if i is not None and i is not Ellipsis)
        if n_real > self.ndim:
            raise IndexOutOfRangeError(f"too many indices ({n_real}) for an array of "
                                       f"{self.ndim} dimensions")
        expanded = []
        for i in idxs:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (self.ndim - n_real))
            else:
                expanded.append(i)
        if not n_ell:
            expanded.extend([slice(None)] * (self.ndim - n_real))
        shape, strides, offset, dim = [], [], self._offset, 0
        for i in expanded:
            if i is None:
                shape.append(1)
                strides.append(0)
                continue
            size, stride = self._shape[dim], self._strides[dim]
            if isinstance(i, slice):
                try:
                    start, stop, step = i.indices(size)
                except (TypeError, ValueError) as e:  # a zero step, or bounds that are not ints
                    raise IndexOutOfRangeError(f"bad slice {i!r}: {e}") from None
                n = len(range(start, stop, step))
                offset += start * stride if n else 0
                shape.append(n)
                strides.append(stride * step)
            elif isinstance(i, (numbers.Integral, np.integer)) and not isinstance(i, bool):
                j = int(i)
                if not -size <= j < size:
                    raise IndexOutOfRangeError(f"index {j} is out of range for axis {dim} "
                                               f"of size {size}")
                offset += (j % size) * stride
            else:
                raise IndexOutOfRangeError(
                    f"unsupported index {i!r}: use ints, slices, None or '...' "
                    "(for lookups by an index array use take())")
            dim += 1
        return self._view(tuple(shape), tuple(strides), offset)

    def __getitem__(self, idxs) -> NDArray:
        return self._parse_index(idxs)

    def __setitem__(self, idxs, other) -> None:
        view = self._parse_index(idxs)
        # an array with a broadcast axis is read-only (as in numpy): its elements share memory,
        # so a write to one row would silently change the others, even through a sub-view
        if view.size and any(s == 0 and d > 1 for d, s in zip(self.shape, self.strides)):
            raise ShapeError(f"cannot write through a broadcast view (shape {self.shape}, "
                             f"strides {self.strides}): its elements share memory, so the "
                             "write would land in one place; write into a .compact() copy")
        if isinstance(other, NDArray):
            self._check_device(other)
            src = other.astype(self.dtype)
            if src.shape != view.shape:
                src = src.broadcast_to(view.shape)
            src = src.compact()
            self._be.ewise_setitem(src._handle, self._handle, view.shape, view.strides,
                                   view.offset)
        elif isinstance(other, (numbers.Number, np.generic)):
            self._be.scalar_setitem(view.size, other, self._handle, view.shape, view.strides,
                                    view.offset)
        else:
            self[idxs] = NDArray(np.asarray(other), device=self.device, dtype=self.dtype)
