"""Forward results of the ops against numpy, in float32 on every enabled device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle as ndl
from needle import ops
from needle.errors import AxisError, ShapeError

from ..conftest import assert_close

R = np.random.default_rng(7)


def t(device, x, dtype="float32"):
    return ndl.Tensor(np.asarray(x), device=device, dtype=dtype, requires_grad=False)


def randn(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _erf(x):
    return np.vectorize(math.erf)(x)


UNARY = {
    "exp": (ops.exp, np.exp),
    "log": (lambda a: ops.log(ops.exp(a)), lambda x: x),
    "tanh": (ops.tanh, np.tanh),
    "sigmoid": (ops.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "relu": (ops.relu, lambda x: np.maximum(x, 0)),
    "silu": (ops.silu, lambda x: x / (1 + np.exp(-x))),
    "gelu": (ops.gelu, lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2)))),
    "sqrt": (lambda a: ops.sqrt(a * a), np.abs),
    "negate": (ops.negate, np.negative),
    "power_scalar": (lambda a: a ** 3, lambda x: x ** 3),
    "maximum_scalar": (lambda a: ops.maximum(a, 0.25), lambda x: np.maximum(x, 0.25)),
    "softmax": (ops.softmax, lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)),
    "log_softmax": (ops.log_softmax, lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))),
    "mean": (lambda a: a.mean((0, 2)), lambda x: x.mean((0, 2))),
    "sum_keepdims": (lambda a: a.sum(1, keepdims=True), lambda x: x.sum(1, keepdims=True)),
    "max": (lambda a: a.max(-1), lambda x: x.max(-1)),
    "logsumexp": (lambda a: ops.logsumexp(a, (1, 2)),
                  lambda x: np.log(np.exp(x).sum((1, 2)))),
    "transpose_default": (ops.transpose, lambda x: x.swapaxes(-1, -2)),
    "transpose_pair": (lambda a: ops.transpose(a, (0, 1)), lambda x: x.swapaxes(0, 1)),
    "permute": (lambda a: ops.permute(a, (1, 2, 0)), lambda x: x.transpose(1, 2, 0)),
    "flip": (lambda a: ops.flip(a, (1,)), lambda x: x[:, ::-1]),
    "getitem": (lambda a: a[1, ::-1, None, 1:3], lambda x: x[1, ::-1, None, 1:3]),
    "split_stack": (lambda a: ops.stack(list(ops.split(a, 2))[::-1], axis=0),
                    lambda x: np.moveaxis(x[:, :, ::-1], 2, 0)),
    "undilate": (lambda a: ops.undilate(a, (2,), 1), lambda x: x[:, :, ::2]),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_forward(device, name):
    fn, ref = UNARY[name]
    x = randn(2, 3, 4)
    assert_close(fn(t(device, x)).numpy(), ref(x.astype(np.float64)), "float32", "reduction")


BINARY = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / (b * b + 1), lambda x, y: x / (y * y + 1)),
    "power": (lambda a, b: (a * a + 1) ** b, lambda x, y: (x * x + 1) ** y),
    "maximum": (ops.maximum, np.maximum),
    "matmul": (lambda a, b: a @ ops.transpose(b), lambda x, y: x @ y.swapaxes(-1, -2)),
    "where": (lambda a, b: ops.where(a > b, a, b * 2), lambda x, y: np.where(x > y, x, y * 2)),
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_forward_broadcasts(device, name):
    fn, ref = BINARY[name]
    x, y = randn(2, 3, 4), randn(3, 4)
    assert_close(fn(t(device, x), t(device, y)).numpy(), ref(x.astype(np.float64), y),
                 "float32", "matmul")


def test_dilate_inserts_zeros(device):
    x = randn(2, 3)
    out = ops.dilate(t(device, x), (1,), 2).numpy()
    expected = np.zeros((2, 9), np.float32)
    expected[:, ::3] = x
    np.testing.assert_array_equal(out, expected)


def test_concatenate_and_pad(device):
    a, b = randn(2, 3), randn(2, 1)
    out = ops.concatenate([t(device, a), t(device, b)], axis=1)
    np.testing.assert_array_equal(out.numpy(), np.concatenate([a, b], 1))
    padded = ops.pad(t(device, a), ((1, 0), (0, 2)))
    np.testing.assert_array_equal(padded.numpy(), np.pad(a, ((1, 0), (0, 2))))


def test_max_gradient_splits_ties_evenly(device):
    x = t(device, [[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    x.requires_grad = True
    x.max(1).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 0.5, 0.5], [0.5, 0, 0.5]])


def test_maximum_gradient_at_ties_goes_to_first(device):
    a, b = t(device, [1.0, 2.0]), t(device, [1.0, 3.0])
    a.requires_grad = b.requires_grad = True
    ops.maximum(a, b).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [1, 0])
    np.testing.assert_array_equal(b.grad.numpy(), [0, 1])


def test_logsumexp_is_stable(device):
    x = np.array([[1000.0, 1000.0], [-1000.0, -1000.0], [-np.inf, -np.inf], [-np.inf, 0.0]])
    out = ops.logsumexp(t(device, x), (1,)).numpy()
    np.testing.assert_allclose(out[:2], [1000 + np.log(2), -1000 + np.log(2)], rtol=1e-6)
    assert out[2] == -np.inf
    assert out[3] == 0.0


def _conv_reference(x, w, stride, padding):
    x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    n, h, wd, _ = x.shape
    kh, kw, _, c_out = w.shape
    ho, wo = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, ho, wo, c_out))
    for i in range(ho):
        for j in range(wo):
            patch = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
            out[:, i, j, :] = np.tensordot(patch, w, axes=([1, 2, 3], [0, 1, 2]))
    return out


@pytest.mark.parametrize("stride,padding,k", [(1, 0, 3), (2, 1, 3), (1, 2, 1), (3, 0, 2)])
def test_conv_forward(device, stride, padding, k):
    x, w = randn(2, 7, 6, 3), randn(k, k, 3, 4)
    out = ops.conv(t(device, x), t(device, w), stride=stride, padding=padding)
    assert_close(out.numpy(), _conv_reference(x.astype(np.float64), w, stride, padding),
                 "float32", "matmul")


def test_conv_rejects_bad_shapes(device):
    with pytest.raises(ShapeError):
        ops.conv(t(device, randn(1, 4, 4, 3)), t(device, randn(3, 3, 2, 1)))
    with pytest.raises(ShapeError):
        ops.conv(t(device, randn(1, 2, 2, 1)), t(device, randn(3, 3, 1, 1)))
    with pytest.raises(ShapeError):
        ops.conv(t(device, randn(1, 4, 4, 1)), t(device, randn(3, 3, 1, 1)), stride=0)


def test_embedding_forward(device):
    w = randn(6, 3)
    ids = np.array([[5, 0], [2, 2]])
    out = ops.embedding(t(device, w), ndl.Tensor(ids, device=device))
    np.testing.assert_array_equal(out.numpy(), w[ids])


def test_norms_forward(device):
    x, w, b = randn(2, 3, 8), randn(8), randn(8)
    rms = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert_close(ops.rmsnorm(t(device, x), t(device, w), 1e-6).numpy(), rms, "float32",
                 "reduction")
    mu = x.astype(np.float64).mean(-1, keepdims=True)
    ln = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    assert_close(ops.layernorm(t(device, x), t(device, w), t(device, b), 1e-5).numpy(), ln,
                 "float32", "reduction")


def test_rope_forward_and_inverse(device):
    x = randn(1, 3, 2, 4)
    ang = R.uniform(0, 6, (3, 2))
    cos, sin = np.cos(ang), np.sin(ang)
    out = ops.rope(t(device, x), t(device, cos), t(device, sin))
    x1, x2 = x[..., :2], x[..., 2:]
    c, s = cos[None, :, None], sin[None, :, None]
    assert_close(out.numpy(), np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1), "float32")
    back = ops.rope(out, t(device, cos), t(device, -sin))
    assert_close(back.numpy(), x, "float32", "reduction")


def _attention_reference(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = q @ k.swapaxes(-1, -2) * scale
    if causal:
        sq, skv = q.shape[2], k.shape[2]
        s = np.where(np.arange(skv)[None] <= np.arange(sq)[:, None] + skv - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward(device, causal):
    q, k, v = randn(2, 4, 3, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 8)
    out = ops.scaled_dot_product_attention(t(device, q), t(device, k), t(device, v),
                                           causal=causal)
    expected = _attention_reference(q.astype(np.float64), k, v, causal, 1 / np.sqrt(8))
    assert_close(out.numpy(), expected, "float32", "matmul")


def test_silu_mul_forward(device):
    a, b = randn(3, 5), randn(3, 5)
    assert_close(ops.silu_mul(t(device, a), t(device, b)).numpy(),
                 a / (1 + np.exp(-a.astype(np.float64))) * b, "float32")


def test_cast_and_comparisons(device):
    x = t(device, [1.5, -2.0, 0.0])
    assert x.astype("int32").dtype == "int32"
    np.testing.assert_array_equal(x.astype("int32").numpy(), [1, -2, 0])
    lt = x < 0.5
    assert lt.dtype == "bool" and not lt.requires_grad
    np.testing.assert_array_equal(lt.numpy(), [False, True, True])
    np.testing.assert_array_equal((x == x).numpy(), [True, True, True])


def test_bad_axes_raise(device):
    x = t(device, randn(2, 3))
    with pytest.raises(AxisError):
        x.sum(2)
    with pytest.raises(AxisError):
        ops.transpose(t(device, randn(3)))
    with pytest.raises(ShapeError):
        x.reshape(4, 2)
    with pytest.raises(ShapeError):
        ops.transpose(x, (0, 1, 2))
