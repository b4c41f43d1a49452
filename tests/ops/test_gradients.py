"""Every op's gradient against central finite differences, on every enabled device.

Each case is (function of Tensors, input arrays). Inputs keep away from points where an op
is not differentiable (relu at 0, ties in max, log of non-positives).
"""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import ops

from .gradcheck import check_gradients, check_second_order

R = np.random.default_rng(1234)


def randn(*shape):
    return R.standard_normal(shape)


def positive(*shape):
    return R.uniform(0.5, 2.0, shape)


def away_from_zero(*shape):
    return R.choice([-1.0, 1.0], shape) * R.uniform(0.2, 2.0, shape)


def distinct(*shape):
    """Values far apart (no near-ties for max and maximum)."""
    return R.permutation(np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape) / 3


def distributions(rows, classes):
    """Rows of positive weights summing to 1 (soft cross-entropy targets)."""
    p = R.uniform(0.1, 1.0, (rows, classes))
    return p / p.sum(axis=1, keepdims=True)


def rope_tables(seq, half):
    angles = R.uniform(0, 2 * np.pi, (seq, half))
    return np.cos(angles), np.sin(angles)


CASES = {
    # arithmetic (with broadcasting and promotion)
    "add": (lambda a, b: a + b, [randn(3, 4), randn(3, 4)]),
    "add_broadcast": (lambda a, b: a + b, [randn(2, 3, 4), randn(4)]),
    "add_scalar": (lambda a: a + 1.5, [randn(3, 4)]),
    "sub_rsub": (lambda a, b: (a - b) + (2.0 - a), [randn(3, 4), randn(3, 1)]),
    "multiply": (lambda a, b: a * b, [randn(2, 3, 4), randn(3, 1)]),
    "mul_scalar": (lambda a: a * -2.5, [randn(5)]),
    "divide": (lambda a, b: a / b, [randn(3, 4), away_from_zero(3, 4)]),
    "divide_scalar": (lambda a: a / 4.0, [randn(3, 4)]),
    "rtruediv": (lambda a: 2.0 / a, [away_from_zero(6)]),
    "power": (lambda a, b: a ** b, [positive(3, 4), randn(3, 4)]),
    "power_scalar_2": (lambda a: a ** 2, [randn(3, 4)]),
    "power_scalar_-1.5": (lambda a: a ** -1.5, [positive(3, 4)]),
    "power_scalar_0": (lambda a: a ** 0 + a, [randn(4)]),
    "rpow": (lambda a: 3.0 ** a, [randn(5)]),
    "negate": (lambda a: -a, [randn(3, 4)]),
    # unary functions
    "log": (ops.log, [positive(3, 4)]),
    "exp": (ops.exp, [randn(3, 4)]),
    "sqrt": (ops.sqrt, [positive(3, 4)]),
    "relu": (ops.relu, [away_from_zero(3, 4)]),
    "tanh": (ops.tanh, [randn(3, 4)]),
    "sigmoid": (ops.sigmoid, [randn(3, 4)]),
    "silu": (ops.silu, [randn(3, 4) * 3]),
    "gelu": (ops.gelu, [np.concatenate([randn(12) * 3, [0.0, 1e-4, -5e-4, 2e-3, -7.0]])]),
    "maximum": (ops.maximum, [distinct(3, 4), distinct(3, 4) + 0.1]),
    "maximum_broadcast": (ops.maximum, [distinct(2, 3), distinct(3) + 0.05]),
    "maximum_scalar": (lambda a: ops.maximum(a, 0.3), [away_from_zero(3, 4)]),
    "where": (lambda a, b: ops.where(ndl.Tensor(np.arange(12).reshape(3, 4) % 3 == 0,
                                                device=a.device), a, b),
              [randn(3, 4), randn(4)]),
    "where_scalar": (lambda a: ops.where(a > 0, a * 2, 0.5), [away_from_zero(3, 4)]),
    # layout
    "reshape": (lambda a: ops.reshape(a, (4, 3)) * ndl.Tensor(np.arange(12.0).reshape(4, 3),
                                                              device=a.device, dtype=a.dtype),
                [randn(2, 6)]),
    "transpose_last": (ops.transpose, [randn(2, 3, 4)]),
    "transpose_axes": (lambda a: ops.transpose(a, (0, 2)), [randn(2, 3, 4)]),
    "permute": (lambda a: ops.permute(a, (2, 0, 1)), [randn(2, 3, 4)]),
    "broadcast_to": (lambda a: ops.broadcast_to(a, (2, 3, 4)), [randn(3, 1)]),
    "flip": (lambda a: ops.flip(a, (0, 2)), [randn(2, 3, 4)]),
    "pad": (lambda a: ops.pad(a, ((1, 0), (0, 2))), [randn(2, 3)]),
    "dilate": (lambda a: ops.dilate(a, (0, 1), 2), [randn(2, 3)]),
    "undilate": (lambda a: ops.undilate(a, (1,), 1), [randn(2, 5)]),
    "getitem": (lambda a: a[1:, ::-2, None, 2], [randn(3, 5, 4)]),
    "getitem_ellipsis": (lambda a: a[..., 1] + a[0], [randn(4, 4)]),
    "stack": (lambda a, b: ops.stack([a, b, a], axis=1), [randn(2, 3), randn(2, 3)]),
    "split": (lambda a: (lambda t: t[0] * t[2] + t[1])(ops.split(a, axis=1)), [randn(2, 3, 4)]),
    "concatenate": (lambda a, b: ops.concatenate([a, b, a], axis=1), [randn(2, 3), randn(2, 1)]),
    # reductions
    "sum_all": (lambda a: a.sum(), [randn(3, 4)]),
    "sum_axis": (lambda a: a.sum(1), [randn(2, 3, 4)]),
    "sum_axes_keepdims": (lambda a: a.sum((0, 2), keepdims=True), [randn(2, 3, 4)]),
    "mean": (lambda a: a.mean(-1), [randn(3, 4)]),
    "max_all": (lambda a: a.max(), [distinct(3, 4)]),
    "max_axis": (lambda a: a.max(1), [distinct(2, 3, 4)]),
    "max_axes_keepdims": (lambda a: a.max((0, 2), keepdims=True), [distinct(2, 3, 4)]),
    "logsumexp": (lambda a: ops.logsumexp(a, (1,)), [randn(3, 4) * 3]),
    "logsumexp_all": (lambda a: ops.logsumexp(a), [randn(3, 4)]),
    "logsumexp_keepdims": (lambda a: ops.logsumexp(a, (0, 2), keepdims=True), [randn(2, 3, 2)]),
    "log_softmax": (ops.log_softmax, [randn(3, 5) * 2]),
    "softmax": (ops.softmax, [randn(2, 3, 5) * 2]),
    "softmax_cross_entropy": (ops.softmax_cross_entropy, [randn(4, 5) * 2, distributions(4, 5)]),
    # matmul
    "matmul_2d": (ops.matmul, [randn(3, 4), randn(4, 5)]),
    "matmul_batched": (ops.matmul, [randn(2, 3, 4), randn(2, 4, 5)]),
    "matmul_broadcast_batch": (ops.matmul, [randn(2, 1, 3, 4), randn(3, 4, 2)]),
    "matmul_3d_2d": (ops.matmul, [randn(2, 3, 4), randn(4, 5)]),
    "matmul_2d_3d": (ops.matmul, [randn(3, 4), randn(2, 4, 5)]),
    "matmul_vec_mat": (ops.matmul, [randn(4), randn(4, 3)]),
    "matmul_mat_vec": (ops.matmul, [randn(2, 3, 4), randn(4)]),
    "matmul_transposed_input": (lambda a, b: ops.transpose(a) @ b, [randn(4, 3), randn(4, 2)]),
    # nn
    "conv": (lambda x, w: ops.conv(x, w), [randn(2, 5, 5, 3), randn(3, 3, 3, 2)]),
    "conv_stride2_pad1": (lambda x, w: ops.conv(x, w, stride=2, padding=1),
                          [randn(1, 6, 5, 2), randn(3, 3, 2, 3)]),
    "conv_1x1_pad2": (lambda x, w: ops.conv(x, w, stride=1, padding=2),
                      [randn(1, 3, 3, 2), randn(1, 1, 2, 2)]),
    "conv_stride3": (lambda x, w: ops.conv(x, w, stride=3, padding=0),
                     [randn(1, 7, 8, 1), randn(2, 2, 1, 2)]),
    "embedding": (lambda w, ids: ops.embedding(w, ids),
                  [randn(5, 3), np.array([[0, 2, 2], [4, 0, 0]], dtype=np.int64)]),
    "rmsnorm": (lambda x, w: ops.rmsnorm(x, w, 1e-5), [randn(2, 3, 6), randn(6)]),
    "layernorm": (lambda x, w, b: ops.layernorm(x, w, b, 1e-5),
                  [randn(3, 6) * 2 + 1, randn(6), randn(6)]),
    "rope": (lambda x: ops.rope(x, *[ndl.Tensor(t, device=x.device, dtype=x.dtype,
                                                requires_grad=False) for t in ROPE]),
             [randn(2, 3, 2, 4)]),
    "silu_mul": (ops.silu_mul, [randn(3, 4) * 2, randn(3, 4)]),
    "attention": (lambda q, k, v: ops.scaled_dot_product_attention(q, k, v),
                  [randn(1, 2, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4)]),
    "attention_causal_gqa": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True, scale=0.3),
        [randn(2, 4, 3, 2), randn(2, 2, 3, 2), randn(2, 2, 3, 2)]),
    "attention_causal_decode": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True),
        [randn(1, 2, 2, 4), randn(1, 1, 5, 4), randn(1, 1, 5, 4)]),
}
ROPE = rope_tables(3, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_matches_finite_differences(device, case):
    fn, arrays = CASES[case]
    check_gradients(fn, arrays, device)


SECOND_ORDER = {
    "tanh": (ops.tanh, randn(2, 3)),
    "sigmoid": (ops.sigmoid, randn(2, 3)),
    "silu": (ops.silu, randn(2, 3) * 2),
    "gelu": (ops.gelu, randn(2, 3) * 2),
    "exp_log": (lambda x: ops.log(ops.exp(x) + 1), randn(5)),
    "power_divide": (lambda x: x ** 3 / (x * x + 1), randn(5)),
    "softmax": (ops.softmax, randn(2, 4)),
    "log_softmax": (ops.log_softmax, randn(2, 4)),
    "softmax_cross_entropy": (lambda x: ops.softmax_cross_entropy(x, ndl.Tensor(
        np.eye(4)[[2, 0]], device=x.device, dtype=x.dtype, requires_grad=False)), randn(2, 4)),
    "logsumexp": (lambda x: ops.logsumexp(x, (1,)), randn(2, 4)),
    "matmul_self": (lambda x: x @ ops.transpose(x), randn(3, 2)),
    "rmsnorm": (lambda x: ops.rmsnorm(x, ndl.Tensor(np.linspace(0.5, 1.5, 4), device=x.device,
                                                    dtype=x.dtype), 1e-5), randn(2, 4)),
    "layernorm": (lambda x: ops.layernorm(
        x, *[ndl.Tensor(t, device=x.device, dtype=x.dtype) for t in (np.linspace(.5, 1.5, 4),
                                                                    np.zeros(4))]),
        randn(2, 4)),
}


@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_second_order_gradient(device, case):
    fn, x = SECOND_ORDER[case]
    check_second_order(fn, x, device)


def test_attention_second_order(device):
    def fn(q):
        kv = ndl.Tensor(np.linspace(-1, 1, 8).reshape(1, 1, 2, 4), device=q.device, dtype=q.dtype)
        return ops.scaled_dot_product_attention(q, kv * 0.7, kv, causal=True)
    check_second_order(fn, randn(1, 2, 2, 4), device)


def test_conv_second_order(device):
    def fn(x):
        w = ndl.Tensor(np.linspace(-1, 1, 8).reshape(2, 2, 1, 2), device=x.device, dtype=x.dtype)
        return ops.conv(x * x, w, stride=2, padding=1)
    check_second_order(fn, randn(1, 3, 3, 1), device)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_backward_recomputes_in_float32(device, dtype):
    """x² of 300 overflows float16: the norm backward must not compute it in float16."""
    x = R.standard_normal((2, 8)) * 300
    w = np.linspace(0.5, 1.5, 8)
    grads = {}
    for dt in (dtype, "float32"):
        xt = ndl.Tensor(x, device=device, dtype=dt)
        wt = ndl.Tensor(w, device=device, dtype=dt)
        ops.rmsnorm(xt, wt, 1e-6).sum().backward()
        assert xt.grad.dtype == dt and wt.grad.dtype == dt
        grads[dt] = xt.grad.numpy().astype(np.float64), wt.grad.numpy().astype(np.float64)
    for half, full in zip(grads[dtype], grads["float32"]):
        np.testing.assert_allclose(half, full, rtol=0.05, atol=0.05 * np.abs(full).max())
