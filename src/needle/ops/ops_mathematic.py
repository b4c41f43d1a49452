"""Elementwise arithmetic, activation functions and matrix multiplication.

Binary ops broadcast and promote like NDArray; the autograd engine sums and casts each
partial gradient back to its input's shape and dtype (``match_input``). Gradients are
written with Tensor operators so that they are differentiable again.
"""

from __future__ import annotations

import math

from .. import backend_ndarray as nd
from ..amp import low_precision_inputs
from ..autograd import Tensor, TensorOp
from .ops_shape import reshape, sum_to_shape, transpose


class EWiseAdd(TensorOp):
    def compute(self, a, b):
        return a + b

    def gradient(self, out_grad, node):
        return out_grad, out_grad


def add(a, b):
    return EWiseAdd()(a, b)


class AddScalar(TensorOp):
    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a + self.scalar

    def gradient(self, out_grad, node):
        return out_grad


def add_scalar(a, scalar):
    return AddScalar(scalar)(a)


class EWiseMul(TensorOp):
    def compute(self, a, b):
        return a * b

    def gradient(self, out_grad, node):
        a, b = node.inputs  # a mask or other constant factor takes no gradient
        return (out_grad * b if a.requires_grad else None,
                out_grad * a if b.requires_grad else None)


def multiply(a, b):
    return EWiseMul()(a, b)


class EWiseSub(TensorOp):
    """a - b in one kernel (not a + (-b), which takes two)."""

    def compute(self, a, b):
        return a - b

    def gradient(self, out_grad, node):
        return out_grad, (-out_grad if node.inputs[1].requires_grad else None)


def subtract(a, b):
    return EWiseSub()(a, b)


class MulScalar(TensorOp):
    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a * self.scalar

    def gradient(self, out_grad, node):
        return out_grad * self.scalar


def mul_scalar(a, scalar):
    return MulScalar(scalar)(a)


class EWiseDiv(TensorOp):
    def compute(self, a, b):
        return a / b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return (out_grad / b if a.requires_grad else None,
                -(out_grad * node) / b if b.requires_grad else None)


def divide(a, b):
    return EWiseDiv()(a, b)


class DivScalar(TensorOp):
    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a / self.scalar

    def gradient(self, out_grad, node):
        return out_grad / self.scalar


def divide_scalar(a, scalar):
    return DivScalar(scalar)(a)


class EWisePow(TensorOp):
    """a ** b elementwise; the gradient for b is a ** b · log(a) (NaN where a < 0)."""

    def compute(self, a, b):
        return a ** b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return out_grad * b * a ** (b - 1), out_grad * node * log(a)


def power(a, b):
    return EWisePow()(a, b)


class PowerScalar(TensorOp):
    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a ** self.scalar

    def gradient(self, out_grad, node):
        if self.scalar == 0:
            return out_grad * 0
        return out_grad * self.scalar * node.inputs[0] ** (self.scalar - 1)


def power_scalar(a, scalar):
    return PowerScalar(scalar)(a)


class Negate(TensorOp):
    def compute(self, a):
        return -a

    def gradient(self, out_grad, node):
        return -out_grad


def negate(a):
    return Negate()(a)


class Log(TensorOp):
    def compute(self, a):
        return a.log()

    def gradient(self, out_grad, node):
        return out_grad / node.inputs[0]


def log(a):
    return Log()(a)


class Exp(TensorOp):
    def compute(self, a):
        return a.exp()

    def gradient(self, out_grad, node):
        return out_grad * node


def exp(a):
    return Exp()(a)


class Sqrt(TensorOp):
    def compute(self, a):
        return a.sqrt()

    def gradient(self, out_grad, node):
        return out_grad * 0.5 / node


def sqrt(a):
    return Sqrt()(a)


class ReLU(TensorOp):
    """max(x, 0); the gradient at 0 is 0 (as in PyTorch)."""

    def compute(self, a):
        return a.relu()

    def gradient(self, out_grad, node):
        return out_grad * Tensor.make_const(node.inputs[0].realize_cached_data() > 0)


def relu(a):
    return ReLU()(a)


class Tanh(TensorOp):
    def compute(self, a):
        return a.tanh()

    def gradient(self, out_grad, node):
        return out_grad * (1 - node * node)


def tanh(a):
    return Tanh()(a)


class Sigmoid(TensorOp):
    def compute(self, a):
        return a.sigmoid()

    def gradient(self, out_grad, node):
        return out_grad * node * (1 - node)


def sigmoid(a):
    return Sigmoid()(a)


class SiLU(TensorOp):
    """x · sigmoid(x) (swish)."""

    def compute(self, a):
        return a.silu()

    def gradient(self, out_grad, node):
        return out_grad * silu_derivative(node.inputs[0])


def silu(a):
    return SiLU()(a)


def silu_derivative(x: Tensor) -> Tensor:
    """d silu / dx = s · (1 + x · (1 - s)) with s = sigmoid(x)."""
    s = sigmoid(x)
    return s * (1 + x * (1 - s))


class GELU(TensorOp):
    """x · Φ(x) with Φ the standard normal CDF (the exact erf form, as torch.nn.GELU())."""

    def compute(self, a):
        return a.gelu()

    def gradient(self, out_grad, node):
        return out_grad * gelu_derivative(node.inputs[0])


def gelu(a):
    return GELU()(a)


_SMALL = 1e-3  # below this |x|, Φ(x) = 0.5 + x φ(0) is off by less than 1e-10


def gelu_derivative(x: Tensor) -> Tensor:
    """Φ(x) + x φ(x). There is no erf in the array API, so Φ(x) is gelu(x) / x, except near 0
    where that division loses precision and its first-order expansion is exact enough.
    The denominator is made safe first so that no NaN reaches higher-order gradients."""
    data = x.realize_cached_data()
    small = Tensor.make_const(abs(data) < _SMALL)
    safe_x = where(small, 1.0, x)
    cdf = where(small, 0.5 + x / math.sqrt(2 * math.pi), gelu(safe_x) / safe_x)
    pdf = exp(x * x * -0.5) / math.sqrt(2 * math.pi)
    return cdf + x * pdf


class Maximum(TensorOp):
    """Elementwise max of two tensors; at ties the gradient goes to the first."""

    def compute(self, a, b):
        return a.maximum(b)

    def gradient(self, out_grad, node):
        a, b = node.inputs
        a_data, b_data = a.realize_cached_data(), b.realize_cached_data()
        a_wins, b_wins = Tensor.make_const(a_data >= b_data), Tensor.make_const(b_data > a_data)
        return out_grad * a_wins, out_grad * b_wins


class MaximumScalar(TensorOp):
    """max(x, scalar); at ties the gradient goes to x."""

    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a.maximum(self.scalar)

    def gradient(self, out_grad, node):
        return out_grad * Tensor.make_const(node.inputs[0].realize_cached_data() >= self.scalar)


def maximum(a, b):
    if isinstance(b, Tensor):
        return Maximum()(a, b)
    return MaximumScalar(b)(a)


class Where(TensorOp):
    """``a`` where ``cond`` is true, else ``b``; cond gets no gradient."""

    def compute(self, cond, a, b):
        return nd.where(cond, a, b)

    def gradient(self, out_grad, node):
        cond = node.inputs[0]
        zero = Tensor.make_const(nd.zeros((), dtype=out_grad.dtype, device=out_grad.device))
        return None, where(cond, out_grad, zero), where(cond, zero, out_grad)


def where(cond, a, b):
    """Select from ``a`` or ``b`` (tensors or scalars, all broadcast together) by ``cond``."""
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    device = like.device if like is not None else getattr(cond, "device", None)
    if not isinstance(cond, Tensor):
        cond = Tensor(cond, device=device, dtype="bool", requires_grad=False)

    def as_tensor(v):
        if isinstance(v, Tensor):
            return v
        dtype = like.dtype if like is not None else "float32"
        return Tensor.make_const(nd.full((), v, dtype=dtype, device=cond.device))

    return Where()(cond, as_tensor(a), as_tensor(b))


class MatMul(TensorOp):
    """Matrix product with numpy semantics: 1-d operands, batched and broadcast batches."""

    def compute(self, a, b):
        return a @ b

    def gradient(self, out_grad, node):
        # Each partial is a matmul as large as the forward one: skip those of inputs that
        # take no gradient (the input batch of a first layer).
        a, b = node.inputs
        if a.ndim == 2 and b.ndim == 2:  # x @ W: transposed operands are views, no copies
            return (out_grad @ transpose(b) if a.requires_grad else None,
                    transpose(a) @ out_grad if b.requires_grad else None)
        a2 = a if a.ndim > 1 else reshape(a, (1, a.shape[0]))
        b2 = b if b.ndim > 1 else reshape(b, (b.shape[0], 1))
        (m, n), p = a2.shape[-2:], b2.shape[-1]
        batch = nd.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        g = reshape(out_grad, batch + (m, p))
        grad_a = grad_b = None
        if a.requires_grad:
            grad_a = reshape(sum_to_shape(g @ transpose(b2), a2.shape), a.shape)
        if b.requires_grad and b2.ndim == 2 and g.ndim > 2:
            # x @ W: one (n, batch*m) @ (batch*m, p) product
            grad_b = reshape(transpose(reshape(a2, (-1, n))) @ reshape(g, (-1, p)), b.shape)
        elif b.requires_grad:
            grad_b = reshape(sum_to_shape(transpose(a2) @ g, b2.shape), b.shape)
        return grad_a, grad_b


def matmul(a, b):
    a, b = low_precision_inputs(a, b)  # autocast (amp.py)
    return MatMul()(a, b)
