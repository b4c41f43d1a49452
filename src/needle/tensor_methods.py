"""PyTorch's Tensor habits on needle's Tensor: ``.T``, ``.view``, ``.tolist``, ``.argmax``,
``.clone``, ``.contiguous``, dtype shorthands and ``.cpu()``/``.cuda()``.

A mixin of ``autograd.Tensor``, kept apart so the graph engine stays readable. Methods
import ``ops`` when called (ops itself imports autograd).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple


class MaxResult(NamedTuple):
    """``t.max(dim=d)``'s answer, as PyTorch's: the maxima and where they are."""

    values: object
    indices: object


def axes_and_keepdims(axes, keepdims: bool, dim, keepdim, name: str):
    """needle's ``axes=``/``keepdims=`` or PyTorch's ``dim=``/``keepdim=`` (not both)."""
    from .errors import ArgumentError

    if dim is not None:
        if axes is not None:
            raise ArgumentError(f"{name}: pass axes= (needle) or dim= (PyTorch), not both")
        axes = dim
    if keepdim is not None:
        keepdims = keepdim
    return axes, bool(keepdims)


class TensorMethods:
    """Methods Tensor gains for people who know PyTorch (see docs/compat.md)."""

    @property
    def T(self):  # noqa: N802 (PyTorch's and numpy's name)
        """The tensor with its axes reversed (the transpose of a matrix)."""
        return self if self.ndim < 2 else self.permute(tuple(reversed(range(self.ndim))))

    def view(self, *shape):
        """``reshape`` (needle has no separate view contract: reshape copies only when the
        strides cannot express the new shape)."""
        return self.reshape(*shape)

    def tolist(self):
        return self.numpy().tolist()

    def numel(self) -> int:
        return self.size

    def dim(self) -> int:
        return self.ndim

    def argmax(self, dim=None, keepdim: bool = False):
        """Index of the maximum along ``dim`` (of the flattened tensor when None), int64,
        outside the graph."""
        from .autograd import Tensor

        if dim is not None and not isinstance(dim, numbers.Integral):
            from .errors import AxisError

            raise AxisError(f"argmax takes one axis (an int) or None, got {dim!r}")
        return Tensor.make_const(self.realize_cached_data().argmax(dim, keepdim))

    def clone(self):
        """A copy with its own storage; differentiable (the gradient passes through)."""
        from . import ops

        return ops.clone(self)

    def contiguous(self):
        """This tensor when its storage is compact, else a compact copy."""
        return self if self.realize_cached_data().is_compact() else self.clone()

    def float(self):
        return self.astype("float32")

    def double(self):
        return self.astype("float64")

    def half(self):
        return self.astype("float16")

    def bfloat16(self):
        return self.astype("bfloat16")

    def long(self):
        return self.astype("int64")

    def int(self):
        return self.astype("int32")

    def cpu(self):
        """This tensor on the native CPU backend (``cpu()``; already-CPU tensors stay)."""
        from .backend_ndarray import cpu

        return self if self.device.kind in ("cpu", "cpu_numpy") else self.to(cpu())

    def cuda(self, device: int | None = None):
        """This tensor on CUDA GPU ``device`` (0 by default); DeviceError without CUDA."""
        from .backend_ndarray.device import as_device

        return self.to(as_device(0 if device is None else device))
