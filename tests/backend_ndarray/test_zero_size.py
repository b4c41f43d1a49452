"""Zero-size arrays through every function of the array API, on every device, against numpy.

Each case builds its inputs from shapes with a 0 somewhere and compares the result's shape,
dtype kind and values (an empty result, or the identity numpy gives: zeros for sums and for
matmuls with an empty inner dimension, NaN for means). Reductions without an identity raise
ShapeError, as numpy raises ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import ShapeError

from ..conftest import assert_close, assert_equal
from .compare import on


def _np(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


UNARY = ["__neg__", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
         "relu", "silu", "gelu", "softmax", "log_softmax"]
BINARY = ["__add__", "__sub__", "__mul__", "__truediv__", "__pow__", "maximum", "minimum",
          "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]
SHAPES = [(0,), (0, 3), (3, 0), (2, 0, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", UNARY)
def test_unary_of_empty(device, op, shape):
    out = getattr(on(device, _np(shape)), op)()
    assert out.shape == shape and out.numpy().size == 0


@pytest.mark.parametrize("shapes", [((0, 3), (0, 3)), ((0, 3), (3,)), ((2, 0, 3), (0, 1)),
                                    ((0,), (1,))])
@pytest.mark.parametrize("op", BINARY)
def test_binary_of_empty(device, op, shapes):
    a, b = (on(device, _np(s, i)) for i, s in enumerate(shapes))
    want = np.broadcast_shapes(*shapes)
    assert getattr(a, op)(b).shape == want
    assert getattr(a, op)(2.0).shape == shapes[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32", "int64", "bool"])
def test_cast_and_where_of_empty(device, dtype):
    a = on(device, _np((0, 3)))
    assert a.astype(dtype).shape == (0, 3) and a.astype(dtype).dtype == dtype
    assert nd.where(a > 0, a, 1.0).shape == (0, 3)


def test_reductions_of_empty(device):
    x = _np((0, 3))
    a = on(device, x)
    assert_equal(a.sum(axis=0), np.zeros(3, np.float32))
    assert_equal(a.mean(axis=0), np.full(3, np.nan, np.float32))
    assert a.sum(axis=1).shape == (0,) and a.max(axis=1).shape == (0,)
    assert a.argmax(axis=1).shape == (0,)
    assert_equal(a.sum(), np.float32(0))
    for op in ("max", "min", "argmax"):
        with pytest.raises(ShapeError, match="empty"):
            getattr(a, op)(axis=0)


def test_layout_of_empty(device):
    x = _np((2, 0, 3))
    a = on(device, x)
    assert_equal(a.permute((2, 0, 1)), x.transpose(2, 0, 1))
    assert_equal(a.reshape((0, 6)), x.reshape(0, 6))
    assert_equal(a.broadcast_to((4, 2, 0, 3)), np.broadcast_to(x, (4, 2, 0, 3)))
    assert_equal(a.flip((0, 2)), np.flip(x, (0, 2)))
    assert_equal(a.pad(((0, 0), (1, 2), (0, 0))), np.pad(x, ((0, 0), (1, 2), (0, 0))))
    assert_equal(a[:, :, 1:], x[:, :, 1:])
    assert_equal(on(device, _np((4, 3)))[2:2], np.zeros((0, 3), np.float32))
    a[:, :, :] = 5.0  # writes nothing, fails nothing
    assert_equal(nd.concatenate([a, on(device, _np((2, 1, 3)))], axis=1), _np((2, 1, 3)))
    assert nd.stack([a, a], axis=0).shape == (2, 2, 0, 3)
    assert a.compact().shape == (2, 0, 3)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((0, 3), (3, 4)), ((2, 0), (0, 4)), ((2, 3), (3, 0)), ((1, 0), (0, 5)),
    ((0, 2, 3), (0, 3, 4)), ((5, 2, 0), (5, 0, 4)), ((3, 2, 3), (3, 0)), ((0,), (0, 4)),
    ((4, 0), (0,)),
])
def test_matmul_family_of_empty(device, a_shape, b_shape):
    x, y = _np(a_shape), _np(b_shape, 1)
    got = on(device, x) @ on(device, y)
    assert_close(got, x @ y, "float32", kind="matmul")


def test_nn_ops_of_empty(device):
    x = on(device, _np((0, 4)))
    w, b = on(device, _np((4,), 1)), on(device, _np((4,), 2))
    assert x.rmsnorm(w, 1e-6).shape == (0, 4)
    assert x.layernorm(w, b, 1e-5).shape == (0, 4)
    assert x.silu_mul(x).shape == (0, 4)
    table = on(device, _np((5, 4)))
    ids = nd.array(np.zeros(0, np.int32), device=device)
    assert table.take(ids).shape == (0, 4)
    grads = nd.scatter_add(ids, x, rows=5)
    assert_equal(grads, np.zeros((5, 4), np.float32))
