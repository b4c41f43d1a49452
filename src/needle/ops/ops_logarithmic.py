"""Log-domain reductions: logsumexp, softmax, log_softmax and the softmax cross-entropy,
computed stably."""

from __future__ import annotations

from .. import backend_ndarray as nd
from ..amp import float32_inputs
from ..autograd import TensorOp
from ..errors import ShapeError
from .ops_mathematic import exp
from .ops_shape import broadcast_to, kept_shape, normalize_axes, reshape, summation


class LogSumExp(TensorOp):
    """log(sum(exp(x))) over ``axes``, shifted by the maximum so that nothing overflows."""

    def __init__(self, axes=None, keepdims: bool = False):
        self.axes, self.keepdims = axes, keepdims

    def compute(self, a):
        shift = a.max(axis=self.axes, keepdims=True)
        # rows whose max is ±inf or NaN are shifted by 0 (x - x is 0 only for finite x)
        shift = nd.where((shift - shift) == 0, shift, 0)
        out = (a - shift.broadcast_to(a.shape)).exp().sum(axis=self.axes, keepdims=True).log()
        out = out + shift
        if not self.keepdims:
            out = out.reshape(tuple(d for i, d in enumerate(a.shape)
                                    if i not in normalize_axes(self.axes, a.ndim)))
        return out

    def gradient(self, out_grad, node):
        x = node.inputs[0]
        kept = kept_shape(x.shape, normalize_axes(self.axes, x.ndim))
        lse = broadcast_to(reshape(node, kept), x.shape)
        return broadcast_to(reshape(out_grad, kept), x.shape) * exp(x - lse)


def logsumexp(a, axes=None, keepdims: bool = False):
    (a,) = float32_inputs(a)  # autocast (amp.py)
    return LogSumExp(axes, keepdims)(a)


class LogSoftmax(TensorOp):
    """log(softmax(x)) over the last axis."""

    def compute(self, a):
        return a.log_softmax()

    def gradient(self, out_grad, node):
        total = broadcast_to(summation(out_grad, -1, keepdims=True), out_grad.shape)
        return out_grad - exp(node) * total


def log_softmax(a):
    (a,) = float32_inputs(a)
    return LogSoftmax()(a)


logsoftmax = log_softmax  # the needle course's name (hw2: over the classes of (batch, classes))


class Softmax(TensorOp):
    """exp(x) / sum(exp(x)) over the last axis."""

    def compute(self, a):
        return a.softmax()

    def gradient(self, out_grad, node):
        dot = broadcast_to(summation(out_grad * node, -1, keepdims=True), node.shape)
        return node * (out_grad - dot)


def softmax(a):
    (a,) = float32_inputs(a)
    return Softmax()(a)


class SoftmaxCrossEntropy(TensorOp):
    """Mean over rows of the cross-entropy ``-sum(target * log_softmax(logits))`` of
    (rows, classes) logits against targets of the same shape whose rows are probability
    distributions (one-hot labels, smoothed labels): a 0-d result.

    One op instead of the five of its formula, for its gradient: ``softmax(logits) -
    target`` (scaled), where the chain back through the mean, the sum, the product and
    log_softmax takes about ten kernels and copies two broadcasts on the way.
    """

    def compute(self, logits, target):
        if logits.ndim != 2 or target.shape != logits.shape:
            raise ShapeError(f"softmax_cross_entropy needs (rows, classes) logits and a target of "
                             f"the same shape (probabilities, e.g. one-hot labels), got logits "
                             f"{logits.shape} and target {target.shape}; for integer labels "
                             "use nn.SoftmaxLoss")
        # x / -rows is -(x / rows) exactly: the loss the unfused formula gives, bit for bit
        return (logits.log_softmax() * target).sum() / -logits.shape[0]

    def gradient(self, out_grad, node):
        logits, target = node.inputs
        scale = reshape(out_grad / logits.shape[0], (1, 1))  # broadcast by the products
        grad_logits = (softmax(logits) - target) * scale if logits.requires_grad else None
        grad_target = log_softmax(logits) * -scale if target.requires_grad else None
        return grad_logits, grad_target


def softmax_cross_entropy(logits, target):
    logits, target = float32_inputs(logits, target)
    return SoftmaxCrossEntropy()(logits, target)
