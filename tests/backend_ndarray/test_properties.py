"""Property tests: random sequences of views, writes and reductions, applied in parallel to an
NDArray and a numpy array, must agree at every step (design §7).

Writes go through views into the root array, so a view that wrongly copies (or a copy that
wrongly aliases) shows up as a difference in the roots. numpy decides when a reshape can be a
view and NDArray asks numpy the same question, so both sides alias alike.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from needle.errors import ShapeError

from ..conftest import assert_equal
from .compare import np_dtype, on

DTYPES = ("float32", "int64", "bool", "float16")
PROPERTY_SETTINGS = settings(max_examples=1000, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow,
                                                    HealthCheck.data_too_large])


def _values(data, shape, dtype) -> np.ndarray:
    """Small integers (exact in every dtype, exact sums), from a drawn seed: cheap to draw."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)  # 0-d: an array, not a numpy scalar
    return np.asarray(rng.integers(-5, 6, size=shape).astype(np_dtype(dtype)))


def _dims(data, n, low=0, high=4):
    return tuple(data.draw(st.lists(st.integers(low, high), min_size=n, max_size=n)))


def _factor_shape(data, size: int) -> tuple[int, ...]:
    """A random shape with ``size`` elements, sometimes with one dimension given as -1."""
    ndim = data.draw(st.integers(0 if size == 1 else 1, 4))
    if size == 0:
        shape = list(_dims(data, ndim, 0, 3))
        shape[data.draw(st.integers(0, ndim - 1))] = 0
        return tuple(shape)
    shape = [1] * ndim
    n, p = size, 2
    while n > 1:  # deal the prime factors out to random dimensions
        while n % p == 0:
            shape[data.draw(st.integers(0, ndim - 1))] *= p
            n //= p
        p += 1
    if ndim and data.draw(st.booleans()):
        shape[data.draw(st.integers(0, ndim - 1))] = -1
    return tuple(shape)


def _index(data, shape) -> tuple:
    """A basic index: ints, slices with any step (negative too), None and maybe one '...'
    standing for the axes between the indexed front and back ones."""
    front = data.draw(st.integers(0, len(shape)))
    back = data.draw(st.integers(0, len(shape) - front))
    ellipsis = data.draw(st.booleans())
    if not ellipsis:
        back = 0
    items = [_axis_index(data, d) for d in shape[:front]]
    if ellipsis:
        items.append([Ellipsis])
    items += [_axis_index(data, d) for d in shape[len(shape) - back:]]
    return tuple(i for group in items for i in group)


def _axis_index(data, dim: int) -> list:
    """The index items for one axis: an int or a slice, sometimes after a None."""
    out = [None] if data.draw(st.integers(0, 3)) == 0 else []
    if dim and data.draw(st.integers(0, 2)) == 0:
        out.append(data.draw(st.integers(-dim, dim - 1)))
    else:
        bound = st.none() | st.integers(-dim - 2, dim + 2)
        step = st.none() | st.sampled_from([1, 2, 3, -1, -2, -3])
        out.append(slice(data.draw(bound), data.draw(bound), data.draw(step)))
    return out


def _np_index(index: tuple) -> tuple:
    """numpy returns a scalar, not a view, when ints index every axis; '...' keeps a view."""
    return index if Ellipsis in index else index + (Ellipsis,)


def _broadcast_shape(data, shape) -> tuple[int, ...]:
    lead = _dims(data, data.draw(st.integers(0, 2)), 1, 3)
    return lead + tuple(data.draw(st.integers(1, 3)) if d == 1 else d for d in shape)


def _np_broadcast(x: np.ndarray, shape) -> np.ndarray:
    """A writable broadcast view (np.broadcast_to's is read-only)."""
    lead = len(shape) - x.ndim
    strides = (0,) * lead + tuple(0 if d != n else s
                                  for d, n, s in zip(x.shape, shape[lead:], x.strides))
    return np.lib.stride_tricks.as_strided(x, shape, strides)


def _aliased(x: np.ndarray) -> bool:
    """Whether some elements of the view are the same memory (a broadcast axis)."""
    return any(s == 0 and d > 1 for s, d in zip(x.strides, x.shape))


class Pair:
    """An NDArray and a numpy array that must always hold the same values."""

    def __init__(self, device, data):
        self.device = device
        self.dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        shape = _dims(data, data.draw(st.integers(0, 4)), 0, 5)
        self.root_np = _values(data, shape, self.dtype)
        self.root = on(device, self.root_np)
        self.a, self.x = self.root, self.root_np

    def check(self):
        assert self.a.shape == self.x.shape
        assert_equal(self.a, self.x)
        assert_equal(self.root, self.root_np)

    # views --------------------------------------------------------------------------------
    def reshape(self, data):
        shape = _factor_shape(data, self.x.size)
        self.a, self.x = self.a.reshape(shape), self.x.reshape(shape)

    def permute(self, data):
        axes = tuple(data.draw(st.permutations(range(self.x.ndim))))
        self.a, self.x = self.a.permute(axes), self.x.transpose(axes)

    def broadcast(self, data):
        shape = _broadcast_shape(data, self.x.shape)
        self.a, self.x = self.a.broadcast_to(shape), _np_broadcast(self.x, shape)

    def getitem(self, data):
        index = _index(data, self.x.shape)
        self.a, self.x = self.a[index], self.x[_np_index(index)]

    def flip(self, data):
        if not self.x.ndim:
            return
        axes = tuple(data.draw(st.sets(st.integers(0, self.x.ndim - 1), min_size=1)))
        self.a, self.x = self.a.flip(axes), np.flip(self.x, axes)

    # writes -------------------------------------------------------------------------------
    def setitem_scalar(self, data):
        index = _index(data, self.x.shape)
        value = data.draw(st.booleans() if self.dtype == "bool" else st.integers(-9, 9))
        target = self.x[_np_index(index)]
        # an array with a broadcast axis is read-only, as in numpy: refused, nothing written
        if target.size and _aliased(self.x):
            with pytest.raises(ShapeError, match="broadcast view"):
                self.a[index] = value
            return
        self.a[index] = value
        self.x[_np_index(index)] = value

    def setitem_array(self, data):
        index = _index(data, self.x.shape)
        target = self.x[_np_index(index)]
        if _aliased(self.x):
            return self.setitem_scalar(data)
        shape = target.shape[data.draw(st.integers(0, target.ndim)):]  # broadcast from fewer
        shape = tuple(1 if data.draw(st.booleans()) else d for d in shape)  # and from 1s
        src = _values(data, shape, self.dtype)
        self.a[index] = on(self.device, src)
        target[...] = src

    # reductions ---------------------------------------------------------------------------
    def reduce(self, data):
        op = data.draw(st.sampled_from(["sum", "max", "min", "argmax"]))
        ndim = self.x.ndim
        if op == "argmax" or not ndim or data.draw(st.booleans()):
            axis = data.draw(st.none() | st.integers(-ndim, ndim - 1)) if ndim else None
        else:
            axis = tuple(data.draw(st.sets(st.integers(0, ndim - 1), min_size=1)))
        keepdims = data.draw(st.booleans())
        empty = self.x.size == 0 and (axis is None or any(
            self.x.shape[i] == 0 for i in ((axis,) if isinstance(axis, int) else axis)))
        if empty and op != "sum":
            with pytest.raises(ShapeError):
                getattr(self.a, op)(axis=axis, keepdims=keepdims)
            return
        got = getattr(self.a, op)(axis=axis, keepdims=keepdims)
        wide = self.x.astype(np.int64) if self.dtype == "bool" else self.x.astype(np.float64)
        want = getattr(np, op)(wide, axis=axis, keepdims=keepdims)
        if op == "argmax":
            want = np.argmax(self.x, axis=axis, keepdims=keepdims)
        elif op == "sum" and self.dtype == "bool":
            pass  # sums of bools count in int64
        else:
            want = want.astype(np_dtype(self.dtype))
        assert got.shape == np.shape(want)
        assert_equal(got, want)


STEPS = ["reshape", "permute", "broadcast", "getitem", "flip", "setitem_scalar",
         "setitem_array", "reduce"]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_view_write_and_reduce_sequences_match_numpy(device, data):
    pair = Pair(device, data)
    for step in data.draw(st.lists(st.sampled_from(STEPS), min_size=1, max_size=6),
                          label="steps"):
        if pair.x.size > 2000:  # broadcasts compound; keep every example cheap
            break
        getattr(pair, step)(data)
        pair.check()
    assert_equal(pair.a.compact(), pair.x)  # and the final view compacts to the same values
