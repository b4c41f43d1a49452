"""What every GPU kernel family shares: the buffer type, dtype suffixes, params packing.

Kernel names are ``{op}_{suffix}`` (docs/kernels.md §1); each kernel takes its buffers, then
one params struct whose layout (native alignment, padded to 8 bytes) is packed here.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import numpy as np

from ...hal import Buffer

SUFFIX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
          "int32": "i32", "int64": "i64", "bool": "b8", "uint8": "u8", "int8": "i8"}
FLOATS = ("float16", "bfloat16", "float32", "float64")
# uint8/int8 have elementwise, cast and layout kernels (computing in int); reductions and
# matmuls of them run through int32/int64 copies (reduce.py, matmul.py)
SMALL_INTS = ("uint8", "int8")
NUMBERS = FLOATS + ("int32", "int64") + SMALL_INTS
ALL = NUMBERS + ("bool",)
_SCALAR = {"float16": "f", "bfloat16": "f", "float32": "f", "float64": "d", "int32": "i",
           "int64": "q", "bool": "i", "uint8": "i", "int8": "i"}
MAX_DIMS = 8
MAX_GRID_YZ = 65535
# bytes of one float accumulator of a dtype's kernels (fp16/bf16 accumulate in fp32)
ACC = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}


def padded(fmt: str) -> struct.Struct:
    """A params struct (native alignment, as C lays it out) padded to a multiple of 8."""
    size = struct.calcsize(fmt)
    return struct.Struct(fmt + "x" * (-size % 8))


N_PARAMS = struct.Struct("q")
S_PARAMS = {dt: padded("q" + code) for dt, code in _SCALAR.items()}  # SParams
STRIDED = "qqq8q8q8I8I"
STRIDED_S = {dt: padded(STRIDED + code) for dt, code in _SCALAR.items()}
TAKE = struct.Struct("qqq")
TRANSPOSE = struct.Struct("5q")
REDUCE = struct.Struct("5q")
MATMUL = struct.Struct("10q")
ROW = struct.Struct("qq")
NORM = {dt: padded("qq" + _SCALAR[dt]) for dt in FLOATS}
# qk_rmsnorm's params: rows, query heads, KV heads, head size, eps
QK_NORM = {dt: padded("4q" + _SCALAR[dt]) for dt in FLOATS}
ROPE = struct.Struct("4q")
ATTN = padded("9qfiiff")  # AttnParams: sizes, splits, chunk, scale, causal, window, scale_lo,
#                           softcap (0: none)
DECODE = padded("8qfff")  # attention_decode: heads, kv heads, head dim, capacity, table rows,
#  splits, chunk, window (0: none), scale (hi + lo: Metal has no double), softcap (0: none)
FUSED_GEMV = padded("3qfi")  # decode.cu's FusedGemvParams: k, p, rows per warp, eps, flags
ADAM = {dt: padded("qq" + _SCALAR[dt] * 7) for dt in FLOATS}  # optim kernels' AdamParams
SGD = {dt: padded("qq" + _SCALAR[dt] * 4) for dt in FLOATS}  # SgdParams


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int_wrap(value, bits: int) -> int:
    v = int(value) & ((1 << bits) - 1)
    return v - (1 << bits) if v >> (bits - 1) else v


def scalar(dtype: str, value):
    """``value`` as the kernel's scalar param type for ``dtype`` (docs/kernels.md §1)."""
    if dtype == "bool":
        return int(bool(value))
    if dtype in ("int32", "uint8", "int8"):  # 8-bit kernels wrap the int on store
        return _int_wrap(value, 32)
    if dtype == "int64":
        return _int_wrap(value, 64)
    value = float(value)
    if dtype != "float64" and math.isfinite(value) and abs(value) > 3.4028234663852886e38:
        return float(np.float32(value))  # numpy's overflow to +-inf, which struct refuses
    return value


def split_scale(scale: float) -> tuple[float, float]:
    """``scale`` as float32 hi + lo parts (Metal has no double; kernels add them)."""
    hi = float(np.float32(scale))
    return hi, float(scale) - hi


@lru_cache(maxsize=4096)
def magic(d: int) -> tuple[int, int]:
    """(magic, shift) with floor(i / d) == (mulhi(i, magic) + i) >> shift for i < 2^31."""
    if not 0 < d < 2**31:
        return 1, 0
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def overlap(a: Buffer, b: Buffer) -> bool:
    """Whether two buffers share memory (same allocation, intersecting byte ranges)."""
    return (a.handle == b.handle and a.offset < b.offset + b.nbytes
            and b.offset < a.offset + a.nbytes)


def aligned16(buffer: Buffer) -> bool:
    """Whether a buffer starts 16-byte aligned (CUDA handles are addresses; Metal buffers
    are page-aligned, so only their offset counts)."""
    base = buffer.handle if isinstance(buffer.handle, int) else 0
    return (base + buffer.offset) % 16 == 0


def simplify(shape, strides) -> tuple[tuple[int, ...], tuple[int, ...]]:
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
