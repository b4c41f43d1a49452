"""NDArray's elementwise methods: the arithmetic operators (plain, reflected and in place),
comparisons, maximum and minimum, the unary maps (exp, log, tanh, relu, ...) and the Python
scalar conversions. A mixin of NDArray, split from ndarray.py for its length. Each promotes
dtypes, broadcasts and compacts its operands, then calls the backend's ``ewise_``/``scalar_``
function of its name."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ArgumentTypeError, DTypeError, ShapeError
from . import dtypes
from .shapes import _compact_strides_of, _prod_shape, broadcast_shapes

if TYPE_CHECKING:
    from .ndarray import NDArray, full
else:
    # ndarray.py imports this module before it defines these, then binds them here: module
    # globals, looked up as cheaply as in ndarray.py itself (``_binary`` runs on every op)
    NDArray = full = None


_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


class ElementwiseOps:
    """Methods NDArray mixes in; they use its ``_handle``, ``_be``, ``_fresh``, ``_is_plain``,
    ``_check_device``, ``astype``, ``broadcast_to``, ``compact`` and ``item``."""

    __slots__ = ()

    def _binary(self, other, name: str, dtype_rule=None, out_dtype=None) -> NDArray:
        """Promote, broadcast and compact both sides, then call ewise_/scalar_ ``name``."""
        if type(other) is NDArray:
            a, b = self._handle, other._handle
            dt, shape, strides = a.dtype, self._shape, self._strides
            if (other._shape == shape and b.dtype == dt and other._device is self._device
                    and (dtype_rule is None or dtype_rule(dt) == dt)
                    and self._offset == 0 and other._offset == 0 and a.size == b.size
                    and strides == other._strides and a.size == _prod_shape(shape)
                    and strides == _compact_strides_of(shape)):
                # the common case, fast: both compact over whole buffers of one size (one
                # _is_plain test, inline, serves both; the output takes their strides and
                # size). An array exists, so its device's backend is loaded: read it directly
                out = self._fresh_like(out_dtype or dt)
                getattr(self._device._backend, "ewise_" + name)(a, b, out._handle)
                return out
            self._check_device(other)
            dt = dtypes.promote(self.dtype, other.dtype)
            dt = dtype_rule(dt) if dtype_rule else dt
            shape = broadcast_shapes(self.shape, other.shape)
            a = self.astype(dt).broadcast_to(shape).compact()
            b = other.astype(dt).broadcast_to(shape).compact()
            out = NDArray.make(shape, device=self.device, dtype=out_dtype or dt)
            getattr(self._be, "ewise_" + name)(a._handle, b._handle, out._handle)
            return out
        if isinstance(other, (numbers.Number, np.generic)):
            dt = dtypes.promote_scalar(self.dtype, other)
            dt = dtype_rule(dt) if dtype_rule else dt
            dtypes.check_scalar(dt, other)
            a = self if dt == self._handle.dtype and self._is_plain() else self.astype(dt).compact()
            out = a._fresh(a._shape, out_dtype or dt)
            value = float(other) if dtypes.is_floating(dt) else int(other)
            getattr(self._be, "scalar_" + name)(a._handle, value, out._handle)
            return out
        if isinstance(other, (list, tuple, np.ndarray)):
            return self._binary(self._operand(other, isinstance(other, np.ndarray)), name,
                                dtype_rule, out_dtype)
        return NotImplemented

    def _operand(self, other, typed: bool) -> NDArray:
        """A list, tuple or numpy operand as an array on this device. A ``typed`` one (a
        numpy array) keeps its dtype and promotes by rule 1; Python numbers follow the scalar
        rule 2 (the array's dtype wins within its kind), so a float64 array is never combined
        with its operand rounded through float32."""
        host = np.asarray(other)
        if typed or host.dtype.kind not in "biuf":
            return NDArray(host, device=self.device)
        sample = {"b": True, "i": 0, "u": 0, "f": 0.0}[host.dtype.kind]
        dt = dtypes.promote_scalar(self.dtype, sample)
        if dt == "int32" and host.size and host.dtype.kind in "iu" and not (
                -2**31 <= int(host.min()) and int(host.max()) < 2**31):
            from .ndarray import _integer_dtype  # not at the top: ndarray.py imports us
            dt = _integer_dtype(host)  # ints beyond int32 widen rather than wrap
        return NDArray(host, device=self.device, dtype=dt)

    def _rbinary(self, other, name):
        if isinstance(other, (numbers.Number, np.generic)):
            return full(self.shape, other, dtype=dtypes.promote_scalar(self.dtype, other),
                        device=self.device)._binary(self, name, dtypes.arithmetic)
        if isinstance(other, (list, tuple, np.ndarray)):
            return self._operand(other, isinstance(other, np.ndarray))._binary(
                self, name, dtypes.arithmetic)
        return NotImplemented

    def __add__(self, other):
        return self._binary(other, "add", dtypes.arithmetic)

    def __sub__(self, other):
        return self._binary(other, "sub", dtypes.arithmetic)

    def __mul__(self, other):
        return self._binary(other, "mul", dtypes.arithmetic)

    def __truediv__(self, other):
        return self._binary(other, "div", dtypes.floating)

    def __floordiv__(self, other):
        raise DTypeError("floor division is not an array-API op; use / and cast")

    def __pow__(self, other):
        return self._binary(other, "power", dtypes.arithmetic)

    __radd__ = __add__
    __rmul__ = __mul__

    def __rsub__(self, other):
        return self._rbinary(other, "sub")

    def __rtruediv__(self, other):
        if isinstance(other, (numbers.Number, np.generic)):
            return full(self.shape, other, dtype=dtypes.floating(self.dtype),
                        device=self.device)._binary(self, "div", dtypes.floating)
        if isinstance(other, (list, tuple, np.ndarray)):
            return self._operand(other, isinstance(other, np.ndarray))._binary(
                self, "div", dtypes.floating)
        return NotImplemented

    def __rpow__(self, other):
        return self._rbinary(other, "power")

    # In place: ``a += b`` writes into a's own buffer when a is compact and the result keeps
    # its shape and dtype, so optimizers update weights without allocating. Elementwise
    # backend functions accept ``out`` equal to an input (element i is read before it is
    # written). Otherwise NotImplemented makes Python fall back to ``a = a + b``.
    def _inplace(self, other, name: str, dtype_rule=dtypes.arithmetic):
        """``a op= b`` updates a's elements, as in numpy and PyTorch: its shape and dtype
        stay (a result that would change them is an error, never a silent rebinding), and a
        view's update reaches the array it views."""
        dt = self._handle.dtype
        if isinstance(other, (list, tuple, np.ndarray)):  # within its kind, as in PyTorch
            other = self._operand(other, typed=False)
        if type(other) is NDArray:
            self._check_device(other)
            result_dt = dtype_rule(dtypes.promote(dt, other.dtype))
            shape = broadcast_shapes(self._shape, other._shape)
        elif isinstance(other, (numbers.Number, np.generic)):
            result_dt = dtype_rule(dtypes.promote_scalar(dt, other))
            dtypes.check_scalar(result_dt, other)
            shape = self._shape
        else:
            return NotImplemented
        if shape != self._shape:
            raise ShapeError(f"in-place {name} cannot change the array's shape: {self._shape} "
                             f"with {other.shape} broadcasts to {shape}")
        if result_dt != dt:
            raise DTypeError(f"in-place {name} of a {dt} array would give {result_dt}, which "
                             f"it cannot hold; write a = a {_SYMBOL[name]} b instead")
        if not self._is_plain():  # a view: compute, then write through it
            self[...] = self._binary(other, name)
            return self
        if type(other) is NDArray:
            b = other.astype(dt).broadcast_to(self._shape)
            b = b if b._is_plain() else b.compact()
            getattr(self._be, "ewise_" + name)(self._handle, b._handle, self._handle)
        else:
            value = float(other) if dtypes.is_floating(dt) else int(other)
            getattr(self._be, "scalar_" + name)(self._handle, value, self._handle)
        return self

    def __iadd__(self, other):
        return self._inplace(other, "add")

    def __isub__(self, other):
        return self._inplace(other, "sub")

    def __imul__(self, other):
        return self._inplace(other, "mul")

    def __itruediv__(self, other):
        return self._inplace(other, "div", dtypes.floating)

    def __neg__(self):
        return self._unary("neg", dtypes.arithmetic)

    def __abs__(self):
        return self._unary("abs", dtypes.arithmetic)

    def maximum(self, other):
        return self._named_binary(other, "maximum")

    def minimum(self, other):
        return self._named_binary(other, "minimum")

    def _named_binary(self, other, name: str) -> NDArray:
        """A binary op called by name: unlike an operator it has no reflected fallback, so an
        operand of the wrong kind is an error here, not ``NotImplemented``."""
        out = self._binary(other, name, dtypes.arithmetic)
        if out is NotImplemented:
            raise ArgumentTypeError(f"{name}: the other operand must be an NDArray, a number "
                                    f"or a sequence of numbers, not {type(other).__name__}")
        return out

    def __eq__(self, other):  # type: ignore[override]
        return self._binary(other, "eq", out_dtype="bool")

    def __ne__(self, other):  # type: ignore[override]
        return self._binary(other, "ne", out_dtype="bool")

    def __lt__(self, other):
        return self._binary(other, "lt", out_dtype="bool")

    def __le__(self, other):
        return self._binary(other, "le", out_dtype="bool")

    def __gt__(self, other):
        return self._binary(other, "gt", out_dtype="bool")

    def __ge__(self, other):
        return self._binary(other, "ge", out_dtype="bool")

    __hash__ = None  # arrays are mutable and compare elementwise

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def _unary(self, name: str, dtype_rule=dtypes.floating) -> NDArray:
        dt = self._handle.dtype
        a = self if dtype_rule(dt) == dt and self._is_plain() else self.astype(
            dtype_rule(dt)).compact()
        out = a._fresh(a._shape, a._handle.dtype)
        getattr(self._be, "ewise_" + name)(a._handle, out._handle)
        return out

    def abs(self):
        return self._unary("abs", dtypes.arithmetic)

    def relu(self):
        return self._unary("relu", dtypes.arithmetic)

    def exp(self):
        return self._unary("exp")

    def log(self):
        return self._unary("log")

    def sqrt(self):
        return self._unary("sqrt")

    def rsqrt(self):
        return self._unary("rsqrt")

    def sin(self):
        return self._unary("sin")

    def cos(self):
        return self._unary("cos")

    def tanh(self):
        return self._unary("tanh")

    def sigmoid(self):
        return self._unary("sigmoid")

    def silu(self):
        return self._unary("silu")

    def gelu(self):
        return self._unary("gelu")
