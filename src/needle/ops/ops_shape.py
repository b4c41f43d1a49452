"""Ops that move, reduce or convert elements: reshape, transpose, broadcast, reductions,
indexing, dtype casts and device copies.

Most forward passes here are views of the input (no copy); their gradients are the inverse
movement, and a broadcast's gradient is a sum.
"""

from __future__ import annotations

import numbers
from math import prod

from .. import backend_ndarray as nd
from .. import checks
from ..amp import float32_inputs
from ..autograd import Tensor, TensorOp
from ..errors import ArgumentTypeError, AxisError, ShapeError


def normalize_axes(axes, ndim: int) -> tuple[int, ...]:
    """``axes`` (None, an int or a sequence) as sorted non-negative ints, checked."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, numbers.Integral):
        axes = (axes,)
    out = []
    try:
        axes = tuple(axes)
    except TypeError:
        raise AxisError(f"axes must be an int or a sequence of ints, got {axes!r}") from None
    for a in axes:
        if not isinstance(a, numbers.Integral) or not -ndim <= a < ndim:
            raise AxisError(f"axis {a!r} is out of range for a tensor of {ndim} dimensions")
        out.append(int(a) % ndim)
    return tuple(sorted(out))


def sum_to_shape(grad: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum ``grad`` over the axes along which ``shape`` was broadcast to ``grad.shape``."""
    lead = grad.ndim - len(shape)
    if lead < 0 or any(d not in (1, g) for d, g in zip(shape, grad.shape[lead:])):
        raise ShapeError(f"gradient of shape {grad.shape} does not fit an input of shape {shape}")
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and grad.shape[lead + i] != 1)
    if axes:
        grad = summation(grad, axes)
    return reshape(grad, shape) if grad.shape != shape else grad


def match_input(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` with the shape and dtype of the input ``like`` it is the gradient of.

    Binary ops broadcast and promote their inputs, so a partial gradient can be larger than
    its input or of a wider dtype; the autograd engine calls this for every partial.
    """
    if grad.shape != like.shape:
        grad = sum_to_shape(grad, like.shape)
    if grad.dtype != like.dtype:
        grad = cast(grad, like.dtype)
    return grad


class Reshape(TensorOp):
    def __init__(self, shape):
        self.shape = checks.int_tuple(shape, "shape", "ops.reshape")

    def compute(self, a):
        return a.reshape(self.shape)

    def gradient(self, out_grad, node):
        return reshape(out_grad, node.inputs[0].shape)


def reshape(a, shape):
    return Reshape(shape)(a)


class Permute(TensorOp):
    def __init__(self, axes):
        self.axes = tuple(axes)

    def compute(self, a):
        return a.permute(self.axes)

    def gradient(self, out_grad, node):
        axes = [a % len(self.axes) for a in self.axes]
        return permute(out_grad, tuple(axes.index(i) for i in range(len(axes))))


def permute(a, axes):
    return Permute(axes)(a)


class Transpose(TensorOp):
    """Swap two axes (needle's transpose): the last two unless ``axes`` names others."""

    def __init__(self, axes: tuple[int, int] | None = None):
        try:
            self.axes = (-2, -1) if axes is None else tuple(axes)
        except TypeError:
            self.axes = ()
        if not all(isinstance(a, numbers.Integral) for a in self.axes):
            raise AxisError(f"transpose swaps two axes, given as a pair of ints (default the "
                            f"last two), got {axes!r}")
        if len(self.axes) != 2:
            raise ShapeError(f"transpose swaps two axes, got {axes!r}; use permute for more")

    def compute(self, a):
        return a.swapaxes(*self.axes)

    def gradient(self, out_grad, node):
        return transpose(out_grad, self.axes)


def transpose(a, axes=None):
    return Transpose(axes)(a)


class BroadcastTo(TensorOp):
    def __init__(self, shape):
        self.shape = checks.int_tuple(shape, "shape", "ops.broadcast_to")

    def compute(self, a):
        return a.broadcast_to(self.shape)

    def gradient(self, out_grad, node):
        return sum_to_shape(out_grad, node.inputs[0].shape)


def broadcast_to(a, shape):
    return BroadcastTo(shape)(a)


def kept_shape(shape, axes) -> tuple[int, ...]:
    """``shape`` with the reduced ``axes`` kept as 1 (what keepdims=True gives)."""
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


class Summation(TensorOp):
    def __init__(self, axes=None, keepdims: bool = False):
        self.axes, self.keepdims = axes, keepdims

    def compute(self, a):
        return a.sum(axis=self.axes, keepdims=self.keepdims)

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        kept = kept_shape(shape, normalize_axes(self.axes, len(shape)))
        return broadcast_to(reshape(out_grad, kept), shape)


def summation(a, axes=None, keepdims: bool = False):
    (a,) = float32_inputs(a)  # autocast (amp.py)
    return Summation(axes, keepdims)(a)


def mean(a, axes=None, keepdims: bool = False):
    count = prod(a.shape[i] for i in normalize_axes(axes, a.ndim))
    # the mean of nothing is NaN, as in numpy and PyTorch
    return summation(a, axes, keepdims) / count if count else summation(a, axes, keepdims) * \
        float("nan")


class Max(TensorOp):
    """Maximum over ``axes``. The gradient is split evenly between tied maxima (as
    ``torch.amax``), so it is a valid subgradient whatever the ties."""

    def __init__(self, axes=None, keepdims: bool = False):
        self.axes, self.keepdims = axes, keepdims

    def compute(self, a):
        return a.max(axis=self.axes, keepdims=self.keepdims)

    def gradient(self, out_grad, node):
        x = node.inputs[0].realize_cached_data()
        kept = kept_shape(x.shape, normalize_axes(self.axes, x.ndim))
        is_max = x == node.realize_cached_data().reshape(kept).broadcast_to(x.shape)
        ties = is_max.sum(axis=self.axes, keepdims=True)
        share = is_max.astype(x.dtype) / ties.astype(x.dtype)
        return broadcast_to(reshape(out_grad, kept), x.shape) * Tensor.make_const(share)


def max(a, axes=None, keepdims: bool = False):  # noqa: A001
    return Max(axes, keepdims)(a)


class GetItem(TensorOp):
    """Basic indexing (ints, slices, None, ...): a view of the input."""

    def __init__(self, index):
        self.index = index

    def compute(self, a):
        return a[self.index]

    def gradient(self, out_grad, node):
        return SetItemIntoZeros(self.index, node.inputs[0].shape)(out_grad)


def getitem(a, index):
    return GetItem(index)(a)


class SetItemIntoZeros(TensorOp):
    """Zeros of ``shape`` with ``a`` written at ``index``: the gradient of indexing."""

    def __init__(self, index, shape):
        self.index, self.shape = index, tuple(shape)

    def compute(self, a):
        out = nd.zeros(self.shape, dtype=a.dtype, device=a.device)
        out[self.index] = a
        return out

    def gradient(self, out_grad, node):
        return getitem(out_grad, self.index)


class Pad(TensorOp):
    """Zero padding: ``axes`` gives (before, after) for every dimension."""

    def __init__(self, axes):
        try:
            self.axes = tuple(tuple(p) for p in axes)
        except TypeError:
            raise ArgumentTypeError("ops.pad: axes must give a (before, after) pair for every "
                                    f"dimension, e.g. ((0, 0), (1, 1)), got {axes!r}") from None

    def compute(self, a):
        return a.pad(self.axes)

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        return getitem(out_grad, tuple(slice(lo, lo + d) for (lo, _), d in zip(self.axes, shape)))


def pad(a, axes):
    return Pad(axes)(a)


class Flip(TensorOp):
    def __init__(self, axes=None):
        self.axes = axes

    def compute(self, a):
        return a.flip(self.axes)

    def gradient(self, out_grad, node):
        return flip(out_grad, self.axes)


def flip(a, axes=None):
    return Flip(axes)(a)


def _dilated_index(ndim: int, axes, dilation: int) -> tuple[slice, ...]:
    axes = normalize_axes(axes, ndim)
    return tuple(slice(None, None, dilation + 1) if i in axes else slice(None)
                 for i in range(ndim))


class Dilate(TensorOp):
    """Insert ``dilation`` zeros after every element along ``axes`` (each size grows by a
    factor ``dilation + 1``, as in needle)."""

    def __init__(self, axes, dilation: int):
        dilation = checks.integer(dilation, "dilation", "ops.dilate", 0)
        self.axes, self.dilation = axes, dilation

    def compute(self, a):
        axes = normalize_axes(self.axes, a.ndim)
        shape = tuple(d * (self.dilation + 1) if i in axes else d for i, d in enumerate(a.shape))
        out = nd.zeros(shape, dtype=a.dtype, device=a.device)
        out[_dilated_index(a.ndim, axes, self.dilation)] = a
        return out

    def gradient(self, out_grad, node):
        return undilate(out_grad, self.axes, self.dilation)


def dilate(a, axes, dilation: int):
    return Dilate(axes, dilation)(a)


class UnDilate(TensorOp):
    """Keep every ``dilation + 1``-th element along ``axes``: the inverse of Dilate."""

    def __init__(self, axes, dilation: int):
        dilation = checks.integer(dilation, "dilation", "ops.dilate", 0)
        self.axes, self.dilation = axes, dilation

    def compute(self, a):
        return a[_dilated_index(a.ndim, self.axes, self.dilation)]

    def gradient(self, out_grad, node):
        index = _dilated_index(out_grad.ndim, self.axes, self.dilation)
        return SetItemIntoZeros(index, node.inputs[0].shape)(out_grad)


def undilate(a, axes, dilation: int):
    return UnDilate(axes, dilation)(a)


class Cast(TensorOp):
    """Convert to another dtype; the gradient converts back."""

    def __init__(self, dtype):
        self.dtype = dtype

    def compute(self, a):
        return a.astype(self.dtype)

    def gradient(self, out_grad, node):
        return cast(out_grad, node.inputs[0].dtype)


def cast(a, dtype):
    return Cast(dtype)(a)


class Clone(TensorOp):
    """A compact copy with its own storage; the gradient passes through (``Tensor.clone``)."""

    def compute(self, a):
        return a.copy()

    def gradient(self, out_grad, node):
        return out_grad


def clone(a):
    return Clone()(a)


class ToDevice(TensorOp):
    """Copy to another device; the gradient goes back to the input's device."""

    def __init__(self, device):
        self.device = device

    def compute(self, a):
        return a.to(self.device)

    def gradient(self, out_grad, node):
        return to_device(out_grad, node.inputs[0].device)


def to_device(a, device):
    return ToDevice(device)(a)
