"""NDArray: a strided view (shape, strides, offset) over a flat typed buffer on a device.

Views (reshape when the strides allow, permute, broadcast_to, slicing, flip) share the
buffer; everything else goes through the device's backend, which sees only flat buffers
and explicit sizes. NDArray does the checking (shapes, axes, dtypes, devices) so that no
backend ever receives input it cannot handle.
"""

from __future__ import annotations

import builtins
import numbers
import operator
from functools import lru_cache, reduce

import numpy as np

from ..backends.api import has
from ..errors import (
    ArgumentTypeError,
    AxisError,
    DeviceError,
    DTypeError,
    IndexOutOfRangeError,
    OutOfMemoryError,
    ShapeError,
)
from . import course, dtypes
from .device import Device, as_device, default_device
from .transformer_ops import TransformerOps

_prod_any = lambda xs: reduce(operator.mul, xs, 1)  # noqa: E731


@lru_cache(maxsize=8192)
def _prod_shape(shape: tuple) -> int:
    return _prod_any(shape)


def _prod(xs) -> int:
    """The product of a shape: cached for tuples (every op asks it of the same few shapes;
    issue 13's eager-overhead profile), computed for anything else."""
    if type(xs) is tuple:
        try:
            return _prod_shape(xs)
        except TypeError:  # unhashable entries: let the product raise its own error
            pass
    return _prod_any(xs)


def _compact_strides(shape) -> tuple[int, ...]:
    try:
        return _compact_strides_of(shape if type(shape) is tuple else tuple(shape))
    except TypeError:  # unhashable entries
        return _compact_strides_of.__wrapped__(tuple(shape))


@lru_cache(maxsize=8192)
def _compact_strides_of(shape: tuple) -> tuple[int, ...]:
    stride, out = 1, []
    for dim in reversed(shape):
        out.append(stride)
        stride *= dim
    return tuple(reversed(out))


def _check_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(map(operator.index, shape))
    except TypeError:
        raise ShapeError(f"shape must be a tuple of ints, got {shape!r}") from None
    if shape and builtins.min(shape) < 0:
        raise ShapeError(f"negative dimension in shape {shape}; sizes must be >= 0")
    return shape


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """The numpy broadcast of ``shapes``, or ShapeError naming the dimensions that clash."""
    ndim = builtins.max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = {s[i - ndim + len(s)] for s in shapes if i - ndim + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ShapeError(f"shapes {' and '.join(map(str, shapes))} cannot be broadcast "
                             "together "
                             f"(dimension {i} is {sorted(dims)})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, numbers.Integral):
        axes = (axis,)
    elif isinstance(axis, (tuple, list, range)):
        axes = tuple(axis)
    else:
        raise AxisError(f"axis must be an int or a tuple of ints, got {axis!r}")
    out = []
    for ax in axes:
        if not isinstance(ax, numbers.Integral):
            raise AxisError(f"axis must be an int, got {ax!r}")
        if not -ndim <= ax < ndim:
            raise AxisError(f"axis {ax} is out of range for an array of {ndim} dimensions")
        out.append(int(ax) % ndim)
    if len(set(out)) != len(out):
        raise AxisError(f"repeated axis in {axis!r}")
    return tuple(out)


_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


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


class NDArray(TransformerOps):
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

    # --- layout --------------------------------------------------------------------------
    def is_compact(self) -> bool:
        return self._is_plain()

    def compact(self) -> NDArray:
        return self if self.is_compact() else self.copy()

    def as_strided(self, shape, strides) -> NDArray:
        """A view of this array's buffer; it must stay inside the buffer (no wild reads)."""
        shape = _check_shape(shape)
        try:
            strides = tuple(operator.index(s) for s in strides)
        except TypeError:
            raise ShapeError(f"strides must be a tuple of ints, got {strides!r}") from None
        if len(strides) != len(shape):
            raise ShapeError(f"as_strided: {len(strides)} strides for {len(shape)} dimensions")
        if _prod(shape):
            reach = [(d - 1) * s for d, s in zip(shape, strides)]
            lo = self._offset + builtins.sum(r for r in reach if r < 0)
            hi = self._offset + builtins.sum(r for r in reach if r > 0)
            if lo < 0 or hi >= self._handle.size:
                raise IndexOutOfRangeError(
                    f"as_strided: shape {shape} with strides {strides} reads elements {lo}..{hi}"
                    f" of a buffer of {self._handle.size}")
        return self._view(shape, strides)

    def _view(self, shape: tuple[int, ...], strides: tuple[int, ...],
              offset: int | None = None) -> NDArray:
        """A view of this buffer, unchecked: for shapes and strides derived from this array's
        own (permute, broadcast, reshape, indexing), which are valid by construction. Views
        are made on every op of a training step, so their cost is per-op host time."""
        arr = NDArray.__new__(NDArray)
        arr._shape, arr._strides = shape, strides
        arr._offset = self._offset if offset is None else offset
        arr._device, arr._handle = self._device, self._handle
        return arr

    def reshape(self, new_shape) -> NDArray:
        """A view with ``new_shape`` when the strides allow one, else a compact copy."""
        if isinstance(new_shape, numbers.Integral):
            new_shape = (new_shape,)
        try:
            new_shape = [operator.index(d) for d in new_shape]
        except TypeError:
            raise ShapeError(f"reshape needs a shape (an int or a tuple of ints), got "
                             f"{new_shape!r}") from None
        if new_shape.count(-1) > 1:
            raise ShapeError(f"only one dimension can be -1 in reshape, got {tuple(new_shape)}")
        if -1 in new_shape:
            known = _prod(d for d in new_shape if d != -1)
            if known == 0 or self.size % known:
                raise ShapeError(f"cannot reshape array of size {self.size} into "
                                 f"{tuple(new_shape)}")
            new_shape[new_shape.index(-1)] = self.size // known
        new_shape = _check_shape(new_shape)
        if _prod(new_shape) != self.size:
            raise ShapeError(f"cannot reshape array of shape {self.shape} (size {self.size}) "
                             f"into shape {new_shape} (size {_prod(new_shape)})")
        if self._strides == _compact_strides(self._shape):  # contiguous: no numpy probe
            return self._view(new_shape, _compact_strides(new_shape))
        strides = self._view_strides(new_shape)
        if strides is None:
            return self.compact().reshape(new_shape)
        return self._view(new_shape, strides)

    def _view_strides(self, new_shape) -> tuple[int, ...] | None:
        """Strides that read this array's elements in order under ``new_shape``, or None.

        numpy already knows when a reshape can be a view; ask it on a probe array with
        itemsize 1 whose byte strides are our element strides (no data is ever read).
        """
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), self._shape, self._strides)
        try:
            return np.reshape(probe, new_shape, copy=False).strides
        except ValueError:
            return None

    def permute(self, new_axes) -> NDArray:
        axes = _normalize_axes(new_axes, self.ndim)
        if len(axes) != self.ndim:
            raise AxisError(f"permute needs all {self.ndim} axes, got {new_axes!r}")
        return self._view(tuple(self._shape[a] for a in axes),
                          tuple(self._strides[a] for a in axes))

    def transpose(self, axes=None) -> NDArray:
        if axes is None:
            return self.permute(tuple(reversed(range(self.ndim))))
        return self.permute(axes)

    def swapaxes(self, a: int, b: int) -> NDArray:
        a, b = _normalize_axes((a, b), self.ndim) if a != b else (_normalize_axes(a, self.ndim) * 2)
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.permute(axes)

    @property
    def T(self) -> NDArray:  # noqa: N802
        return self.transpose()

    # the needle course's names (backend_ndarray/course.py)
    @property
    def flat(self) -> course.FlatView:
        """Row-major element access, as numpy's ``flat``: ``a.flat[i] += eps`` updates a."""
        return course.FlatView(self)

    def process_slice(self, sl: slice, dim: int) -> slice:
        """``sl`` with explicit start, stop and step for axis ``dim``."""
        return course.process_slice(self.shape, sl, dim)

    def broadcast_to(self, new_shape) -> NDArray:
        new_shape = _check_shape(new_shape)
        if len(new_shape) < self.ndim:
            raise ShapeError(f"cannot broadcast shape {self.shape} to fewer dimensions {new_shape}")
        lead = len(new_shape) - self.ndim
        strides = [0] * lead
        for i, (d, s) in enumerate(zip(self._shape, self._strides)):
            if d == new_shape[lead + i]:
                strides.append(s)
            elif d == 1:
                strides.append(0)
            else:
                raise ShapeError(f"cannot broadcast shape {self.shape} to {new_shape}")
        return self._view(new_shape, tuple(strides))

    def flip(self, axes=None) -> NDArray:
        axes = _normalize_axes(axes, self.ndim)
        offset, strides = self._offset, list(self._strides)
        for ax in axes:
            if self._shape[ax] > 0:
                offset += (self._shape[ax] - 1) * strides[ax]
            strides[ax] = -strides[ax]
        return self._view(self._shape, tuple(strides), offset)

    def pad(self, axes) -> NDArray:
        """Zero-pad: ``axes`` gives (before, after) for each dimension."""
        try:
            axes = tuple(tuple(operator.index(x) for x in p) for p in axes)
        except TypeError:
            axes = None
        if axes is None or len(axes) != self.ndim or any(len(p) != 2 or min(p) < 0
                                                          for p in axes):
            raise ShapeError(f"pad needs a (before, after) pair of non-negative ints for each of "
                             f"the {self.ndim} dimensions, e.g. {((0, 0),) * self.ndim}")
        out = self._empty_like(tuple(d + a + b for d, (a, b) in zip(self._shape, axes)))
        out.fill(0)
        out[tuple(slice(a, a + d) for d, (a, _) in zip(self._shape, axes))] = self
        return out

    # --- indexing ------------------------------------------------------------------------
    def _parse_index(self, idxs):
        """Turn an index into (view, squeeze_axes): basic indexing only."""
        if not isinstance(idxs, tuple):
            idxs = (idxs,)
        n_ell = builtins.sum(1 for i in idxs if i is Ellipsis)
        if n_ell > 1:
            raise IndexOutOfRangeError("an index can only have a single ellipsis ('...')")
        n_real = builtins.sum(1 for i in idxs if i is not None and i is not Ellipsis)
        if n_real > self.ndim:
            raise IndexOutOfRangeError(f"too many indices ({n_real}) for an array of "
                                       f"{self.ndim} dimensions")
        expanded = []
        for i in idxs:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (self.ndim - n_real))
            else:
                expanded.append(i)
        if not n_ell:
            expanded.extend([slice(None)] * (self.ndim - n_real))
        shape, strides, offset, dim = [], [], self._offset, 0
        for i in expanded:
            if i is None:
                shape.append(1)
                strides.append(0)
                continue
            size, stride = self._shape[dim], self._strides[dim]
            if isinstance(i, slice):
                try:
                    start, stop, step = i.indices(size)
                except (TypeError, ValueError) as e:  # a zero step, or bounds that are not ints
                    raise IndexOutOfRangeError(f"bad slice {i!r}: {e}") from None
                n = len(range(start, stop, step))
                offset += start * stride if n else 0
                shape.append(n)
                strides.append(stride * step)
            elif isinstance(i, (numbers.Integral, np.integer)) and not isinstance(i, bool):
                j = int(i)
                if not -size <= j < size:
                    raise IndexOutOfRangeError(f"index {j} is out of range for axis {dim} "
                                               f"of size {size}")
                offset += (j % size) * stride
            else:
                raise IndexOutOfRangeError(
                    f"unsupported index {i!r}: use ints, slices, None or '...' "
                    "(for lookups by an index array use take())")
            dim += 1
        return self._view(tuple(shape), tuple(strides), offset)

    def __getitem__(self, idxs) -> NDArray:
        return self._parse_index(idxs)

    def __setitem__(self, idxs, other) -> None:
        view = self._parse_index(idxs)
        # an array with a broadcast axis is read-only (as in numpy): its elements share memory,
        # so a write to one row would silently change the others, even through a sub-view
        if view.size and any(s == 0 and d > 1 for d, s in zip(self.shape, self.strides)):
            raise ShapeError(f"cannot write through a broadcast view (shape {self.shape}, "
                             f"strides {self.strides}): its elements share memory, so the "
                             "write would land in one place; write into a .compact() copy")
        if isinstance(other, NDArray):
            self._check_device(other)
            src = other.astype(self.dtype)
            if src.shape != view.shape:
                src = src.broadcast_to(view.shape)
            src = src.compact()
            self._be.ewise_setitem(src._handle, self._handle, view.shape, view.strides,
                                   view.offset)
        elif isinstance(other, (numbers.Number, np.generic)):
            self._be.scalar_setitem(view.size, other, self._handle, view.shape, view.strides,
                                    view.offset)
        else:
            self[idxs] = NDArray(np.asarray(other), device=self.device, dtype=self.dtype)

    # --- elementwise ---------------------------------------------------------------------
    def _check_device(self, other: NDArray) -> None:
        if other.device != self.device:
            raise DeviceError(f"arrays are on different devices ({self.device.name} and "
                              f"{other.device.name}); move one with .to(device)")

    def _fresh(self, shape: tuple[int, ...], dtype: str) -> NDArray:
        """A new compact array on this device; the hot path's lean ``make`` (no checks)."""
        arr = NDArray.__new__(NDArray)
        arr._shape, arr._strides, arr._offset = shape, _compact_strides(shape), 0
        arr._device = self._device
        arr._handle = self._device.backend.Array(_prod(shape), dtype)
        return arr

    def _is_plain(self) -> bool:
        """Compact and starting at the buffer's first element (cheap form of is_compact)."""
        return self._offset == 0 and self._handle.size == _prod(self._shape) and (
            self._strides == _compact_strides(self._shape))

    def _binary(self, other, name: str, dtype_rule=None, out_dtype=None) -> NDArray:
        """Promote, broadcast and compact both sides, then call ewise_/scalar_ ``name``."""
        if type(other) is NDArray:
            dt = self._handle.dtype
            if (other._device is self._device and other._shape == self._shape
                    and other._handle.dtype == dt and (dtype_rule is None or dtype_rule(dt) == dt)
                    and self._is_plain() and other._is_plain()):  # the common case, fast
                out = self._fresh(self._shape, out_dtype or dt)
                getattr(self._device.backend, "ewise_" + name)(self._handle, other._handle,
                                                               out._handle)
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
