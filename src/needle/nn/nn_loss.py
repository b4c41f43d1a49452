"""Losses under PyTorch's names: ``CrossEntropyLoss`` and ``MSELoss``."""

from __future__ import annotations

from .. import init, ops
from ..autograd import Tensor
from ..errors import ArgumentError, ShapeError
from .nn_basic import Module, SoftmaxLoss, _check_labels, _label_poison

_REDUCTIONS = ("mean", "sum", "none")


def _reduction(value: str, owner: str) -> str:
    if value not in _REDUCTIONS:
        raise ArgumentError(f"{owner}: reduction must be one of {', '.join(_REDUCTIONS)}, "
                            f"got {value!r}")
    return value


class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits (N, C) against integer class ids (N,), as PyTorch's;
    "none" gives one loss per sample. Extra axes go before the classes axis (needle's
    (..., C) layout, where PyTorch puts C second)."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _reduction(reduction, "nn.CrossEntropyLoss")

    def forward(self, logits: Tensor, target) -> Tensor:
        if not isinstance(target, Tensor):
            target = Tensor(target, device=logits.device, requires_grad=False)
        if self.reduction == "mean":
            return SoftmaxLoss()(logits, target)
        classes, last = logits.shape[-1], logits.ndim - 1
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ShapeError(f"nn.CrossEntropyLoss: target of shape {tuple(target.shape)} does "
                             f"not match logits of shape {logits.shape}")
        on_device = _check_labels(target, classes)
        hot = init.one_hot(classes, target, device=logits.device, dtype=logits.dtype)
        losses = ops.logsumexp(logits, axes=(last,)) - ops.summation(logits * hot, axes=(last,))
        if on_device:  # NaN for each out-of-range label's loss
            losses = losses + _label_poison(hot, per_label=True)
        return losses if self.reduction == "none" else ops.summation(losses)


class MSELoss(Module):
    """Mean (or sum, or per-element) squared difference between input and target."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _reduction(reduction, "nn.MSELoss")

    def forward(self, input: Tensor, target) -> Tensor:  # noqa: A002 (PyTorch's name)
        target = input._other(target) if not isinstance(target, Tensor) else target
        if tuple(input.shape) != tuple(target.shape):
            raise ShapeError(f"nn.MSELoss: input {input.shape} and target {target.shape} "
                             "differ in shape")
        diff = input - target
        squared = diff * diff
        if self.reduction == "none":
            return squared
        return ops.mean(squared) if self.reduction == "mean" else ops.summation(squared)
