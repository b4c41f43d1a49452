"""Autograd mechanics: graph recording, accumulation, no_grad, detach, higher order, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import autograd, ops
from needle.errors import GradientError, ShapeError

from .conftest import enabled_devices, supports


def tensor(device, x, **kw):
    return ndl.Tensor(np.asarray(x, dtype=np.float32), device=device, **kw)


def test_construction_dtypes_and_devices(device):
    assert ndl.Tensor([1, 2], device=device).dtype == "int64"
    assert ndl.Tensor([1.5, 2.0], device=device).dtype == "float32"
    assert ndl.Tensor(np.zeros(3, np.float32), device=device).dtype == "float32"
    assert ndl.Tensor(2.5, device=device).shape == ()
    assert ndl.Tensor([True], device=device).dtype == "bool"
    x = ndl.Tensor([[1, 2, 3]], device=device, dtype="float16")
    assert (x.dtype, x.shape, x.ndim, x.size, x.device) == ("float16", (1, 3), 2, 3, device)
    assert not ndl.Tensor([1, 2], device=device).requires_grad  # integers carry no gradient
    same = ndl.Tensor(x)
    assert same.realize_cached_data() is x.realize_cached_data()  # no copy
    assert ndl.Tensor(x, dtype="float32").dtype == "float32"


def test_repeated_use_accumulates(device):
    x = tensor(device, [1.0, -2.0, 3.0])
    y = x * x + x * 3.0 + x
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy() + 4)


def test_backward_twice_accumulates_and_none_resets(device):
    x = tensor(device, [1.0, 2.0])
    loss = (x * x).sum()
    loss.backward()
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * x.numpy())
    x.grad = None
    (x * 5.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 5.0])


def test_default_out_grad_is_ones_and_checked(device):
    x = tensor(device, [[1.0, 2.0], [3.0, 4.0]])
    (x * 2.0).backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 2), 2.0))
    with pytest.raises(ShapeError):
        (x * 2.0).backward(tensor(device, [1.0, 2.0], requires_grad=False))


def test_backward_without_graph_raises(device):
    c = tensor(device, [1.0], requires_grad=False)
    with pytest.raises(GradientError):
        (c * 2.0).backward()


def test_detach_stops_gradient(device):
    x = tensor(device, [2.0, 3.0])
    y = x * x.detach()
    assert not x.detach().requires_grad and x.detach().op is None
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), x.numpy())  # only the first factor


def test_no_grad_records_nothing(device):
    x = tensor(device, [1.0, 2.0])
    with ndl.no_grad():
        y = x * 2.0 + x
        with ndl.enable_grad():
            z = x * 3.0
        assert not ndl.is_grad_enabled()
    assert ndl.is_grad_enabled()
    assert not y.requires_grad and y.op is None and y.inputs == []
    assert z.requires_grad and z.op is not None

    @ndl.no_grad()
    def infer(t):
        return t * 2.0

    assert not infer(x).requires_grad


def test_requires_grad_propagation(device):
    w = tensor(device, [1.0, 2.0])
    c = tensor(device, [3.0, 4.0], requires_grad=False)
    assert (w * c).requires_grad
    assert not (c * c).requires_grad
    assert not (w > c).requires_grad  # comparisons are constants
    assert not ops.cast(w, "int32").requires_grad
    (w * c).sum().backward()
    assert c.grad is None


def test_stored_gradients_hold_no_graph(device):
    x = tensor(device, [1.0, 2.0])
    (ops.exp(x) * x).sum().backward()
    assert x.grad.op is None and not x.grad.requires_grad


def test_higher_order_gradient(device):
    x = tensor(device, [0.5, -1.0, 2.0])
    y = (x ** 3).sum()
    (dx,) = ndl.grad(y, [x], create_graph=True)
    np.testing.assert_allclose(dx.numpy(), 3 * x.numpy() ** 2, rtol=1e-6)
    assert x.grad is None  # grad() leaves .grad alone
    dx.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * x.numpy(), rtol=1e-6)


def test_backward_create_graph_third_order(device):
    x = tensor(device, [0.3, 1.2])
    ops.tanh(x).sum().backward(create_graph=True)
    g1 = x.grad
    (g2,) = ndl.grad(g1.sum(), [x], create_graph=True)
    (g3,) = ndl.grad(g2.sum(), [x])
    th = np.tanh(x.numpy().astype(np.float64))
    np.testing.assert_allclose(g3.numpy(), -2 * (1 - th ** 2) ** 2 + 4 * th ** 2 * (1 - th ** 2),
                               rtol=1e-5)


def test_grad_of_intermediate_tensor(device):
    x = tensor(device, [1.0, 2.0])
    h = x * 3.0
    y = (h * h).sum()
    gh, gx = ndl.grad(y, [h, x])
    np.testing.assert_allclose(gh.numpy(), 2 * h.numpy())
    assert gx is None  # the gradient stops at h, which was asked for


def test_gradient_dtype_matches_input(device):
    half = ndl.Tensor([1.0, 2.0], device=device, dtype="float16")
    full = tensor(device, [3.0, 4.0])
    out = half * full
    assert out.dtype == "float32"
    out.sum().backward()
    assert half.grad.dtype == "float16" and full.grad.dtype == "float32"
    np.testing.assert_allclose(half.grad.numpy(), [3.0, 4.0])
    b = ndl.Tensor([1.0, 2.0], device=device, dtype="bfloat16")
    ops.cast(b, "float32").sum().backward()
    assert b.grad.dtype == "bfloat16"


def test_float64_gradients(device):
    if not supports(device, "float64"):
        pytest.skip(f"{device.name} has no float64")
    x = ndl.Tensor(np.array([0.1, 0.2]), device=device, dtype="float64")
    (x * x).sum().backward()
    assert x.grad.dtype == "float64"
    np.testing.assert_array_equal(x.grad.numpy(), [0.2, 0.4])


def test_broadcast_gradients_sum_to_input_shape(device):
    x = tensor(device, np.ones((2, 3)))
    b = tensor(device, [1.0, 2.0, 3.0])
    (x * b + b).sum().backward()
    assert b.grad.shape == (3,)
    np.testing.assert_allclose(b.grad.numpy(), [4.0, 4.0, 4.0])  # x + 1, twice


def test_numpy_operands_and_reflected_operators(device):
    x = tensor(device, [1.0, 2.0])
    y = np.array([3.0, 4.0]) + x  # numpy defers to Tensor.__radd__
    assert isinstance(y, ndl.Tensor)
    z = 1.0 - x
    w = 2.0 / x
    (y + z + w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 1 - 1 - 2 / x.numpy() ** 2)


def test_data_property_and_setter(device):
    x = tensor(device, [1.0, 2.0])
    d = x.data
    assert not d.requires_grad and d.op is None
    x.data = x.data * 0.5
    np.testing.assert_allclose(x.numpy(), [0.5, 1.0])
    assert x.requires_grad
    x.data = ndl.Tensor([1.0, 2.0, 3.0], device=device, dtype="float16")
    assert (x.shape, x.dtype) == ((3,), "float16")


def test_item_and_conversions(device):
    s = tensor(device, [[2.5]])
    assert s.item() == 2.5 and float(s) == 2.5
    assert "needle.Tensor" in repr(s)
    assert len(tensor(device, [1.0, 2.0, 3.0])) == 3
    with pytest.raises(ShapeError):
        tensor(device, [1.0, 2.0]).item()


def test_tensors_can_key_dicts(device):
    a, b = tensor(device, [1.0]), tensor(device, [1.0])
    table = {a: "a", b: "b"}
    assert table[a] == "a" and table[b] == "b"


def test_tensor_tuple(device):
    a, b = tensor(device, [1.0, 2.0]), tensor(device, [3.0])
    tup = ops.make_tuple(a, b)
    assert len(tup) == 2
    first, second = tup
    (first.sum() * second.sum()).backward()
    np.testing.assert_allclose(a.grad.numpy(), [3.0, 3.0])
    np.testing.assert_allclose(b.grad.numpy(), [3.0])


def test_deep_graph_does_not_recurse(device):
    x = tensor(device, [1.0])
    y = x
    for _ in range(1200):  # deeper than the recursion limit
        y = y + 1.0
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0])


def test_lazy_mode_defers_compute(device, monkeypatch):
    monkeypatch.setattr(autograd, "LAZY_MODE", True)
    x = tensor(device, [1.0, 2.0])
    y = ops.exp(x) * 2.0
    assert y.cached_data is None
    np.testing.assert_allclose(y.numpy(), 2 * np.exp([1.0, 2.0]), rtol=1e-6)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp([1.0, 2.0]), rtol=1e-6)


def test_to_device_is_differentiable(device):
    others = [d for d in enabled_devices() if d != device]
    x = tensor(device, [1.0, 2.0])
    assert x.to(device) is x
    if not others:
        pytest.skip("only one device enabled")
    y = x.to(others[0])
    assert y.device == others[0]
    (y * y).sum().backward()
    assert x.grad.device == device
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])
