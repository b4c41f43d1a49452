"""Names the needle course's NDArray has (dlsyscourse hw3): ``flat`` and ``process_slice``.

The course's gradient checks nudge one element at a time through ``array.flat[j] += eps``,
and its hw3 tests build their expected slices with ``process_slice``. Both are thin layers
over NDArray's own indexing.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import ArgumentTypeError, IndexOutOfRangeError


class FlatView:
    """numpy's ``a.flat`` for an NDArray: element ``i`` in row-major order of the array's
    shape (whatever its strides), readable and assignable; writes land in the array."""

    __slots__ = ("_array",)

    def __init__(self, array) -> None:
        self._array = array

    def __len__(self) -> int:
        return self._array.size

    def _position(self, i) -> tuple[int, ...]:
        if not isinstance(i, numbers.Integral) or isinstance(i, bool):
            raise ArgumentTypeError(f"flat index must be an int, got {type(i).__name__} "
                                    "(slice the array itself, or use .numpy().flat)")
        n = self._array.size
        if not -n <= i < n:
            raise IndexOutOfRangeError(f"flat index {i} is out of range for an array of "
                                       f"{n} elements")
        return tuple(int(k) for k in np.unravel_index(int(i) % n, self._array.shape))

    def __getitem__(self, i):
        """Element ``i`` as a numpy scalar of the array's dtype (as numpy's flat gives)."""
        return self._array[self._position(i)].numpy()[()]

    def __setitem__(self, i, value) -> None:
        self._array[self._position(i)] = value

    def __iter__(self):
        return iter(self._array.numpy().reshape(-1))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        flat = self._array.numpy().reshape(-1)
        return flat if dtype is None else flat.astype(dtype)


def process_slice(shape: tuple[int, ...], sl: slice, dim: int) -> slice:
    """``sl`` with explicit start, stop and step for axis ``dim`` of ``shape`` (negative
    and missing bounds resolved, as ``slice.indices`` does); the same elements on numpy."""
    if not isinstance(sl, slice):
        raise ArgumentTypeError(f"process_slice takes a slice, got {type(sl).__name__}")
    if not -len(shape) <= dim < len(shape):
        raise IndexOutOfRangeError(f"process_slice: axis {dim} is out of range for shape "
                                   f"{shape}")
    start, stop, step = sl.indices(shape[dim])
    if step < 0 and stop < 0:  # "down to and including 0": -1 would mean the last element
        return slice(start, None, step)
    return slice(start, stop, step)
