"""Tensor factories under PyTorch's names: ``ndl.tensor``, ``zeros``, ``arange``, ``cat`` ...

Thin layers over ``Tensor`` and ``needle.init`` with PyTorch's signatures and defaults: sizes
as ``f(2, 3)`` or ``f((2, 3))``, ``dtype=None`` meaning float32 for floats, and
``requires_grad=False`` (``ndl.Tensor`` itself defaults to True, as the needle course's does).
Random draws come from ``needle.init``'s generator, which ``manual_seed`` resets for
initial weights, dropout, random transforms and shuffling alike.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import init, ops
from .autograd import Tensor
from .backend_ndarray.device import as_device, default_device
from .backend_ndarray.dtypes import DEFAULT_FLOAT, canonical, to_numpy_dtype
from .errors import ArgumentTypeError

__all__ = ["arange", "cat", "full", "full_like", "manual_seed", "ones", "ones_like", "rand",
           "randn", "tensor", "zeros", "zeros_like"]

manual_seed = init.manual_seed


def _dtype(dtype) -> str:
    return DEFAULT_FLOAT if dtype is None else canonical(dtype)


def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding ``data``: numpy arrays keep their dtype, Python floats give
    float32 and ints int64 (as ``torch.tensor``)."""
    return Tensor(data, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return init.zeros(*size, device=as_device(device), dtype=_dtype(dtype),
                      requires_grad=requires_grad)


def ones(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return init.ones(*size, device=as_device(device), dtype=_dtype(dtype),
                     requires_grad=requires_grad)


def _scalar_dtype(value) -> str:
    """The dtype PyTorch gives a Python scalar: bool, int64 or float32."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, numbers.Integral):
        return "int64"
    if isinstance(value, numbers.Real):
        return DEFAULT_FLOAT
    raise ArgumentTypeError(f"fill_value must be a number, got {type(value).__name__}")


def full(size, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """``size`` filled with ``fill_value``; the dtype follows the value (bool, int64,
    float32) unless given."""
    dtype = canonical(dtype) if dtype is not None else _scalar_dtype(fill_value)
    size = (size,) if isinstance(size, numbers.Integral) else tuple(size)
    return init.constant(*size, c=fill_value, device=as_device(device), dtype=dtype,
                         requires_grad=requires_grad)


def _like(t: Tensor, dtype, device) -> tuple[str, object]:
    if not isinstance(t, Tensor):
        raise ArgumentTypeError(f"expected a Tensor, got {type(t).__name__}")
    return (t.dtype if dtype is None else canonical(dtype),
            t.device if device is None else as_device(device))


def zeros_like(t: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    dtype, device = _like(t, dtype, device)
    return init.zeros(*t.shape, dtype=dtype, device=device, requires_grad=requires_grad)


def ones_like(t: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    dtype, device = _like(t, dtype, device)
    return init.ones(*t.shape, dtype=dtype, device=device, requires_grad=requires_grad)


def full_like(t: Tensor, fill_value, dtype=None, device=None,
              requires_grad: bool = False) -> Tensor:
    dtype, device = _like(t, dtype, device)
    return init.constant(*t.shape, c=fill_value, dtype=dtype, device=device,
                         requires_grad=requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None,
           requires_grad: bool = False) -> Tensor:
    """Values from ``start`` up to (not including) ``end`` by ``step``; int64 when all three
    are ints, else float32 (as ``torch.arange``)."""
    if end is None:
        start, end = 0, start
    for name, v in (("start", start), ("end", end), ("step", step)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise ArgumentTypeError(f"arange: {name} must be a number, got {v!r}")
    if step == 0:
        raise ArgumentTypeError("arange: step must be nonzero")
    if dtype is None:
        ints = all(isinstance(v, numbers.Integral) for v in (start, end, step))
        dtype = "int64" if ints else DEFAULT_FLOAT
    dtype = canonical(dtype)
    host = np.arange(start, end, step, dtype=np.float64 if "float" in dtype else np.int64)
    return Tensor(host.astype(to_numpy_dtype(dtype)), device=as_device(device) or
                  default_device(), dtype=dtype, requires_grad=requires_grad)


def randn(*size, dtype=None, device=None, requires_grad: bool = False,
          generator=None) -> Tensor:
    """Standard normal samples (from ``manual_seed``'s generator unless one is given)."""
    return init.randn(*size, dtype=_dtype(dtype), device=as_device(device),
                      requires_grad=requires_grad, generator=generator)


def rand(*size, dtype=None, device=None, requires_grad: bool = False,
         generator=None) -> Tensor:
    """Uniform samples in [0, 1)."""
    return init.rand(*size, dtype=_dtype(dtype), device=as_device(device),
                     requires_grad=requires_grad, generator=generator)


def cat(tensors, dim: int = 0) -> Tensor:
    """Join tensors along an existing axis ``dim`` (``ops.concatenate``)."""
    return ops.concatenate(tensors, axis=dim)
