"""Initializers: shapes, dtypes, devices, seeding and the distributions' parameters."""

import math

import numpy as np
import pytest

import needle as ndl
from needle import init
from needle.errors import NeedleError, ShapeError

from .conftest import supports


def test_shapes_dtypes_and_device(device):
    dtype = "float64" if supports(device, "float64") else "float16"
    t = init.rand(2, 3, device=device, dtype=dtype, requires_grad=True)
    assert t.shape == (2, 3) and t.dtype == dtype and t.device == device
    assert t.requires_grad
    assert init.randn((4,), device=device).shape == (4,)
    z = init.zeros(3, 2, device=device, dtype="int32")
    assert z.dtype == "int32" and not z.numpy().any()
    np.testing.assert_array_equal(init.constant(2, c=7.5, device=device).numpy(), [7.5, 7.5])
    np.testing.assert_array_equal(init.ones_like(t).numpy(), np.ones((2, 3)))
    assert init.zeros_like(t).device == device


def test_seed_and_generator_repeat():
    a = init.randn(5, seed=3).numpy()
    b = init.randn(5, seed=3).numpy()
    np.testing.assert_array_equal(a, b)
    g1, g2 = np.random.default_rng(9), np.random.default_rng(9)
    np.testing.assert_array_equal(init.rand(4, generator=g1).numpy(),
                                  init.rand(4, generator=g2).numpy())
    init.manual_seed(11)
    first = [init.rand(3).numpy(), init.randb(8).numpy()]
    init.manual_seed(11)
    second = [init.rand(3).numpy(), init.randb(8).numpy()]
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(NeedleError, match="either"):
        init.rand(2, seed=1, generator=np.random.default_rng())


def test_bad_shape():
    with pytest.raises(ShapeError):
        init.rand(2, -1)


def test_ranges_and_fan_scaling():
    x = init.rand(20000, low=-2, high=3, seed=0).numpy()
    assert x.min() >= -2 and x.max() < 3 and abs(x.mean() - 0.5) < 0.05
    y = init.randn(20000, mean=1.0, std=2.0, seed=0).numpy()
    assert abs(y.mean() - 1) < 0.05 and abs(y.std() - 2) < 0.05

    a = math.sqrt(6 / (300 + 100))
    w = init.xavier_uniform(300, 100, seed=0).numpy()
    assert w.shape == (300, 100) and np.abs(w).max() <= a and np.abs(w).max() > 0.99 * a
    w = init.xavier_normal(300, 100, gain=2.0, seed=0).numpy()
    assert abs(w.std() - 2 * math.sqrt(2 / 400)) < 0.003
    bound = math.sqrt(2) * math.sqrt(3 / 300)
    w = init.kaiming_uniform(300, 100, seed=0).numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    w = init.kaiming_normal(300, 100, nonlinearity="tanh", shape=(3, 100, 100), seed=0).numpy()
    assert w.shape == (3, 100, 100) and abs(w.std() - 5 / 3 / math.sqrt(300)) < 0.003
    with pytest.raises(NeedleError, match="nonlinearity"):
        init.kaiming_uniform(3, 3, nonlinearity="swish")


def test_randb_probability():
    b = init.randb(20000, p=0.3, seed=1)
    assert b.dtype == "bool" and abs(b.numpy().mean() - 0.3) < 0.02


def test_one_hot(device):
    labels = np.array([[2, 0], [1, 2]])
    expected = np.eye(3)[labels]
    np.testing.assert_array_equal(init.one_hot(3, labels, device=device).numpy(), expected)
    on_device = ndl.Tensor(labels, device=device, requires_grad=False)
    hot = init.one_hot(3, on_device, dtype="float16")
    assert hot.device == device and hot.dtype == "float16"
    np.testing.assert_array_equal(hot.numpy(), expected)
    with pytest.raises(ShapeError, match="labels"):
        init.one_hot(3, [0, 3])


def test_one_hot_reuses_its_class_ids_on_a_device():
    """A loss calls one_hot every step: the 0..n-1 row it compares against is made once per
    (n, device, dtype), not copied from the host each time."""
    from needle import backend_ndarray as nd

    dev = nd.cpu()
    labels = nd.array(np.array([2, 0, 1, 2]), device=dev, dtype="int64")
    init._class_ids.cache_clear()
    first = init.one_hot(3, labels, device=dev).numpy()
    again = init.one_hot(3, labels, device=dev).numpy()
    np.testing.assert_array_equal(first, np.eye(3, dtype=np.float32)[[2, 0, 1, 2]])
    np.testing.assert_array_equal(again, first)
    info = init._class_ids.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    other = init.one_hot(4, nd.array(np.array([3]), device=dev, dtype="int32"), device=dev)
    np.testing.assert_array_equal(other.numpy(), [[0, 0, 0, 1]])
