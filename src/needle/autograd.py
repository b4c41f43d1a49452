"""Reverse-mode automatic differentiation over NDArrays: the graph's nodes (Value, Tensor,
TensorTuple, the Op classes). The per-thread grad switch is in ``grad_mode.py``, the backward
walk and ``grad()`` in ``backprop.py``; both are re-exported here under their course names.

A ``Tensor`` is a node of a computation graph: either a leaf holding data, or the output of
a ``TensorOp`` applied to input tensors. Ops compute on NDArrays (``compute``) and say how
to differentiate themselves in terms of other ops (``gradient``), so the gradient of a
gradient is again a graph and higher-order derivatives work.

``Tensor.backward`` walks the graph once in reverse topological order, summing the partial
gradients each node receives from its uses, and adds the result into ``.grad`` of every leaf
that requires a gradient. Gradients accumulate over repeated uses and over backward calls;
``.grad = None`` (what optimizers' ``zero_grad`` does) starts afresh.

What gets recorded:

* grad mode: inside ``no_grad()`` ops record no graph and their results do not require
  grad. The switch is per thread, as in PyTorch: a thread generating under ``no_grad`` does
  not stop another thread from recording, and every new thread starts with grad enabled.
* ``create_graph`` (an argument of ``backward`` and ``grad``): by default the backward pass
  itself runs under ``no_grad`` so that stored gradients do not keep the forward graph
  alive; pass ``create_graph=True`` to differentiate the gradients again.
* ``LAZY_MODE`` (module global, as in the needle course, which sets
  ``autograd.LAZY_MODE = True``): when true, ops build the graph without computing; data is
  computed when first asked for (``realize_cached_data``). It is a debugging switch, read
  once per op, and is left process-wide so that the course's assignment keeps working.
"""

from __future__ import annotations

import numbers
import threading

import numpy as np

from . import backend_ndarray as nd
from .backend_ndarray import dtypes
from .backend_ndarray.device import Device, as_device, default_device
from .errors import ArgumentTypeError, GradientError, ShapeError
from .grad_mode import (  # noqa: F401 (re-exported: autograd.no_grad is the course's name)
    _grad_mode,
    _state,
    enable_grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from .tensor_methods import MaxResult, TensorMethods, axes_and_keepdims

LAZY_MODE = False
TENSOR_COUNTER = 0  # graph nodes alive now (the course's live counter; read it, never set it)
_counter_lock = threading.RLock()  # re-entrant: a __del__ may run while the lock is held


class Op:
    """An operator: ``compute`` on NDArrays, ``gradient`` in terms of other ops."""

    def compute(self, *args: nd.NDArray):
        """The op's value from its inputs' NDArrays."""
        raise NotImplementedError

    def gradient(self, out_grad: Value, node: Value):
        """Partial adjoints for each input given the adjoint ``out_grad`` of ``node``.

        Returns one Tensor (single input) or a tuple with one entry per input; an entry is
        None for an input that is not differentiable (indices, masks, constants).
        """
        raise NotImplementedError

    def gradient_as_tuple(self, out_grad: Value, node: Value) -> tuple:
        grads = self.gradient(out_grad, node)
        return tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)


class Value:
    """A node of the graph: an op and its inputs, or a leaf; ``cached_data`` its value."""

    op: Op | None
    inputs: list[Value]
    cached_data: object
    requires_grad: bool

    def _init(self, op: Op | None, inputs: list[Value], *, cached_data=None,
              requires_grad: bool | None = None) -> None:
        global TENSOR_COUNTER
        if requires_grad is None:
            requires_grad = _state.grad_enabled and any(x.requires_grad for x in inputs)
        with _counter_lock:
            TENSOR_COUNTER += 1
        self.op = op
        self.inputs = inputs
        self.cached_data = cached_data
        self.requires_grad = requires_grad

    def __del__(self) -> None:
        global TENSOR_COUNTER
        if hasattr(self, "op"):  # counted only once _init ran
            with _counter_lock:
                TENSOR_COUNTER -= 1

    def realize_cached_data(self):
        """The node's value, computing it (and its inputs') on first use."""
        if self.cached_data is None:
            self.cached_data = self.op.compute(*[x.realize_cached_data() for x in self.inputs])
        return self.cached_data

    def is_leaf(self) -> bool:
        return self.op is None

    @classmethod
    def make_const(cls, data, requires_grad: bool = False):
        value = cls.__new__(cls)
        value._init(None, [], cached_data=data, requires_grad=requires_grad)
        return value

    @classmethod
    def make_from_op(cls, op: Op, inputs: list[Value]):
        value = cls.__new__(cls)
        value._init(op, inputs)
        if not LAZY_MODE:
            value.realize_cached_data()
            if not value.requires_grad:  # a constant: forget the inputs (a leaf, as detach())
                value.op, value.inputs = None, []
        return value


class TensorTuple(Value):
    """A tuple of tensors as one graph node (the output of ``split``, the input of ``stack``)."""

    def __len__(self) -> int:
        return len(self.realize_cached_data())

    def __getitem__(self, index: int) -> Tensor:
        return ops.tuple_get_item(self, index)

    def tuple(self) -> tuple[Tensor, ...]:
        return tuple(self[i] for i in range(len(self)))

    def __iter__(self):
        return iter(self.tuple())

    def __add__(self, other: TensorTuple) -> TensorTuple:
        if len(self) != len(other):
            raise ShapeError(f"cannot add tuples of {len(self)} and {len(other)} tensors")
        return ops.make_tuple(*[a + b for a, b in zip(self, other)])

    def detach(self) -> TensorTuple:
        return TensorTuple.make_const(self.realize_cached_data())

    def __repr__(self) -> str:
        return f"needle.TensorTuple({self.realize_cached_data()!r})"


class TensorOp(Op):
    """An op whose output is a Tensor."""

    def __call__(self, *args) -> Tensor:
        return Tensor.make_from_op(self, _inputs(self, args))


class TensorTupleOp(Op):
    """An op whose output is a TensorTuple."""

    def __call__(self, *args) -> TensorTuple:
        return TensorTuple.make_from_op(self, _inputs(self, args))


def _inputs(op: Op, args: tuple) -> list[Value]:
    """The op's inputs, which must be graph values: a number or a list here would otherwise
    fail deep inside with an AttributeError."""
    for i, x in enumerate(args):
        if not isinstance(x, Value):
            raise ArgumentTypeError(f"{type(op).__name__}: input {i} must be a Tensor, got "
                                    f"{type(x).__name__}; wrap it in ndl.Tensor(...)")
    return list(args)


def _to_ndarray(data, device: Device | str | None, dtype) -> nd.NDArray:
    """``data`` as an NDArray on ``device`` with ``dtype``, copying only when they differ."""
    device = as_device(device)
    if isinstance(data, nd.NDArray):
        same_device = device is None or device == data.device
        if same_device and (dtype is None or dtypes.canonical(dtype) == data.dtype):
            return data
        return nd.NDArray(data, device=device or data.device, dtype=dtype)
    return nd.NDArray(data, device=device or default_device(), dtype=dtype)


class Tensor(Value, TensorMethods):
    """An n-dimensional array that records the operations applied to it.

    ``data`` may be a Tensor, NDArray, numpy array, nested list or scalar. Floats default
    to float32 and integers keep an integer dtype; only floating-point tensors can require
    a gradient (``requires_grad`` is ignored for others).
    """

    grad: Tensor | None = None  # the accumulated gradient of a leaf (None until backward)

    def __init__(self, data, device: Device | str | None = None, dtype=None,
                 requires_grad: bool = True):
        if isinstance(data, Tensor):
            data = data.realize_cached_data()
        array = _to_ndarray(data, device, dtype)
        self._init(None, [], cached_data=array,
                   requires_grad=requires_grad and dtypes.is_floating(array.dtype))

    def realize_cached_data(self) -> nd.NDArray:
        data = self.cached_data
        if data is None:  # computed once: the check below runs then, not on every read
            data = super().realize_cached_data()
            if self.requires_grad and self.op is not None and not dtypes.is_floating(data.dtype):
                self.requires_grad = False  # integer and bool results carry no gradient
        return data

    # --- data and metadata -------------------------------------------------------------
    @property
    def data(self) -> Tensor:
        """The same values, outside the graph."""
        return self.detach()

    @data.setter
    def data(self, value) -> None:
        """Replace the storage (possibly on another device or of another dtype: this is how
        ``Module.to`` moves parameters and optimizers update them)."""
        self.cached_data = (value.realize_cached_data() if isinstance(value, Tensor)
                            else _to_ndarray(value, None, None))

    def detach(self) -> Tensor:
        return Tensor.make_const(self.realize_cached_data())

    shape = property(lambda self: self.realize_cached_data().shape)
    dtype = property(lambda self: self.realize_cached_data().dtype)
    device = property(lambda self: self.realize_cached_data().device)
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: self.realize_cached_data().size)

    def __len__(self) -> int:
        return len(self.realize_cached_data())

    def numpy(self) -> np.ndarray:
        return self.realize_cached_data().numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.realize_cached_data().__array__(dtype)

    def item(self):
        return self.realize_cached_data().item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __repr__(self) -> str:
        flag = ", requires_grad=True" if self.requires_grad else ""
        return (f"needle.Tensor({self.numpy()!r}, device={self.device!r}, "
                f"dtype={self.dtype}{flag})")

    def __str__(self) -> str:
        return str(self.numpy())

    __hash__ = object.__hash__  # identity, so tensors can key dicts despite elementwise ==
    __array_ufunc__ = None  # numpy defers to Tensor's reflected operators (ndarray + Tensor)

    def to(self, device: Device | str) -> Tensor:
        """This tensor on ``device`` (differentiable; the same tensor when already there)."""
        device = as_device(device)
        return self if device == self.device else ops.to_device(self, device)

    def astype(self, dtype) -> Tensor:
        return self if dtypes.canonical(dtype) == self.dtype else ops.cast(self, dtype)

    # --- backward ------------------------------------------------------------------------
    def backward(self, out_grad: Tensor | None = None, create_graph: bool = False) -> None:
        """Add d(self)/d(leaf) · out_grad into ``leaf.grad`` for every leaf requiring grad.

        ``out_grad`` defaults to ones of this tensor's shape (so a scalar loss needs none).
        """
        if not self.requires_grad:
            raise GradientError("backward() called on a tensor that does not require grad: "
                                "no input of its graph has requires_grad=True (or it was "
                                "computed under no_grad())")
        if out_grad is None:
            out_grad = Tensor(nd.ones(self.shape, dtype=self.dtype, device=self.device),
                              requires_grad=False)
        out_grad = self._other(out_grad)
        if out_grad.shape != self.shape:
            raise ShapeError(f"backward: out_grad has shape {out_grad.shape}, the tensor "
                             f"{self.shape}")
        for leaf, g in _backward_pass(self, out_grad, create_graph):
            if leaf.grad is None:
                leaf.grad = g if create_graph else g.detach()
            else:
                with _grad_mode(create_graph):
                    leaf.grad = leaf.grad + g

    # --- operators -----------------------------------------------------------------------
    def _other(self, other) -> Tensor:
        """The other operand as a tensor on this device: numpy arrays keep their dtype,
        Python lists take this tensor's dtype within their kind (as scalars do)."""
        if isinstance(other, Tensor):
            return other
        if not isinstance(other, (numbers.Number, np.generic, np.ndarray, nd.NDArray, list,
                                  tuple)):
            raise ArgumentTypeError(f"the other operand must be a Tensor, a number or an array, "
                                    f"got {type(other).__name__}")
        if isinstance(other, (list, tuple, np.ndarray)):
            other = self.realize_cached_data()._operand(other, isinstance(other, np.ndarray))
        return Tensor(other, device=self.device, requires_grad=False)

    def __add__(self, other):
        if isinstance(other, numbers.Number):
            return ops.add_scalar(self, other)
        return ops.add(self, self._other(other))

    def __sub__(self, other):
        if isinstance(other, numbers.Number):
            return ops.add_scalar(self, -other)
        return ops.subtract(self, self._other(other))

    def __mul__(self, other):
        if isinstance(other, numbers.Number):
            return ops.mul_scalar(self, other)
        return ops.multiply(self, self._other(other))

    def __truediv__(self, other):
        if isinstance(other, numbers.Number):
            return ops.divide_scalar(self, other)
        return ops.divide(self, self._other(other))

    def __pow__(self, other):
        if isinstance(other, numbers.Number):
            return ops.power_scalar(self, other)
        return ops.power(self, self._other(other))

    def __matmul__(self, other):
        return ops.matmul(self, self._other(other))

    def __rmatmul__(self, other):
        return ops.matmul(self._other(other), self)

    def __neg__(self):
        return ops.negate(self)

    __radd__ = __add__
    __rmul__ = __mul__

    def __rsub__(self, other):
        return -self + other

    def __rtruediv__(self, other):
        if isinstance(other, numbers.Number):  # true division: integers give float32
            other = Tensor(nd.full(self.shape, other, dtype=dtypes.floating(self.dtype),
                                   device=self.device), requires_grad=False)
        return ops.divide(self._other(other), self)

    def __rpow__(self, other):
        base = Tensor(nd.full(self.shape, other, dtype=self.dtype, device=self.device),
                      requires_grad=False) if isinstance(other, numbers.Number) else other
        return ops.power(self._other(base), self)

    # comparisons are not differentiable: they give constant bool tensors
    def _compare(self, other, name: str) -> Tensor:
        a = self.realize_cached_data()
        b = other.realize_cached_data() if isinstance(other, Tensor) else other
        return Tensor.make_const(getattr(a, name)(b))

    def __eq__(self, other):  # type: ignore[override]
        return self._compare(other, "__eq__")

    def __ne__(self, other):  # type: ignore[override]
        return self._compare(other, "__ne__")

    def __lt__(self, other):
        return self._compare(other, "__lt__")

    def __le__(self, other):
        return self._compare(other, "__le__")

    def __gt__(self, other):
        return self._compare(other, "__gt__")

    def __ge__(self, other):
        return self._compare(other, "__ge__")

    def __getitem__(self, index):
        return ops.getitem(self, index)

    # --- method forms of ops ---------------------------------------------------------------
    # sum/mean/max take needle's axes=/keepdims= or PyTorch's dim=/keepdim=
    def sum(self, axes=None, keepdims: bool = False, *, dim=None, keepdim=None) -> Tensor:
        return ops.summation(self, *axes_and_keepdims(axes, keepdims, dim, keepdim, "sum"))

    def mean(self, axes=None, keepdims: bool = False, *, dim=None, keepdim=None) -> Tensor:
        return ops.mean(self, *axes_and_keepdims(axes, keepdims, dim, keepdim, "mean"))

    def max(self, axes=None, keepdims: bool = False, *, dim=None, keepdim=None):
        """The maximum over ``axes`` (a Tensor). Called PyTorch's way, ``max(dim=d)`` gives
        PyTorch's (values, indices) pair."""
        axes, keepdims = axes_and_keepdims(axes, keepdims, dim, keepdim, "max")
        values = ops.max(self, axes, keepdims)
        if dim is None:
            return values
        return MaxResult(values, self.argmax(dim, keepdims))

    def reshape(self, *shape) -> Tensor:
        return ops.reshape(self, shape[0] if len(shape) == 1 and not isinstance(
            shape[0], numbers.Integral) else shape)

    def transpose(self, *axes) -> Tensor:
        """Swap two axes, given as a pair or two ints (default: the last two)."""
        return ops.transpose(self, axes[0] if len(axes) == 1 else axes or None)

    def permute(self, *axes) -> Tensor:
        return ops.permute(self, axes[0] if len(axes) == 1 and not isinstance(
            axes[0], numbers.Integral) else axes)

    def broadcast_to(self, shape) -> Tensor:
        return ops.broadcast_to(self, shape)

    def flip(self, axes=None) -> Tensor:
        return ops.flip(self, axes)

    def exp(self) -> Tensor:
        return ops.exp(self)

    def log(self) -> Tensor:
        return ops.log(self)

    def sqrt(self) -> Tensor:
        return ops.sqrt(self)

    def relu(self) -> Tensor:
        return ops.relu(self)

    def tanh(self) -> Tensor:
        return ops.tanh(self)

    def sigmoid(self) -> Tensor:
        return ops.sigmoid(self)

    def silu(self) -> Tensor:
        return ops.silu(self)

    def gelu(self) -> Tensor:
        return ops.gelu(self)

    def softmax(self) -> Tensor:
        """Softmax over the last axis."""
        return ops.softmax(self)

    def log_softmax(self) -> Tensor:
        """log(softmax) over the last axis."""
        return ops.log_softmax(self)


# ops subclass TensorOp and Tensor's operators call ops, and backprop walks Values: import
# them once the classes exist.
from . import ops  # noqa: E402
from .backprop import _backward_pass, find_topo_sort, grad  # noqa: E402,F401
