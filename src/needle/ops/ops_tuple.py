"""Ops between tensors and tuples of tensors: make_tuple, indexing a tuple, stack, split and
concatenate."""

from __future__ import annotations

from .. import backend_ndarray as nd
from ..autograd import Tensor, TensorOp, TensorTuple, TensorTupleOp
from ..errors import ShapeError
from .ops_shape import getitem, normalize_axes


class MakeTensorTuple(TensorTupleOp):
    def compute(self, *args):
        return tuple(args)

    def gradient(self, out_grad, node):
        return tuple(out_grad[i] for i in range(len(node.inputs)))


def make_tuple(*args):
    return MakeTensorTuple()(*args)


class TupleGetItem(TensorOp):
    def __init__(self, index: int):
        self.index = index

    def __call__(self, a: TensorTuple) -> Tensor:
        if isinstance(a.op, MakeTensorTuple):  # fold make_tuple(...)[i] to its input
            return a.inputs[self.index]
        return super().__call__(a)

    def compute(self, a):
        return a[self.index]

    def gradient(self, out_grad, node):
        parts = node.inputs[0].realize_cached_data()
        return make_tuple(*[
            out_grad if i == self.index else
            Tensor.make_const(nd.zeros(p.shape, dtype=p.dtype, device=p.device))
            for i, p in enumerate(parts)])


def tuple_get_item(a, index: int):
    return TupleGetItem(index)(a)


def _as_tuple(tensors) -> TensorTuple:
    if isinstance(tensors, TensorTuple):
        return tensors
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("needs at least one tensor")
    return make_tuple(*tensors)


class Stack(TensorOp):
    """Join tensors of one shape along a new axis."""

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, arrays):
        return nd.stack(arrays, self.axis)

    def gradient(self, out_grad, node):
        return split(out_grad, self.axis)


def stack(tensors, axis: int = 0):
    return Stack(axis)(_as_tuple(tensors))


class Split(TensorTupleOp):
    """The slices of a tensor along ``axis`` (that axis removed): the inverse of Stack."""

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, a):
        (axis,) = normalize_axes(self.axis, a.ndim)
        return tuple(a[(slice(None),) * axis + (i,)] for i in range(a.shape[axis]))

    def gradient(self, out_grad, node):
        return stack(out_grad, self.axis)


def split(a, axis: int = 0):
    return Split(axis)(a)


class Concatenate(TensorOp):
    """Join tensors along an existing axis; the gradient is the matching slices."""

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, arrays):
        return nd.concatenate(arrays, self.axis)

    def gradient(self, out_grad, node):
        axis = self.axis % out_grad.ndim
        parts, start = [], 0
        for p in node.inputs[0].realize_cached_data():
            parts.append(getitem(out_grad, (slice(None),) * axis
                                 + (slice(start, start + p.shape[axis]),)))
            start += p.shape[axis]
        return make_tuple(*parts)


def concatenate(tensors, axis: int = 0):
    return Concatenate(axis)(_as_tuple(tensors))
