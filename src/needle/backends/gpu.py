"""The array API (design §3) for every GPU, written once against the HAL.

``GpuBackend(device)`` implements each function of ``numpy_ref`` with the same name,
signature and meaning, by launching the kernels named in docs/kernels.md on the device's
queue. Everything here is generic: a backend supplies a ``hal.Device`` (queue, allocator,
executable cache) and kernel files that follow the ABI, and gets the whole array API.

Work is asynchronous: functions enqueue and return; only ``to_numpy`` and
``synchronize`` wait. Temporary workspaces go back to the pool as soon as their launches
are queued, which is safe because one queue runs everything in order.
"""

from __future__ import annotations

import math
import os
import struct
from functools import lru_cache

import numpy as np

from ..backend_ndarray.dtypes import ITEMSIZE, to_numpy_dtype
from ..errors import DeviceError, DTypeError, ShapeError
from ..hal import Buffer, Device, dlpack

SUFFIX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
          "int32": "i32", "int64": "i64", "bool": "b8"}
FLOATS = ("float16", "bfloat16", "float32", "float64")
_SCALAR = {"float16": "f", "bfloat16": "f", "float32": "f", "float64": "d", "int32": "i",
           "int64": "q", "bool": "i"}


def _padded(fmt: str) -> struct.Struct:
    """A params struct (native alignment, as C lays it out) padded to a multiple of 8."""
    size = struct.calcsize(fmt)
    return struct.Struct(fmt + "x" * (-size % 8))


_N = struct.Struct("q")
_S = {dt: _padded("q" + code) for dt, code in _SCALAR.items()}  # SParams
_STRIDED = "qqq8q8q8I8I"
_STRIDED_S = {dt: _padded(_STRIDED + code) for dt, code in _SCALAR.items()}
_TAKE = struct.Struct("qqq")
_TRANSPOSE = struct.Struct("5q")
_REDUCE = struct.Struct("5q")
_MATMUL = struct.Struct("10q")
_ROW = struct.Struct("qq")
_NORM = {dt: _padded("qq" + _SCALAR[dt]) for dt in FLOATS}
_ROPE = struct.Struct("4q")
_ATTN = _padded("9qfif")
_DECODE = _padded("7qff")  # attention_decode: heads, kv heads, head dim, capacity, table rows,
#                            splits, chunk, scale (hi + lo: Metal has no double)
_ADAM = {dt: _padded("qq" + _SCALAR[dt] * 7) for dt in FLOATS}  # optim.cu's AdamParams
_SGD = {dt: _padded("qq" + _SCALAR[dt] * 4) for dt in FLOATS}  # SgdParams
_SGD_MOMENTUM, _SGD_FIRST, _SGD_NESTEROV, _SGD_DAMPENED = 1, 2, 4, 8
MAX_DIMS = 8
_MAX_GRID_YZ = 65535


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int_wrap(value, bits: int) -> int:
    v = int(value) & ((1 << bits) - 1)
    return v - (1 << bits) if v >> (bits - 1) else v


def _scalar(dtype: str, value):
    """``value`` as the kernel's scalar param type for ``dtype`` (docs/kernels.md §1)."""
    if dtype == "bool":
        return int(bool(value))
    if dtype == "int32":
        return _int_wrap(value, 32)
    if dtype == "int64":
        return _int_wrap(value, 64)
    value = float(value)
    if dtype != "float64" and math.isfinite(value) and abs(value) > 3.4028234663852886e38:
        return float(np.float32(value))  # numpy's overflow to +-inf, which struct refuses
    return value


@lru_cache(maxsize=4096)
def _magic(d: int) -> tuple[int, int]:
    """(magic, shift) with floor(i / d) == (mulhi(i, magic) + i) >> shift for i < 2^31."""
    if not 0 < d < 2**31:
        return 1, 0
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _aligned16(buffer: Buffer) -> bool:
    """Whether a buffer starts 16-byte aligned (CUDA handles are addresses; Metal buffers
    are page-aligned, so only their offset counts)."""
    base = buffer.handle if isinstance(buffer.handle, int) else 0
    return (base + buffer.offset) % 16 == 0


def _simplify(shape, strides) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop size-1 dimensions and merge dimensions that are contiguous with each other."""
    dims = [(d, s) for d, s in zip(shape, strides) if d != 1]
    if not dims:
        return (1,), (1,)
    out = [dims[0]]
    for d, s in dims[1:]:
        pd, ps = out[-1]
        if ps == s * d:
            out[-1] = (pd * d, s)
        else:
            out.append((d, s))
    return tuple(d for d, _ in out), tuple(s for _, s in out)


class GpuArray:
    """A flat buffer of ``size`` elements of ``dtype`` in device memory."""

    __slots__ = ("buffer", "size", "dtype", "__weakref__")

    def __init__(self, buffer: Buffer, size: int, dtype: str):
        self.buffer = buffer
        self.size = size
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"GpuArray({self.size} x {self.dtype})"


def _unary_op(op: str, dtypes):
    names = {dt: f"ewise_{op}_{SUFFIX[dt]}" for dt in dtypes}

    def ewise(self, a: GpuArray, out: GpuArray) -> None:
        self._map(names[self._need(a.dtype, names, op)], out.size, a.dtype, out.dtype,
                  (a.buffer, out.buffer), _N.pack(out.size))

    ewise.__name__ = ewise.__qualname__ = f"ewise_{op}"
    return ewise


def _binary_op(op: str, dtypes, compare: bool = False):
    names = {dt: f"ewise_{op}_{SUFFIX[dt]}" for dt in dtypes}
    snames = {dt: f"scalar_{op}_{SUFFIX[dt]}" for dt in dtypes}

    def ewise(self, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        self._map(names[self._need(a.dtype, names, op)], out.size, a.dtype, out.dtype,
                  (a.buffer, b.buffer, out.buffer), _N.pack(out.size))

    def scalar(self, a: GpuArray, value, out: GpuArray) -> None:
        dt = self._need(a.dtype, snames, op)
        self._map(snames[dt], out.size, a.dtype, out.dtype, (a.buffer, out.buffer),
                  _S[dt].pack(out.size, _scalar(dt, value)))

    ewise.__name__ = ewise.__qualname__ = f"ewise_{op}"
    scalar.__name__ = scalar.__qualname__ = f"scalar_{op}"
    return ewise, scalar


_NUMBERS = FLOATS + ("int32", "int64")
_ALL = _NUMBERS + ("bool",)


class GpuBackend:
    """The array API over one HAL device. One instance per device."""

    def __init__(self, device: Device, name: str):
        self.device = device
        self.name = name
        self.queue = device.queue
        self.allocator = device.allocator
        self._kernels: dict[str, object] = {}
        self._geometry: dict[str, tuple] = {}
        self.Array = self._new_array

    # --- plumbing ------------------------------------------------------------------------
    def _kernel(self, family: str, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self.device.executables.kernel(family, name)
        return k

    @staticmethod
    def _need(dtype: str, names: dict, op: str) -> str:
        if dtype not in names:
            raise DTypeError(f"{op} is not defined for {dtype} arrays on the GPU")
        return dtype

    def _new_array(self, size: int, dtype: str = "float32") -> GpuArray:
        if dtype not in self.device.dtypes:
            raise DTypeError(f"{dtype} is not supported on {self.device.name}: its hardware has "
                             f"no {dtype}; use float32 instead")
        return GpuArray(self.allocator.allocate(size * ITEMSIZE[dtype]), size, dtype)

    def _workspace(self, nbytes: int) -> Buffer:
        return self.allocator.allocate(nbytes)

    def _geometry_1d(self, name: str, family: str) -> tuple:
        """(kernel, threads per group, resident groups) of a 1-d kernel, cached: the hot path
        of every small op."""
        k = self._kernel(family, name)
        t = k.preferred_threads
        g = self._geometry[name] = (k, t, k.resident_groups(t))
        return g

    def _launch_1d(self, name: str, work: int, buffers, params: bytes, family: str) -> None:
        """A grid-stride launch covering ``work`` loop iterations (docs/kernels.md §3)."""
        k, t, resident = self._geometry.get(name) or self._geometry_1d(name, family)
        groups = min(-(-work // t), resident) or 1
        self.queue.dispatch(k, (groups, 1, 1), (t, 1, 1), buffers, params)

    def _map(self, name: str, n: int, in_dtype: str, out_dtype: str, buffers, params) -> None:
        if n:
            width = 16 // max(ITEMSIZE[in_dtype], ITEMSIZE[out_dtype])
            k, t, resident = self._geometry.get(name) or self._geometry_1d(name, "elementwise")
            groups = min(-(-n // (width * t)), resident) or 1
            self.queue.dispatch(k, (groups, 1, 1), (t, 1, 1), buffers, params)

    def _row_geometry(self, kernel, dim: int) -> tuple[int, int]:
        """(TX, TY) for a row kernel: enough threads per row for ~8 elements each."""
        limit = kernel.max_threads
        tx = 32
        while tx * 8 < dim and tx * 2 <= limit:
            tx *= 2
        ty = max(1, min(256, limit) // tx)
        return tx, ty

    # --- memory --------------------------------------------------------------------------
    def from_numpy(self, a: np.ndarray, out: GpuArray) -> None:
        src = np.ascontiguousarray(a, dtype=to_numpy_dtype(out.dtype)).reshape(-1)
        self.queue.copy_from_host(out.buffer, 0, src)

    def _contiguous(self, a: GpuArray, shape, strides, offset, size: int):
        """(array, byte offset) where ``a``'s strided elements lie contiguously: ``a`` itself,
        or a compact copy of them made on the device."""
        if self._is_contiguous(shape, strides):
            return a, offset * ITEMSIZE[a.dtype]
        tmp = self._new_array(size, a.dtype)
        self.compact(a, tmp, shape, strides, offset)
        return tmp, 0

    def to_numpy(self, a: GpuArray, shape, strides, offset) -> np.ndarray:
        result = np.empty(tuple(shape), dtype=to_numpy_dtype(a.dtype))
        if result.size:
            src, start = self._contiguous(a, shape, strides, offset, result.size)
            self.queue.copy_to_host(src.buffer, start, result.reshape(-1))
        return result

    def to_numpy_later(self, a: GpuArray, shape, strides, offset):
        """Start ``to_numpy``; returns a function that waits for the copy and returns it."""
        dtype = to_numpy_dtype(a.dtype)
        size = int(np.prod(shape, dtype=np.int64))
        if not size:
            return lambda: np.empty(tuple(shape), dtype)
        src, start = self._contiguous(a, shape, strides, offset, size)
        read = self.queue.copy_to_host_later(src.buffer, start, size * ITEMSIZE[a.dtype])
        return lambda: read().view(dtype).reshape(tuple(shape))

    @staticmethod
    def _is_contiguous(shape, strides) -> bool:
        s = _simplify(shape, strides)
        return len(s[0]) == 1 and s[1][0] == 1

    def fill(self, out: GpuArray, value) -> None:
        self._fill(out.buffer, out.size, out.dtype, value)

    def _fill(self, buffer: Buffer, n: int, dtype: str, value) -> None:
        if n:
            self._launch_1d(f"fill_{SUFFIX[dtype]}", _cdiv(n, 16 // ITEMSIZE[dtype]),
                            (buffer,), _S[dtype].pack(n, _scalar(dtype, value)), "elementwise")

    def synchronize(self) -> None:
        self.queue.synchronize()

    # --- layout --------------------------------------------------------------------------
    def _strided(self, name: str, buffers, shape, strides, offset, n: int, extra=None) -> None:
        nd = len(shape)
        dims = list(shape) + [1] * (MAX_DIMS - nd)
        steps = list(strides) + [0] * (MAX_DIMS - nd)
        magic = [_magic(d) for d in dims]
        values = [n, offset, nd, *dims, *steps, *[m for m, _ in magic], *[s for _, s in magic]]
        if extra is None:
            params = struct.pack(_STRIDED, *values)
        else:
            dtype, value = extra
            params = _STRIDED_S[dtype].pack(*values, _scalar(dtype, value))
        self._launch_1d(name, n, buffers, params, "layout")

    def _views(self, shape, strides, offset, dense: GpuArray):
        """Split a view of more than MAX_DIMS dimensions along its leading axes: yields
        (shape, strides, offset, dense_buffer_view) pieces of at most MAX_DIMS dims."""
        if len(shape) <= MAX_DIMS:
            yield shape, strides, offset, dense.buffer
            return
        inner = math.prod(shape[1:])
        item = ITEMSIZE[dense.dtype]
        for i in range(shape[0]):
            sub = GpuArray(dense.buffer.view(i * inner * item, inner * item), inner, dense.dtype)
            yield from self._views(shape[1:], strides[1:], offset + i * strides[0], sub)

    def compact(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = _simplify(shape, strides)
        item = ITEMSIZE[a.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self.queue.copy(a.buffer, offset * item, out.buffer, 0, n * item)
            return
        if ("transpose" in self.device.features and len(shape) in (2, 3)
                and strides[-2] == 1 and strides[-1] == shape[-2]
                and (len(shape) == 2 or shape[0] <= _MAX_GRID_YZ)
                and _cdiv(shape[-2], 32) <= _MAX_GRID_YZ):
            self._transpose(a, out, shape, strides, offset)
            return
        name = f"compact_{SUFFIX[a.dtype]}"
        for sh, st, off, dense in self._views(shape, strides, offset, out):
            self._strided(name, (a.buffer, dense), sh, st, off, math.prod(sh))

    def _transpose(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> None:
        """compact() of transposed matrices: (count, rows, cols) from (cols, rows) storage."""
        count, batch_stride = (shape[0], strides[0]) if len(shape) == 3 else (1, 0)
        rows, cols = shape[-2:]
        k = self._kernel("layout", f"transpose_{SUFFIX[a.dtype]}")
        ty = max(1, min(8, k.max_threads // 32))
        self.queue.dispatch(k, (_cdiv(cols, 32), _cdiv(rows, 32), count), (32, ty, 1),
                            (a.buffer, out.buffer),
                            _TRANSPOSE.pack(count, rows, cols, batch_stride, offset))

    def ewise_setitem(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = _simplify(shape, strides)
        item = ITEMSIZE[out.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self.queue.copy(a.buffer, 0, out.buffer, offset * item, n * item)
            return
        name = f"setitem_{SUFFIX[out.dtype]}"
        for sh, st, off, dense in self._views(shape, strides, offset, a):
            self._strided(name, (dense, out.buffer), sh, st, off, math.prod(sh))

    def scalar_setitem(self, size: int, value, out: GpuArray, shape, strides, offset) -> None:
        n = math.prod(shape)
        if n == 0:
            return
        shape, strides = _simplify(shape, strides)
        item = ITEMSIZE[out.dtype]
        if len(shape) == 1 and strides[0] == 1:
            self._fill(out.buffer.view(offset * item, n * item), n, out.dtype, value)
            return
        name = f"scalar_setitem_{SUFFIX[out.dtype]}"
        if len(shape) > MAX_DIMS:  # split on the leading axis; no dense side to offset
            for i in range(shape[0]):
                self.scalar_setitem(0, value, out, shape[1:], strides[1:],
                                    offset + i * strides[0])
            return
        self._strided(name, (out.buffer,), shape, strides, offset, n, (out.dtype, value))

    # --- elementwise ---------------------------------------------------------------------
    ewise_add, scalar_add = _binary_op("add", _NUMBERS)
    ewise_sub, scalar_sub = _binary_op("sub", _NUMBERS)
    ewise_mul, scalar_mul = _binary_op("mul", _NUMBERS)
    ewise_div, scalar_div = _binary_op("div", _NUMBERS)
    ewise_power, scalar_power = _binary_op("power", _NUMBERS)
    ewise_maximum, scalar_maximum = _binary_op("maximum", _NUMBERS)
    ewise_minimum, scalar_minimum = _binary_op("minimum", _NUMBERS)
    ewise_eq, scalar_eq = _binary_op("eq", _ALL)
    ewise_ne, scalar_ne = _binary_op("ne", _ALL)
    ewise_lt, scalar_lt = _binary_op("lt", _ALL)
    ewise_le, scalar_le = _binary_op("le", _ALL)
    ewise_gt, scalar_gt = _binary_op("gt", _ALL)
    ewise_ge, scalar_ge = _binary_op("ge", _ALL)

    ewise_neg = _unary_op("neg", _NUMBERS)
    ewise_abs = _unary_op("abs", _NUMBERS)
    ewise_relu = _unary_op("relu", _NUMBERS)
    ewise_exp = _unary_op("exp", FLOATS)
    ewise_log = _unary_op("log", FLOATS)
    ewise_sqrt = _unary_op("sqrt", FLOATS)
    ewise_rsqrt = _unary_op("rsqrt", FLOATS)
    ewise_sin = _unary_op("sin", FLOATS)
    ewise_cos = _unary_op("cos", FLOATS)
    ewise_tanh = _unary_op("tanh", FLOATS)
    ewise_sigmoid = _unary_op("sigmoid", FLOATS)
    ewise_silu = _unary_op("silu", FLOATS)
    ewise_gelu = _unary_op("gelu", FLOATS)

    def ewise_cast(self, a: GpuArray, out: GpuArray) -> None:
        """Convert ``a`` to ``out.dtype`` (floats to ints truncate toward zero)."""
        if a.dtype == out.dtype:
            self.queue.copy(a.buffer, 0, out.buffer, 0, a.size * ITEMSIZE[a.dtype])
            return
        self._map(f"cast_{SUFFIX[a.dtype]}_{SUFFIX[out.dtype]}", out.size, a.dtype, out.dtype,
                  (a.buffer, out.buffer), _N.pack(out.size))

    def where(self, cond: GpuArray, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        if out.size:
            self._launch_1d(f"where_{SUFFIX[out.dtype]}", out.size,
                            (cond.buffer, a.buffer, b.buffer, out.buffer), _N.pack(out.size),
                            "elementwise")

    def silu_mul(self, a: GpuArray, b: GpuArray, out: GpuArray) -> None:
        """out = silu(a) * b (SwiGLU's gate)."""
        self._need(a.dtype, FLOATS, "silu_mul")
        self._map(f"silu_mul_{SUFFIX[a.dtype]}", out.size, a.dtype, out.dtype,
                  (a.buffer, b.buffer, out.buffer), _N.pack(out.size))

    def _counters(self, n: int) -> Buffer:
        """n zeroed 32-bit counters that kernels using them leave zeroed (kept, not pooled)."""
        have = getattr(self, "_counter_array", None)
        if have is None or have.size < n:
            have = self._counter_array = self._new_array(max(n, 64), "int32")
            self.fill(have, 0)
        return have.buffer

    def swiglu(self, x: GpuArray, out: GpuArray, dim: int) -> None:
        """out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim)."""
        self._need(x.dtype, FLOATS, "swiglu")
        if out.size:
            self._launch_1d(f"swiglu_{SUFFIX[x.dtype]}", out.size, (x.buffer, out.buffer),
                            _ROW.pack(out.size, dim), "nn")

    # --- reductions ----------------------------------------------------------------------
    def _reduce(self, op: str, a: GpuArray, out: GpuArray, outer: int, reduce_size: int,
                inner: int) -> None:
        if op != "sum" and op != "argmax" and a.dtype == "bool":
            raise DTypeError(f"reduce_{op} is not defined for bool arrays on the GPU")
        sfx = SUFFIX[a.dtype]
        acc = _ACC_BYTES[(op, a.dtype)]
        cu = self.device.compute_units
        if inner == 1:
            k = self._kernel("reduce", f"reduce_rows_{op}_{sfx}")
            ty = max(1, min(8, k.max_threads // 32))
            splits = 1  # split only long rows that too few warps share (one launch otherwise)
            if outer < cu * 16 and reduce_size >= 8192:
                splits = min(_cdiv(cu * 32, outer), _cdiv(reduce_size, 4096), _MAX_GRID_YZ)
            chunk = _cdiv(_cdiv(reduce_size, splits), 16) * 16  # keeps 16-byte alignment
            splits = _cdiv(reduce_size, chunk)
            groups, shared = (_cdiv(outer, ty), splits, 1), 0
        else:
            k = self._kernel("reduce", f"reduce_cols_{op}_{sfx}")
            ty = max(1, min(32, k.max_threads // 32, reduce_size))  # no idle rows of threads
            blocks = _cdiv(inner, 32) * outer
            splits = 1  # split only when few groups each walk a long column
            if blocks * ty < cu * 16 and reduce_size >= 256 * ty:
                splits = min(_cdiv(cu * 16, blocks * ty), _cdiv(reduce_size, 64 * ty),
                             _MAX_GRID_YZ)
            chunk = _cdiv(reduce_size, splits)
            splits = _cdiv(reduce_size, chunk)
            groups, shared = (blocks, splits, 1), 32 * ty * (acc + 8)
        part_val = part_idx = out.buffer
        if splits > 1:
            part_val = self._workspace(outer * splits * inner * acc)
            part_idx = self._workspace(outer * splits * inner * 8) if op == "argmax" else part_val
        params = _REDUCE.pack(outer, reduce_size, inner, splits, chunk)
        self.queue.dispatch(k, groups, (32, ty, 1), (a.buffer, out.buffer, part_val, part_idx),
                            params, shared)
        if splits > 1:
            kc = self._kernel("reduce", f"reduce_combine_{op}_{sfx}")
            tyc = max(1, min(8, kc.max_threads // 32))
            self.queue.dispatch(kc, (_cdiv(outer * inner, tyc), 1, 1), (32, tyc, 1),
                                (part_val, part_idx, out.buffer), params)

    def reduce_sum(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("sum", a, out, outer, reduce_size, inner)

    def reduce_max(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("max", a, out, outer, reduce_size, inner)

    def reduce_min(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("min", a, out, outer, reduce_size, inner)

    def reduce_argmax(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        """Index of the first maximum (NaN counts as the maximum); ``out`` is int64."""
        self._reduce("argmax", a, out, outer, reduce_size, inner)

    # --- matmul --------------------------------------------------------------------------
    def matmul(self, a: GpuArray, b: GpuArray, out: GpuArray, m: int, n: int, p: int, *,
               batch: int = 1, stride_a: int | None = None, stride_b: int | None = None,
               transpose_a: bool = False, transpose_b: bool = False) -> None:
        """out[i] = A[i] @ B[i] (see numpy_ref.matmul for the layout of a, b and out)."""
        if out.size == 0:
            return
        dt = a.dtype
        if dt == "bool":
            raise DTypeError("matmul is not defined for bool arrays")
        stride_a = m * n if stride_a is None else stride_a
        stride_b = n * p if stride_b is None else stride_b
        if n == 0:
            self.fill(out, 0)
            return
        if m == 1 and batch == 1 and dt in ("float16", "bfloat16", "float32"):
            self._gemv(a, b, out, n, p, transpose_b)
            return
        width = 16 // ITEMSIZE[dt]
        if (m <= 8 and not transpose_a and not transpose_b and "skinny" in self.device.features
                and dt in ("float16", "bfloat16", "float32") and p % width == 0
                and stride_b % width == 0 and _aligned16(b.buffer)):
            self._skinny(a, b, out, m, n, p, batch, stride_a, stride_b)
            return
        tc = (dt in ("float16", "bfloat16") and n % 8 == 0 and p % 8 == 0
              and (batch == 1 or stride_a % 8 == 0 and stride_b % 8 == 0)
              # the tensor-core pipeline's stages must fit in shared memory (not in Metal's)
              and self._tc_stages() * (128 * 32 + 32 * 128) * 2 <= self.device.max_shared_bytes
              and _aligned16(a.buffer) and _aligned16(b.buffer))
        if tc and "wgmma" in self.device.features:
            self._wgmma(a, b, out, m, n, p, batch, stride_a, stride_b, transpose_a, transpose_b)
            return
        if tc and (transpose_a or transpose_b):
            # the tensor-core kernel reads both operands untransposed: transpose on device
            a, stride_a = self._untranspose(a, m, n, batch, stride_a, transpose_a)
            b, stride_b = self._untranspose(b, n, p, batch, stride_b, transpose_b)
            transpose_a = transpose_b = False
        if tc:
            wide = os.environ.get("NEEDLE_TC_TILE", "128") == "256"
            bn = 256 if wide else 128
            name = f"matmul_tc{'256' if wide else ''}_{SUFFIX[dt]}"
            shared = self._tc_stages() * (128 * 32 + 32 * bn) * 2
            self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                               (128, bn), 256, shared, transpose_a, transpose_b)
        elif dt == "float32":
            layout = ("t" if transpose_a else "n") + ("t" if transpose_b else "n")
            name = f"matmul_{layout}_f32"
            splits, chunk = self._split_k(m, n, p, batch, 128, 128, 16)
            if splits == 1 or batch > _MAX_GRID_YZ // splits:
                self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a,
                                   stride_b, (128, 128), 256, 0, transpose_a, transpose_b)
                return
            # too few tiles to fill the GPU: split K over more groups, then sum the slabs
            part = GpuArray(self._workspace(splits * batch * m * p * 4), splits * batch * m * p,
                            "float32")
            k = self._kernel("matmul", name)
            params = _MATMUL.pack(m, n, p, batch, stride_a, stride_b, int(transpose_a),
                                  int(transpose_b), splits, chunk)
            self.queue.dispatch(k, (_cdiv(p, 128), _cdiv(m, 128), splits * batch), (256, 1, 1),
                                (a.buffer, b.buffer, part.buffer), params)
            self._reduce("sum", part, out, 1, splits, batch * m * p)
        else:
            self._matmul_tiles("matmul", f"matmul_{SUFFIX[dt]}", a, b, out, m, n, p, batch,
                               stride_a, stride_b, (16, 16), (16, 16), 0, transpose_a,
                               transpose_b)

    def _wgmma(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> None:
        """Hopper warpgroup MMA: A as (m, n) row-major; B as (p, n) row-major (K-major), or,
        for the TMA kernel only, as (n, p) row-major (N-major: A @ B needs no copy of B)."""
        a, stride_a = self._untranspose(a, m, n, batch, stride_a, ta)
        # TMA: operands at least one box (128 x 64 of A, 256 x 64 of B) large, so no box
        # overhangs a whole dimension; smaller products are better served by 128-wide tiles
        if ("tma" in self.device.features and os.environ.get("NEEDLE_GEMM") != "wgmma"
                and m >= 128 and p >= 256 and n >= 64
                and (batch == 1 or stride_a >= m * n and stride_b >= p * n)
                and _aligned16(a.buffer) and _aligned16(b.buffer)
                and self._tma_gemm(a, b, out, m, n, p, batch, stride_a, stride_b, tb)):
            return
        b, stride_b = self._untranspose(b, p, n, batch, stride_b, not tb)
        tile = os.environ.get("NEEDLE_WGMMA_TILE")
        wide = _cdiv(m, 128) * _cdiv(p, 256) * batch >= self.device.compute_units
        nsub = 2 if tile == "256" or (tile is None and wide) else 1  # small: more groups
        name = f"matmul_wgmma{'128' if nsub == 1 else ''}_{SUFFIX[a.dtype]}"
        shared = self._wg_stages() * (128 + 128 * nsub) * 64 * 2 + 1024
        self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                           (128, 128 * nsub), 256, shared, False, True)

    def _tma_gemm(self, a, b, out, m, n, p, batch, stride_a, stride_b, tb: bool) -> bool:
        """Feature "tma" (gemm_tma.cu): 128x256 tiles, a TMA producer warpgroup and two wgmma
        consumer warpgroups; A (m, n) row-major, B (p, n) row-major when ``tb`` (K-major:
        matmul_tma) or (n, p) row-major (N-major: matmul_tma_nn), described by tensor maps.
        False (nothing launched) when the operands cannot be described: use another kernel."""
        from .cuda.tensor_map import matrix_map

        stages = 4
        for opt in os.environ.get("NEEDLE_CUDA_OPTIONS", "").split():
            if opt.startswith("-DGEMM_TMA_STAGES="):
                stages = int(opt.split("=", 1)[1])
        shared = stages * (128 + 256) * 64 * 2 + 16 * stages + 1024
        if shared > self.device.max_shared_bytes:
            return False
        item = ITEMSIZE[a.dtype]
        launches = []
        try:
            for z0 in range(0, batch, _MAX_GRID_YZ):
                nb = min(_MAX_GRID_YZ, batch - z0)
                av = a.buffer if z0 == 0 else a.buffer.view(z0 * stride_a * item, 0)
                bv = b.buffer if z0 == 0 else b.buffer.view(z0 * stride_b * item, 0)
                ov = out.buffer if z0 == 0 else out.buffer.view(z0 * m * p * item, 0)
                b_map = (matrix_map(b.dtype, bv.handle + bv.offset, p, n, nb, stride_b, 256)
                         if tb else  # N-major: boxes of 64 k-rows x 64 columns
                         matrix_map(b.dtype, bv.handle + bv.offset, n, p, nb, stride_b, 64))
                maps = (matrix_map(a.dtype, av.handle + av.offset, m, n, nb, stride_a, 128),
                        b_map)
                launches.append((nb, (av, bv, ov), maps))
        except DeviceError:
            return False
        k = self._kernel("gemm_tma", f"matmul_tma_{'' if tb else 'nn_'}{SUFFIX[a.dtype]}")
        k.check_threads(384)
        k.reserve_shared(shared)
        tiles = _cdiv(m, 128) * _cdiv(p, 256)  # one grid axis: the kernel orders the tiles
        for nb, bufs, maps in launches:
            params = _MATMUL.pack(m, n, p, nb, stride_a, stride_b, 0, int(tb), 1, 0)
            self.queue.dispatch(k, (tiles, 1, nb), (384, 1, 1), bufs, params, shared,
                                raw_args=maps)
        return True

    def _wg_stages(self) -> int:
        for opt in os.environ.get("NEEDLE_CUDA_OPTIONS", "").split():
            if opt.startswith("-DWG_STAGES="):
                return int(opt.split("=", 1)[1])
        return 4

    def _split_k(self, m: int, n: int, p: int, batch: int, bm: int, bn: int,
                 bk: int) -> tuple[int, int]:
        """(splits, chunk) of the reduced dimension when the output tiles alone would leave
        most of the GPU idle (a 512x1024 product has 32 tiles for 132 SMs)."""
        tiles = _cdiv(m, bm) * _cdiv(p, bn) * batch
        target = 2 * self.device.compute_units
        if "split_k" not in self.device.features or tiles >= self.device.compute_units \
                or n < 512:
            return 1, n
        splits = min(_cdiv(target, tiles), n // 256)
        chunk = _cdiv(_cdiv(n, max(splits, 1)), bk) * bk
        return _cdiv(n, chunk), chunk

    def _tc_stages(self) -> int:
        for opt in os.environ.get("NEEDLE_CUDA_OPTIONS", "").split():
            if opt.startswith("-DTC_STAGES="):
                return int(opt.split("=", 1)[1])
        return 4

    def _untranspose(self, x: GpuArray, rows: int, cols: int, batch: int, stride: int,
                     transposed: bool) -> tuple[GpuArray, int]:
        """The (rows, cols) row-major copies of matrices stored transposed (cols, rows)."""
        if not transposed:
            return x, stride
        count = 1 if stride == 0 else batch
        out = self._new_array(count * rows * cols, x.dtype)
        shape, strides = (count, rows, cols), (stride, 1, rows)
        self.compact(x, out, shape, strides, 0)
        return out, (0 if stride == 0 else rows * cols)

    def _matmul_tiles(self, family, name, a, b, out, m, n, p, batch, stride_a, stride_b,
                      tile, threads, shared, ta, tb) -> None:
        k = self._kernel(family, name)
        threads = (threads, 1, 1) if isinstance(threads, int) else (*threads, 1)
        k.check_threads(threads[0] * threads[1])
        if shared:
            k.reserve_shared(shared)
        item = ITEMSIZE[a.dtype]
        gx, gy = _cdiv(p, tile[1]), _cdiv(m, tile[0])
        if gy > _MAX_GRID_YZ:
            raise ShapeError(f"matmul with {m} rows exceeds the GPU grid; split the batch")
        for z0 in range(0, batch, _MAX_GRID_YZ):
            nb = min(_MAX_GRID_YZ, batch - z0)
            av = a.buffer if z0 == 0 else a.buffer.view(z0 * stride_a * item, 0)
            bv = b.buffer if z0 == 0 else b.buffer.view(z0 * stride_b * item, 0)
            ov = out.buffer if z0 == 0 else out.buffer.view(z0 * m * p * item, 0)
            params = _MATMUL.pack(m, n, p, nb, stride_a, stride_b, int(ta), int(tb), 1, 0)
            self.queue.dispatch(k, (gx, gy, nb), threads, (av, bv, ov), params, shared)

    def _skinny(self, a, b, out, m: int, n: int, p: int, batch: int, stride_a: int,
                stride_b: int) -> None:
        """A few rows times (n, p) matrices (feature "skinny"): bandwidth-bound, so B is read
        once, by groups of 256 threads over 8 column groups of 16 bytes and a slice of k;
        the slices' float32 partial sums are added by ``gemv_combine``."""
        sfx = SUFFIX[a.dtype]
        k = self._kernel("matmul", f"matmul_skinny_{sfx}")
        k.check_threads(256)
        gx = _cdiv(p // (16 // ITEMSIZE[a.dtype]), 8)
        if batch > _MAX_GRID_YZ:
            raise ShapeError(f"matmul with a batch of {batch} exceeds the GPU grid")
        # about two groups per SM, each thread at least one round of 8 loads (256 rows of k)
        splits = max(1, min(_cdiv(2 * self.device.compute_units, gx * batch), _cdiv(n, 256),
                            _MAX_GRID_YZ))
        chunk = _cdiv(n, splits)
        splits = _cdiv(n, chunk)
        part = self._workspace(splits * batch * m * p * 4) if splits > 1 else out.buffer
        params = _MATMUL.pack(m, n, p, batch, stride_a, stride_b, 0, 0, splits, chunk)
        self.queue.dispatch(k, (gx, splits, batch), (256, 1, 1),
                            (a.buffer, b.buffer, out.buffer, part), params)
        if splits > 1:
            combine = _MATMUL.pack(1, n, batch * m * p, 1, 0, 0, 0, 0, splits, chunk)
            self._launch_1d(f"gemv_combine_{sfx}", batch * m * p, (part, out.buffer), combine,
                            "matmul")

    def _gemv(self, a: GpuArray, b: GpuArray, out: GpuArray, n: int, p: int,
              transpose_b: bool) -> None:
        sfx = SUFFIX[a.dtype]
        if transpose_b:
            k = self._kernel("matmul", f"gemv_t_{sfx}")
            ty = max(1, min(4, k.max_threads // 32))  # small groups: 256 rows still span 64 SMs
            params = _MATMUL.pack(1, n, p, 1, 0, 0, 0, 1, 1, n)
            self.queue.dispatch(k, (_cdiv(p, ty), 1, 1), (32, ty, 1),
                                (a.buffer, b.buffer, out.buffer), params)
            return
        k = self._kernel("matmul", f"gemv_n_{sfx}")
        ty = max(1, min(8, k.max_threads // 32))
        width = 16 // ITEMSIZE[a.dtype]
        gx = _cdiv(p, 32 * width)
        splits = max(1, min(_cdiv(self.device.compute_units * 4, gx), _cdiv(n, 8 * ty),
                            _MAX_GRID_YZ))
        chunk = _cdiv(n, splits)
        splits = _cdiv(n, chunk)
        part = self._workspace(splits * p * 4)
        params = _MATMUL.pack(1, n, p, 1, 0, 0, 0, 0, splits, chunk)
        self.queue.dispatch(k, (gx, splits, 1), (32, ty, 1), (a.buffer, b.buffer, part),
                            params, ty * 32 * width * 4)
        self._launch_1d(f"gemv_combine_{sfx}", p, (part, out.buffer), params, "matmul")

    # --- indexing ------------------------------------------------------------------------
    def _rows_launch(self, family: str, name: str, n_rows: int, dim: int, width: int,
                     buffers, params) -> None:
        """A group per row (group-stride), its threads across the row."""
        k = self._kernel(family, name)
        t = max(32, min(k.preferred_threads, _cdiv(_cdiv(dim, width), 32) * 32))
        groups = max(1, min(n_rows, k.resident_groups(t)))
        self.queue.dispatch(k, (groups, 1, 1), (t, 1, 1), buffers, params)

    def take(self, table: GpuArray, indices: GpuArray, out: GpuArray, rows: int,
             dim: int) -> None:
        """out[i, :] = table[indices[i], :]; rows of out-of-range indices are zeros."""
        if out.size == 0:
            return
        name = f"take_{SUFFIX[table.dtype]}_{SUFFIX[indices.dtype]}"
        self._rows_launch("layout", name, indices.size, dim, 16 // ITEMSIZE[table.dtype],
                          (table.buffer, indices.buffer, out.buffer),
                          _TAKE.pack(indices.size, rows, dim))

    def scatter_add(self, indices: GpuArray, values: GpuArray, out: GpuArray, rows: int,
                    dim: int) -> None:
        """out[indices[i], :] += values[i, :]; out-of-range indices are skipped."""
        if indices.size == 0 or dim == 0:
            return
        dt = out.dtype
        if dt == "bool":
            raise DTypeError("scatter_add is not defined for bool arrays")
        if (dt in ("float16", "bfloat16") and indices.size <= 64
                and "half_scatter" in self.device.features):
            # few rows (a decode step's keys and values): each distinct row summed and
            # rounded once in place, as below, without converting all of out
            self._rows_launch("layout", f"scatter_add_{SUFFIX[dt]}_{SUFFIX[indices.dtype]}",
                              indices.size, dim, 1, (indices.buffer, values.buffer, out.buffer),
                              _TAKE.pack(indices.size, rows, dim))
            return
        if dt in ("float16", "bfloat16"):  # add in float32, round once at the end
            acc, vals = self._new_array(out.size, "float32"), self._new_array(values.size,
                                                                                "float32")
            self.ewise_cast(out, acc)
            self.ewise_cast(values, vals)
            self.scatter_add(indices, vals, acc, rows, dim)
            self.ewise_cast(acc, out)
            return
        name = f"scatter_add_{SUFFIX[dt]}_{SUFFIX[indices.dtype]}"
        self._rows_launch("layout", name, indices.size, dim, 1,
                          (indices.buffer, values.buffer, out.buffer),
                          _TAKE.pack(indices.size, rows, dim))

    # --- transformer ---------------------------------------------------------------------
    def _row_kernel(self, name: str, dtype: str, rows: int, dim: int, buffers, params,
                    scratch_per_warp: int) -> None:
        self._need(dtype, FLOATS, name)
        k = self._kernel("nn", f"{name}_{SUFFIX[dtype]}")
        tx, ty = self._row_geometry(k, dim)
        shared = ty * (tx // 32) * scratch_per_warp
        self.queue.dispatch(k, (_cdiv(rows, ty), 1, 1), (tx, ty, 1), buffers, params, shared)

    def softmax(self, a: GpuArray, out: GpuArray, dim: int) -> None:
        rows = a.size // dim
        self._row_kernel("softmax", a.dtype, rows, dim, (a.buffer, out.buffer),
                         _ROW.pack(rows, dim), 2 * _ACC[a.dtype])

    def log_softmax(self, a: GpuArray, out: GpuArray, dim: int) -> None:
        rows = a.size // dim
        self._row_kernel("log_softmax", a.dtype, rows, dim, (a.buffer, out.buffer),
                         _ROW.pack(rows, dim), 2 * _ACC[a.dtype])

    def rmsnorm(self, x: GpuArray, w: GpuArray, out: GpuArray, dim: int, eps: float) -> None:
        """out = x / sqrt(mean(x**2) + eps) * w, per row."""
        rows = x.size // dim
        self._row_kernel("rmsnorm", x.dtype, rows, dim, (x.buffer, w.buffer, out.buffer),
                         _NORM[x.dtype].pack(rows, dim, eps), _ACC[x.dtype])

    def add_rmsnorm(self, x: GpuArray, delta: GpuArray, w: GpuArray, total: GpuArray,
                    out: GpuArray, dim: int, eps: float) -> None:
        """total = x + delta (rounded), out = rmsnorm(total) * w, per row; total may be x."""
        rows = x.size // dim
        self._row_kernel("add_rmsnorm", x.dtype, rows, dim,
                         (x.buffer, delta.buffer, w.buffer, total.buffer, out.buffer),
                         _NORM[x.dtype].pack(rows, dim, eps), _ACC[x.dtype])

    def layernorm(self, x: GpuArray, w: GpuArray, b: GpuArray, out: GpuArray, dim: int,
                  eps: float) -> None:
        """out = (x - mean) / sqrt(var + eps) * w + b, per row (biased variance)."""
        rows = x.size // dim
        self._row_kernel("layernorm", x.dtype, rows, dim,
                         (x.buffer, w.buffer, b.buffer, out.buffer),
                         _NORM[x.dtype].pack(rows, dim, eps), _ACC[x.dtype])

    def rope(self, x: GpuArray, cos: GpuArray, sin: GpuArray, out: GpuArray, batch: int,
             seq: int, heads: int, head_dim: int) -> None:
        """Rotary embedding, half-split layout (see numpy_ref.rope)."""
        self._need(x.dtype, FLOATS, "rope")
        work = batch * seq * heads * (head_dim // 2)
        if work:
            self._launch_1d(f"rope_{SUFFIX[x.dtype]}", work,
                            (x.buffer, cos.buffer, sin.buffer, out.buffer),
                            _ROPE.pack(batch, seq, heads, head_dim), "nn")

    def attention(self, q: GpuArray, k: GpuArray, v: GpuArray, out: GpuArray, batch: int,
                  q_heads: int, kv_heads: int, q_len: int, kv_len: int, kv_capacity: int,
                  head_dim: int, scale: float, causal: bool) -> None:
        """Scaled dot-product attention with grouped-query heads (see numpy_ref.attention)."""
        dt = self._need(q.dtype, FLOATS, "attention")
        if head_dim > 256:
            raise ShapeError(f"attention on the GPU supports head_dim <= 256, got {head_dim}")
        group = q_heads // kv_heads
        if (dt in ("float16", "bfloat16") and head_dim in (64, 128) and group * q_len >= 64
                and "mma" in self.device.features
                and all(_aligned16(x.buffer) for x in (q, k, v, out))):
            self._attention_tc(q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                               kv_capacity, head_dim, scale, causal)
            return
        kern = self._kernel("nn", f"attention_{SUFFIX[dt]}")
        kern.check_threads(256)
        gx, gy = _cdiv(group * q_len, 32), batch * kv_heads
        if gy > _MAX_GRID_YZ:
            raise ShapeError(f"attention over {gy} (batch x kv heads) exceeds the GPU grid")
        splits = 1
        target = 2 * self.device.compute_units
        if dt != "float64" and gx * gy < target and kv_len > 128:
            splits = min(_cdiv(target, gx * gy), _cdiv(kv_len, 64), _MAX_GRID_YZ)
        chunk = _cdiv(_cdiv(kv_len, splits), 32) * 32
        splits = _cdiv(kv_len, chunk)
        shared = (32 * head_dim + 32 * (head_dim + 1) + 32 * head_dim) * _ACC[dt]
        if shared + getattr(kern, "static_shared", 0) > self.device.max_shared_bytes:
            # the fused kernel's tiles do not fit (Metal's 32 KiB with head_dim above ~72)
            self._attention_composed(q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                                     kv_capacity, head_dim, scale, causal)
            return
        kern.reserve_shared(shared)
        rows_out = batch * q_heads * q_len
        part_o = part_ml = out.buffer
        if splits > 1:
            part_o = self._workspace(rows_out * splits * head_dim * 4)
            part_ml = self._workspace(rows_out * splits * 2 * 4)
        hi = float(np.float32(scale))
        params = _ATTN.pack(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                            splits, chunk, hi, int(bool(causal)), float(scale) - hi)
        self.queue.dispatch(kern, (gx, gy, splits), (32, 8, 1),
                            (q.buffer, k.buffer, v.buffer, out.buffer, part_o, part_ml),
                            params, shared)
        if splits > 1:
            kc = self._kernel("nn", f"attention_combine_{SUFFIX[dt]}")
            self.queue.dispatch(kc, (_cdiv(rows_out, 8), 1, 1), (32, 8, 1),
                                (part_o, part_ml, out.buffer), params)

    def attention_decode(self, qkv: GpuArray, cos: GpuArray, sin: GpuArray,
                         position: GpuArray, keys: GpuArray, values: GpuArray, out: GpuArray,
                         q_heads: int, kv_heads: int, head_dim: int, capacity: int,
                         table_rows: int, scale: float) -> None:
        """One decode step's attention (see numpy_ref.attention_decode): the cache split
        into chunks of positions, a group per (KV head, chunk) computing every query head of
        its group (chunks past the position return at once), then a merge per query head:
        a second launch (Metal), or the last group of each KV head (CUDA, feature
        "decode_fused"). Both read the position from device memory, so a captured step
        replays for any position."""
        dt = self._need(qkv.dtype, FLOATS, "attention_decode")
        group = q_heads // kv_heads
        chunk = max(64, _cdiv(_cdiv(capacity, 256), 64) * 64)
        splits = _cdiv(capacity, chunk)
        shared = group * (head_dim + chunk) * _ACC[dt]
        fused = "decode_fused" in self.device.features
        if fused:  # CUDA stages the chunk's keys and values (padded rows) and merge weights
            stride = head_dim + (2 if ITEMSIZE[dt] == 2 else 1)
            shared = _cdiv(shared + 2 * chunk * stride * ITEMSIZE[dt], 16) * 16
            shared += group * (splits + 1) * _ACC[dt]
        kern = self._kernel("nn", f"attention_decode_{'fused_' if fused else ''}{SUFFIX[dt]}")
        if head_dim > 256 or shared + getattr(kern, "static_shared", 0) > \
                self.device.max_shared_bytes or splits > _MAX_GRID_YZ:
            raise ShapeError(f"attention_decode: {group} query heads per KV head of size "
                             f"{head_dim} need {shared} bytes of group memory; "
                             f"{self.device.name} has {self.device.max_shared_bytes}")
        kern.check_threads(128)
        kern.reserve_shared(shared)
        part_o = self._workspace(q_heads * splits * head_dim * _ACC[dt])  # (heads, splits, d)
        part_ml = self._workspace(q_heads * splits * 2 * _ACC[dt])  # (heads, splits, [m, l])
        hi = float(np.float32(scale))
        params = _DECODE.pack(q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk,
                              hi, float(scale) - hi)
        if fused:  # one launch: the last group per KV head merges
            self.queue.dispatch(kern, (kv_heads, splits, 1), (128, 1, 1),
                                (qkv.buffer, cos.buffer, sin.buffer, position.buffer,
                                 keys.buffer, values.buffer, part_o, part_ml, out.buffer,
                                 self._counters(kv_heads)), params, shared)
            return
        self.queue.dispatch(kern, (kv_heads, splits, 1), (128, 1, 1),
                            (qkv.buffer, cos.buffer, sin.buffer, position.buffer, keys.buffer,
                             values.buffer, part_o, part_ml), params, shared)
        kc = self._kernel("nn", f"attention_decode_combine_{SUFFIX[dt]}")
        self.queue.dispatch(kc, (q_heads, 1, 1), (_cdiv(head_dim, 32) * 32, 1, 1),
                            (position.buffer, part_o, part_ml, out.buffer), params)

    def _attention_composed(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                            kv_capacity, head_dim, scale, causal) -> None:
        """Attention from existing kernels, one KV head at a time: scores = Q Kᵀ · scale
        (+ a causal mask of -inf), softmax, then P V. For head sizes whose fused kernel
        does not fit in the device's group memory; it moves the scores through memory."""
        dt, group = q.dtype, q_heads // kv_heads
        rows = group * q_len  # the query rows of the heads that share one KV head
        item = ITEMSIZE[dt]

        def part(x: GpuArray, start: int, count: int) -> GpuArray:
            return GpuArray(x.buffer.view(start * item, count * item), count, dt)

        scores, probs = self._new_array(rows * kv_len, dt), self._new_array(rows * kv_len, dt)
        mask = None
        if causal:
            i = np.arange(rows)[:, None] % q_len + (kv_len - q_len)
            mask = self._new_array(rows * kv_len, dt)
            self.from_numpy(np.where(np.arange(kv_len)[None, :] <= i, 0.0, -np.inf), mask)
        for slot in range(batch * kv_heads):  # slot = b * kv_heads + kv head
            qs = part(q, slot * rows * head_dim, rows * head_dim)
            ks = part(k, slot * kv_capacity * head_dim, kv_len * head_dim)
            vs = part(v, slot * kv_capacity * head_dim, kv_len * head_dim)
            self.matmul(qs, ks, scores, rows, head_dim, kv_len, transpose_b=True)
            self.scalar_mul(scores, scale, scores)
            if mask is not None:
                self.ewise_add(scores, mask, scores)
            self.softmax(scores, probs, kv_len)
            self.matmul(probs, vs, part(out, slot * rows * head_dim, rows * head_dim),
                        rows, kv_len, head_dim)

    def _attention_tc(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                      kv_capacity, head_dim, scale, causal) -> None:
        """Prefill-sized attention on tensor cores (feature "mma"): groups of 64 query rows,
        K/V in 64-key tiles through two shared-memory stages, P kept in registers."""
        kern = self._kernel("nn", f"attention_tc{head_dim}_{SUFFIX[q.dtype]}")
        kern.check_threads(128)
        gx, gy = _cdiv(q_heads // kv_heads * q_len, 64), batch * kv_heads
        if gy > _MAX_GRID_YZ:
            raise ShapeError(f"attention over {gy} (batch x kv heads) exceeds the GPU grid")
        shared = (64 + 4 * 64) * head_dim * 2  # Q tile + two stages of K and V tiles
        kern.reserve_shared(shared)
        hi = float(np.float32(scale))
        params = _ATTN.pack(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                            1, kv_len, hi, int(bool(causal)), float(scale) - hi)
        self.queue.dispatch(kern, (gx, gy, 1), (128, 1, 1),
                            (q.buffer, k.buffer, v.buffer, out.buffer, out.buffer, out.buffer),
                            params, shared)

    # --- optimizer updates -----------------------------------------------------------------
    def adam_update(self, param: GpuArray, grad: GpuArray, m: GpuArray, v: GpuArray, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                    decoupled: bool) -> None:
        """One Adam step of ``param`` in place (see numpy_ref.adam_update): one launch, the
        per-step scalars folded here in double as numpy_ref folds them."""
        dt = self._need(param.dtype, FLOATS, "adam_update")
        root_bc2 = math.sqrt(1 - beta2 ** step)
        mode = 2 if decoupled else (1 if weight_decay else 0)
        decay = 1 - lr * weight_decay if decoupled else weight_decay
        scalars = (beta1, 1 - beta1, beta2, 1 - beta2, eps * root_bc2,
                   lr * root_bc2 / (1 - beta1 ** step), decay)
        if param.size:
            self._launch_1d(f"adam_update_{SUFFIX[dt]}", param.size,
                            (param.buffer, grad.buffer, m.buffer, v.buffer),
                            _ADAM[dt].pack(param.size, mode, *(_scalar(dt, x) for x in scalars)),
                            "optim")

    def sgd_update(self, param: GpuArray, grad: GpuArray, momentum_buf: GpuArray | None,
                   lr: float, momentum: float, dampening: float, weight_decay: float,
                   nesterov: bool, first: bool) -> None:
        """One SGD step of ``param`` in place (see numpy_ref.sgd_update)."""
        dt = self._need(param.dtype, FLOATS, "sgd_update")
        flags = ((_SGD_MOMENTUM if momentum_buf is not None else 0)
                 | (_SGD_FIRST if first else 0) | (_SGD_NESTEROV if nesterov else 0)
                 | (_SGD_DAMPENED if dampening else 0))
        buf = param.buffer if momentum_buf is None else momentum_buf.buffer  # unused slot
        scalars = (lr, momentum, 1 - dampening, weight_decay)
        if param.size:
            self._launch_1d(f"sgd_update_{SUFFIX[dt]}", param.size,
                            (param.buffer, grad.buffer, buf),
                            _SGD[dt].pack(param.size, flags, *(_scalar(dt, x) for x in scalars)),
                            "optim")

    # --- DLPack --------------------------------------------------------------------------
    def dlpack_device(self) -> tuple[int, int]:
        if self.device.dlpack_device_type is None:
            raise DeviceError(f"{self.device.name} arrays cannot be exchanged through DLPack")
        return self.device.dlpack_device_type, self.device.dlpack_device_id

    def to_dlpack(self, a: GpuArray, shape, strides, offset, stream=None):
        """A DLPack capsule viewing the array's memory (no copy). The consumer's ``stream``
        (CUDA stream handle; None: the host) is made to wait for work queued on this array."""
        dev_type, dev_id = self.dlpack_device()
        if a.dtype not in dlpack._CODES:
            raise DTypeError(f"{a.dtype} cannot be exchanged through DLPack")
        if stream is None:
            self.queue.synchronize()
        elif stream != -1:
            self.queue.make_stream_wait(int(stream))
        address = a.buffer.handle + a.buffer.offset + offset * ITEMSIZE[a.dtype]
        return dlpack.export(address, tuple(shape), tuple(strides), a.dtype, dev_type, dev_id,
                             a)

    def from_dlpack(self, x, ndarray_cls):
        """Wrap a DLPack-exporting device array (PyTorch, CuPy) as an NDArray, zero-copy."""
        from ..backend_ndarray.device import device_from_name

        dev_type, dev_id = self.dlpack_device()
        try:
            capsule = x.__dlpack__(stream=self.queue.handle)
        except TypeError:
            capsule = x.__dlpack__()
        t = dlpack.consume(capsule)
        if (t.device_type, t.device_id) != (dev_type, dev_id):
            raise DeviceError(f"DLPack tensor is on device ({t.device_type}, {t.device_id}), "
                              f"not on {self.device.name}; move it there first")
        item = ITEMSIZE[t.dtype]
        strides = t.strides
        if strides is None:
            strides, step = [], 1
            for d in reversed(t.shape):
                strides.insert(0, step)
                step *= d
            strides = tuple(strides)
        if math.prod(t.shape) == 0:
            lo, hi = 0, 0
        else:
            lo = sum(s * (d - 1) for d, s in zip(t.shape, strides) if s < 0)
            hi = sum(s * (d - 1) for d, s in zip(t.shape, strides) if s > 0) + 1
        span = hi - lo
        buffer = Buffer(t.address + lo * item, span * item, 0, None, 0, owner=t.owner)
        array = GpuArray(buffer, span, t.dtype)
        return ndarray_cls.make(t.shape, strides, device_from_name(self.device.name), array,
                                -lo, t.dtype)

    # --- device services -----------------------------------------------------------------
    def capture(self):
        """``with backend.capture() as graph: ...`` records the enclosed device work;
        ``graph.replay()`` runs it again with one launch (see hal.CommandBuffer)."""
        return self.queue.capture()

    def profile(self):
        """``with backend.profile() as prof: ...``; then ``print(prof.table())``."""
        return self.queue.profile()

    def memory_stats(self):
        return self.allocator.stats()

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def __repr__(self) -> str:
        return f"GpuBackend({self.device.describe()})"


_ACC = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}
_ACC_BYTES = {}
for _dt in _ALL:
    _ACC_BYTES[("sum", _dt)] = 8 if _dt in ("float64", "int32", "int64", "bool") else 4
    for _op in ("max", "min", "argmax"):
        _ACC_BYTES[(_op, _dt)] = 8 if _dt in ("float64", "int64") else 4
