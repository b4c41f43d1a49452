"""Shape, stride and axis arithmetic for NDArray (split from ndarray.py, which still exports
these names): sizes (``_prod``), compact strides, shape and axis checks, and numpy's
broadcasting rule. ``_prod`` and ``_compact_strides`` are on every op's hot path, so they
cache their answers per shape."""

from __future__ import annotations

import builtins
import numbers
import operator
from functools import lru_cache, reduce

from ..errors import AxisError, ShapeError

_prod_any = lambda xs: reduce(operator.mul, xs, 1)  # noqa: E731


@lru_cache(maxsize=8192)
def _prod_shape(shape: tuple) -> int:
    return _prod_any(shape)


def _prod(xs) -> int:
    """The product of a shape: cached for tuples (every op asks it of the same few shapes;
    issue 13's eager-overhead profile), computed for anything else."""
    if type(xs) is tuple:
        try:
            return _prod_shape(xs)
        except TypeError:  # unhashable entries: let the product raise its own error
            pass
    return _prod_any(xs)


def _compact_strides(shape) -> tuple[int, ...]:
    try:
        return _compact_strides_of(shape if type(shape) is tuple else tuple(shape))
    except TypeError:  # unhashable entries
        return _compact_strides_of.__wrapped__(tuple(shape))


@lru_cache(maxsize=8192)
def _compact_strides_of(shape: tuple) -> tuple[int, ...]:
    stride, out = 1, []
    for dim in reversed(shape):
        out.append(stride)
        stride *= dim
    return tuple(reversed(out))


def _check_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(map(operator.index, shape))
    except TypeError:
        raise ShapeError(f"shape must be a tuple of ints, got {shape!r}") from None
    if shape and builtins.min(shape) < 0:
        raise ShapeError(f"negative dimension in shape {shape}; sizes must be >= 0")
    return shape


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """The numpy broadcast of ``shapes``, or ShapeError naming the dimensions that clash."""
    ndim = builtins.max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = {s[i - ndim + len(s)] for s in shapes if i - ndim + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ShapeError(f"shapes {' and '.join(map(str, shapes))} cannot be broadcast "
                             "together "
                             f"(dimension {i} is {sorted(dims)})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, numbers.Integral):
        axes = (axis,)
    elif isinstance(axis, (tuple, list, range)):
        axes = tuple(axis)
    else:
        raise AxisError(f"axis must be an int or a tuple of ints, got {axis!r}")
    out = []
    for ax in axes:
        if not isinstance(ax, numbers.Integral):
            raise AxisError(f"axis must be an int, got {ax!r}")
        if not -ndim <= ax < ndim:
            raise AxisError(f"axis {ax} is out of range for an array of {ndim} dimensions")
        out.append(int(ax) % ndim)
    if len(set(out)) != len(out):
        raise AxisError(f"repeated axis in {axis!r}")
    return tuple(out)
