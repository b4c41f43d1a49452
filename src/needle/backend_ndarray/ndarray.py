"""NDArray: a strided view (shape, strides, offset) over a flat typed buffer on a device.

Views (reshape when the strides allow, permute, broadcast_to, slicing, flip) share the
buffer; everything else goes through the device's backend, which sees only flat buffers
and explicit sizes. NDArray does the checking (shapes, axes, dtypes, devices) so that no
backend ever receives input it cannot handle.

The methods are grouped by concern: layout and indexing in ``layout_ops.py``, elementwise
ops in ``elementwise_ops.py``, transformer functions in ``transformer_ops.py`` (mixins of
NDArray); shape and axis arithmetic in ``shapes.py``. Construction, transfer, reductions and
matmul are here.
"""

from __future__ import annotations

import builtins
import numbers

import numpy as np

from ..backends.api import has
from ..errors import (
    AxisError,
    DeviceError,
    DTypeError,
    OutOfMemoryError,
    ShapeError,
)
from . import dtypes, elementwise_ops, layout_ops
from .device import Device, as_device, default_device
from .elementwise_ops import ElementwiseOps
from .layout_ops import LayoutOps
from .shapes import (  # also importable from here (functions.py, nd.broadcast_shapes)
    _check_shape,
    _compact_strides,
    _normalize_axes,
    _prod,
    broadcast_shapes,
)
from .transformer_ops import TransformerOps


def _integer_dtype(array: np.ndarray) -> str:
    """needle's dtype for numpy integers, holding every value exactly: uint8 and int8 keep
    their dtype, int32 for int16, uint16 and int32 data, int64 for int64 and uint32, int64
    for uint64 whose values fit it (larger ones are refused rather than wrapped)."""
    kind, size = array.dtype.kind, array.dtype.itemsize
    if size == 1:
        return "uint8" if kind == "u" else "int8"
    if size < 4 or (kind == "i" and size == 4):
        return "int32"
    if kind == "u" and size == 8 and array.size and int(array.max()) >= 2**63:
        raise DTypeError(f"uint64 value {int(array.max())} does not fit needle's int64 (the "
                         "widest integer dtype); convert the data first")
    return "int64"


def _inferred_dtype(array: np.ndarray, typed: bool, device: Device) -> str:
    """The dtype of data given without one, as ``torch.tensor`` infers it: a numpy array
    (``typed``) keeps its dtype, float64 included; Python floats (lists, scalars) give
    float32. A device without float64 (Metal) holds a float64 array as float32."""
    if array.dtype.kind == "f" and array.dtype not in (np.float16, np.float32):
        if array.dtype != np.float64:
            return dtypes.canonical(array.dtype)
        return "float64" if typed and _holds_float64(device) else "float32"
    if array.dtype.kind in "iu":
        return _integer_dtype(array)
    return dtypes.canonical(array.dtype)


def _holds_float64(device: Device) -> bool:
    held = getattr(getattr(device.backend, "device", None), "dtypes", None)
    return held is None or "float64" in held


class NDArray(LayoutOps, ElementwiseOps, TransformerOps):
    """A strided n-dimensional array of one dtype on one device."""

    __slots__ = ("_shape", "_strides", "_offset", "_device", "_handle", "__weakref__")

    def __init__(self, other, device: Device | None = None, dtype=None):
        device = as_device(device)
        if isinstance(other, NDArray):
            device = device or other.device
            src = other.astype(dtypes.canonical(dtype)) if dtype is not None else other
            src = src.to(device) if device != src.device else src.compact()
            self._init(src if src is not other else other.compact().copy())
            return
        if hasattr(other, "__dlpack__") and not isinstance(other, np.ndarray):
            other = np.asarray(other.detach().cpu() if hasattr(other, "detach") else other)
        try:
            array = np.asarray(other)
        except ValueError as e:  # ragged nested sequences
            raise ShapeError(f"cannot make an array from ragged data: {e}") from None
        if array.dtype.kind not in "biuf" and array.dtype != dtypes.to_numpy_dtype("bfloat16"):
            raise DTypeError(f"numpy data of dtype {array.dtype} is not supported; use numbers "
                             f"(bool, int or float)")
        device = device or default_device()
        if dtype is None:
            dtype = _inferred_dtype(array, typed=isinstance(other, (np.ndarray, np.generic)),
                                    device=device)
        dtype = dtypes.canonical(dtype)
        out = NDArray.make(array.shape, device=device, dtype=dtype)
        with np.errstate(over="ignore"):  # floats beyond a narrower dtype become inf: the rule
            host = np.ascontiguousarray(array, dtype=dtypes.to_numpy_dtype(dtype))
        device.backend.from_numpy(host, out._handle)
        self._init(out)

    def _init(self, other: NDArray) -> None:
        self._shape, self._strides, self._offset = other._shape, other._strides, other._offset
        self._device, self._handle = other._device, other._handle

    @staticmethod
    def make(shape, strides=None, device: Device | None = None, handle=None, offset: int = 0,
             dtype: str = "float32") -> NDArray:
        """Create an NDArray over ``handle`` (or a fresh buffer) without copying."""
        arr = NDArray.__new__(NDArray)
        arr._shape = _check_shape(shape)
        arr._strides = _compact_strides(arr._shape) if strides is None else tuple(strides)
        arr._offset = offset
        arr._device = device if device is not None else default_device()
        if handle is None:
            dtype = dtypes.canonical(dtype)
            nbytes = _prod(arr._shape) * dtypes.ITEMSIZE[dtype]
            if nbytes >= 2**63:  # would overflow a backend's size_t arithmetic
                raise OutOfMemoryError(f"an array of shape {arr._shape} and dtype {dtype} needs "
                                       f"{nbytes} bytes, more than any device can address")
            handle = arr._device.backend.Array(_prod(arr._shape), dtype)
        arr._handle = handle
        return arr

    # --- properties ----------------------------------------------------------------------
    shape = property(lambda self: self._shape)
    strides = property(lambda self: self._strides)
    offset = property(lambda self: self._offset)
    device = property(lambda self: self._device)
    handle = property(lambda self: self._handle)
    dtype = property(lambda self: self._handle.dtype)
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: _prod(self._shape))
    itemsize = property(lambda self: dtypes.ITEMSIZE[self.dtype])
    nbytes = property(lambda self: self.size * self.itemsize)

    @property
    def _be(self):
        return self._device.backend

    def __len__(self) -> int:
        if not self._shape:
            raise ShapeError("len() of a 0-d array")
        return self._shape[0]

    def __repr__(self) -> str:
        return f"NDArray({self.numpy()!r}, device={self.device!r}, dtype={self.dtype})"

    __str__ = lambda self: str(self.numpy())  # noqa: E731

    # --- creation and transfer -----------------------------------------------------------
    def _empty_like(self, shape=None, dtype=None) -> NDArray:
        return NDArray.make(self.shape if shape is None else shape, device=self.device,
                            dtype=dtype or self.dtype)

    def _fresh(self, shape: tuple[int, ...], dtype: str) -> NDArray:
        """A new compact array on this device; the hot path's lean ``make`` (no checks)."""
        arr = NDArray.__new__(NDArray)
        arr._shape, arr._strides, arr._offset = shape, _compact_strides(shape), 0
        arr._device = self._device
        arr._handle = self._device.backend.Array(_prod(shape), dtype)
        return arr

    def _fresh_like(self, dtype: str) -> NDArray:
        """A new array of this compact whole-buffer array's shape (``_is_plain``), its
        strides and element count reused: the elementwise fast path's output."""
        arr = NDArray.__new__(NDArray)
        arr._shape, arr._strides, arr._offset = self._shape, self._strides, 0
        arr._device = device = self._device
        arr._handle = device._backend.Array(self._handle.size, dtype)  # loaded: self exists
        return arr

    def fill(self, value) -> None:
        """Set every element to ``value`` (the array must be compact)."""
        if not isinstance(value, (numbers.Number, np.bool_)):
            raise DTypeError(f"fill value must be a number, got {type(value).__name__}")
        dtypes.check_scalar(self.dtype, value)
        if not self.is_compact():
            self[...] = value
            return
        self._be.fill(self._handle, value)

    def numpy(self) -> np.ndarray:
        """A numpy copy of the array (waits for queued device work)."""
        return self._be.to_numpy(self._handle, self._shape, self._strides, self._offset)

    def numpy_later(self):
        """Start copying the array to the host without waiting: returns a function that
        waits for the copy and returns what ``numpy()`` would have returned at this call.
        Device work queued in between may run while the copy completes (on CUDA, small
        arrays; elsewhere the copy happens at once)."""
        if not has(self._be, "async_read"):
            out = self.numpy()
            return lambda: out
        return self._be.to_numpy_later(self._handle, self._shape, self._strides, self._offset)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def item(self):
        if self.size != 1:
            raise ShapeError("item() needs an array of one element, this one has shape "
                             f"{self.shape}")
        return self.numpy().reshape(-1)[0].item()

    def to(self, device: Device) -> NDArray:
        if device == self.device:
            return self
        return NDArray(self.numpy(), device=device, dtype=self.dtype)

    def _check_device(self, other: NDArray) -> None:
        if other.device != self.device:
            raise DeviceError(f"arrays are on different devices ({self.device.name} and "
                              f"{other.device.name}); move one with .to(device)")

    def copy(self) -> NDArray:
        out = self._empty_like()
        self._be.compact(self._handle, out._handle, self._shape, self._strides, self._offset)
        return out

    def astype(self, dtype) -> NDArray:
        if dtype == self._handle.dtype:  # the common case, before canonicalising
            return self
        dtype = dtypes.canonical(dtype)
        if dtype == self.dtype:
            return self
        src = self.compact()
        out = self._empty_like(dtype=dtype)
        self._be.ewise_cast(src._handle, out._handle)
        return out

    # --- DLPack --------------------------------------------------------------------------
    def __dlpack__(self, stream=None, **kwargs):
        if builtins.min(self._strides, default=0) < 0:  # consumers such as torch abort on these
            return self.compact().__dlpack__(stream, **kwargs)
        be = self._be
        if has(be, "dlpack"):
            return be.to_dlpack(self._handle, self._shape, self._strides, self._offset, stream)
        self._need_host_memory()
        return self._host_view().__dlpack__(**{k: v for k, v in kwargs.items() if v is not None})

    def __dlpack_device__(self):
        if has(self._be, "dlpack"):
            return self._be.dlpack_device()
        self._need_host_memory()
        return (1, 0)  # kDLCPU

    def _need_host_memory(self) -> None:
        if not has(self._be, "host_memory"):
            raise DeviceError(f"{self.device.name} arrays cannot be exchanged through DLPack; "
                              "copy to the CPU first (.to(nd.cpu()))")

    def _host_view(self) -> np.ndarray:
        if self.dtype == "bfloat16":
            raise DTypeError("DLPack exchange of bfloat16 is not supported on the CPU "
                             "(numpy has no bfloat16 DLPack code); cast to float32 first")
        flat = self._be.host_view(self._handle)
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(
            flat[self._offset:], self._shape, tuple(s * item for s in self._strides))

    # --- reductions ----------------------------------------------------------------------
    def _reduce(self, name: str, axis, keepdims: bool, out_dtype=None) -> NDArray:
        shape = self._shape
        ndim = len(shape)
        if type(axis) is int and -ndim <= axis < ndim:  # the common case, checked cheaply
            axes = (axis % ndim,)
        else:
            axes = _normalize_axes(axis, ndim)
            if not ndim:
                axes = ()
        reduce_size = 1
        for i in axes:
            reduce_size *= shape[i]
        dtype = self._handle.dtype
        if reduce_size == 0 and name != "sum":
            raise ShapeError(f"{name}() of an empty axis has no identity; "
                             f"array shape {shape}, axes {axes}")
        if dtype == "bool" and name in ("max", "min"):
            return self.astype("int32")._reduce(name, axis, keepdims).astype("bool")
        # reduce a contiguous block of axes in place when possible, else permute them last
        if axes and axes[-1] - axes[0] == len(axes) - 1 and list(axes) == sorted(axes):
            src = self if self._is_plain() else self.copy()
            outer = _prod(shape[: axes[0]])
            inner = _prod(shape[axes[-1] + 1:])
        else:
            keep = [i for i in range(ndim) if i not in axes]
            src = self.permute(keep + list(axes)).compact()
            outer, inner = _prod(shape[i] for i in keep), 1
        dt = out_dtype or (dtypes.sum_dtype(dtype) if name == "sum" else dtype)
        # the result is made in its final shape: with or without the reduced axes, a fresh
        # compact array of the same elements
        out = self._fresh(tuple(1 if i in axes else d for i, d in enumerate(shape)) if keepdims
                          else tuple(d for i, d in enumerate(shape) if i not in axes), dt)
        if outer * reduce_size * inner == 0:
            out.fill(0)
        else:
            getattr(self._be, "reduce_" + name)(src._handle, out._handle, outer, reduce_size,
                                                inner)
        return out

    def sum(self, axis=None, keepdims: bool = False) -> NDArray:
        return self._reduce("sum", axis, keepdims)

    def max(self, axis=None, keepdims: bool = False) -> NDArray:
        return self._reduce("max", axis, keepdims)

    def min(self, axis=None, keepdims: bool = False) -> NDArray:
        return self._reduce("min", axis, keepdims)

    def argmax(self, axis=None, keepdims: bool = False) -> NDArray:
        if axis is None:
            flat = self.reshape(-1)._reduce("argmax", 0, False, "int64")
            return flat.reshape((1,) * self.ndim) if keepdims else flat
        if not isinstance(axis, numbers.Integral):
            raise AxisError(f"argmax takes a single axis, got {axis!r}")
        return self._reduce("argmax", axis, keepdims, "int64")

    def mean(self, axis=None, keepdims: bool = False) -> NDArray:
        axes = _normalize_axes(axis, self.ndim)
        count = _prod(self._shape[i] for i in axes)
        src = self if dtypes.is_floating(self.dtype) else self.astype("float32")
        if count == 0:  # numpy: the mean of nothing is NaN
            return src.sum(axis, keepdims) * float("nan")
        return src.sum(axis, keepdims) / count

    # --- matmul --------------------------------------------------------------------------
    def __matmul__(self, other: NDArray) -> NDArray:
        if (type(other) is NDArray and len(self._shape) == 2 and len(other._shape) == 2
                and other._device is self._device and self._handle.dtype == other._handle.dtype
                and self._shape[1] == other._shape[0] and self._handle.dtype != "bool"):
            # the common case, fast: two matrices of one dtype, each compact or transposed
            ta, tb = self._transposed_matrix(), other._transposed_matrix()
            (m, n), p = self._shape, other._shape[1]
            if ta is not None and tb is not None and m * n * p:
                out = self._fresh((m, p), self._handle.dtype)
                self._device.backend.matmul(self._handle, other._handle, out._handle, m, n, p,
                                            batch=1, stride_a=0, stride_b=0, transpose_a=ta,
                                            transpose_b=tb)
                return out
        if (type(other) is NDArray and len(other._shape) == 2 and len(self._shape) > 2
                and self._shape[-1] == other._shape[0] and self._is_plain()):
            # (..., m, n) @ (n, p), compact: one product of all the rows (a model's
            # projection of (batch, seq, hidden) activations), through the fast path above
            rows = self._view((_prod(self._shape[:-1]), self._shape[-1]),
                              (self._shape[-1], 1))
            return (rows @ other).reshape(self._shape[:-1] + (other._shape[1],))
        if not isinstance(other, NDArray):
            return NotImplemented
        self._check_device(other)
        if self.dtype == "bool" or other.dtype == "bool":
            raise DTypeError("matmul is not defined for bool arrays; cast to a number type")
        a, b = self, other
        if a.ndim == 0 or b.ndim == 0:
            raise ShapeError("matmul needs arrays of at least one dimension; use * for scalars")
        dt = dtypes.promote(a.dtype, b.dtype)
        a, b = a.astype(dt), b.astype(dt)
        squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
        if squeeze_a:
            a = a.reshape((1, a.shape[0]))
        if squeeze_b:
            b = b.reshape((b.shape[0], 1))
        m, n = a.shape[-2:]
        n2, p = b.shape[-2:]
        if n != n2:
            raise ShapeError(f"matmul: inner dimensions differ, {self.shape} @ {other.shape} "
                             f"({n} != {n2})")
        batch_shape = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        if _prod(batch_shape) * m * p == 0 or n == 0:  # nothing to read, or sums of nothing
            out = zeros(batch_shape + (m, p), dtype=dt, device=self.device)
        elif b.ndim == 2 and a.ndim > 2:  # (..., m, n) @ (n, p): one big matrix product
            a2 = a.reshape((-1, n)) if a.is_compact() else a.compact().reshape((-1, n))
            out = a2._matmul2d(b).reshape(batch_shape + (m, p))
        else:
            batch = _prod(batch_shape)
            out = NDArray.make(batch_shape + (m, p), device=self.device, dtype=dt)
            ha, sa, ta = a._matmul_operand(batch_shape)
            hb, sb, tb = b._matmul_operand(batch_shape)
            if out.size:
                self._be.matmul(ha._handle, hb._handle, out._handle, m, n, p, batch=batch,
                                stride_a=sa, stride_b=sb, transpose_a=ta, transpose_b=tb)
        if squeeze_a:
            out = out.reshape(out.shape[:-2] + (p,))
        if squeeze_b:
            out = out.reshape(out.shape[:-1])
        return out

    def _matmul2d(self, b: NDArray) -> NDArray:
        out = NDArray.make((1, self.shape[0], b.shape[1]), device=self.device, dtype=self.dtype)
        ha, sa, ta = self._matmul_operand(())
        hb, sb, tb = b._matmul_operand(())
        if out.size:
            self._be.matmul(ha._handle, hb._handle, out._handle, self.shape[0], self.shape[1],
                            b.shape[1], batch=1, stride_a=sa, stride_b=sb, transpose_a=ta,
                            transpose_b=tb)
        return out.reshape(out.shape[1:])

    def _transposed_matrix(self) -> bool | None:
        """For a matrix that is its whole buffer: False when row-major, True when stored
        column-major (a transposed view); None otherwise (the product needs a copy)."""
        (r, c), (sr, sc) = self._shape, self._strides
        if self._offset or self._handle.size != r * c:
            return None
        if sr == c and sc == 1 or r == 1 and sc == 1:
            return False
        if sr == 1 and sc == r or c == 1 and sr == 1:
            return True
        return None

    def _matmul_operand(self, batch_shape):
        """(array, batch stride, transposed) for this operand without copying when possible.

        A matrix whose last two axes are swapped from compact passes as transposed; a single
        matrix broadcast over the batch passes with batch stride 0.
        """
        r, c = self.shape[-2:]
        mat = self[(0,) * (self.ndim - 2)] if self.ndim > 2 else self
        if self.ndim == 2 or all(s == 0 for s in self.strides[:-2]):  # one matrix
            transposed = mat._transposed_matrix()
            if transposed is not None:
                return mat, 0, transposed
        if (self.shape[:-2] == tuple(batch_shape) and self.strides[-2:] == (1, r)
                and self._offset == 0 and self._handle.size == self.size):
            # a batch of transposed matrices one after another (a permuted KV cache): as is
            step = r * c
            for d, s in zip(reversed(self.shape[:-2]), reversed(self.strides[:-2])):
                if d != 1 and s != step:
                    break
                step *= d
            else:
                return self, r * c, True
        full_ = self.broadcast_to(batch_shape + (r, c)).compact()
        return full_, r * c, False


# --- module-level helpers (as in needle) ---------------------------------------------------

def array(a, dtype=None, device: Device | None = None) -> NDArray:
    return NDArray(a, device=device, dtype=dtype)


def empty(shape, dtype="float32", device: Device | None = None) -> NDArray:
    return (device or default_device()).empty(_check_shape(shape), dtype)


def full(shape, fill_value, dtype="float32", device: Device | None = None) -> NDArray:
    return (device or default_device()).full(_check_shape(shape), fill_value, dtype)


def zeros(shape, dtype="float32", device: Device | None = None) -> NDArray:
    return full(shape, 0, dtype, device)


def ones(shape, dtype="float32", device: Device | None = None) -> NDArray:
    return full(shape, 1, dtype, device)


# The mixins name these at run time; their modules were imported before they existed.
elementwise_ops.NDArray = layout_ops.NDArray = NDArray
elementwise_ops.full = full
