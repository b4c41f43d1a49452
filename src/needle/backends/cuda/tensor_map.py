"""TMA tensor maps (``CUtensorMap``) for kernels that load tiles with the copy engine.

A tensor map is a 128-byte descriptor the driver encodes from a global address, the
tensor's dims and byte strides, the box (tile) one copy moves, and the shared-memory
swizzle. Kernels take it by value (a ``const __grid_constant__`` parameter, passed through
``CudaQueue.dispatch(raw_args=...)``). Encoding costs host time, so maps are cached by
everything they encode: the same buffer and shape reuse one map.
"""

from __future__ import annotations

import struct
from functools import lru_cache

from ...errors import DeviceError
from .driver import check, cu

MAP_BYTES = 128  # sizeof(CUtensorMap); 64-byte aligned on the device
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
_WORDS = struct.Struct("16Q")


def _data_type(dtype: str):
    t = cu.CUtensorMapDataType
    return {"bfloat16": t.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            "float16": t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            "float32": t.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            "int32": t.CU_TENSOR_MAP_DATA_TYPE_INT32}[dtype]


def check_tiled(dtype: str, address: int, dims: tuple[int, ...], strides: tuple[int, ...],
                box: tuple[int, ...], swizzle: int = 128) -> None:
    """Raise DeviceError unless cuTensorMapEncodeTiled's documented limits hold (so callers
    can fall back to another kernel instead of failing in the driver)."""
    if dtype not in _ITEMSIZE:
        raise DeviceError(f"no tensor map for dtype {dtype}; use one of {sorted(_ITEMSIZE)}")
    item = _ITEMSIZE[dtype]
    rank = len(dims)
    problems = []
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        problems.append(f"rank {rank} with {len(strides)} strides and a {len(box)}-d box")
    if address % 16:
        problems.append(f"address {address:#x} is not 16-byte aligned")
    if any(not 1 <= d <= 1 << 32 for d in dims):
        problems.append(f"dims {dims} must each be in [1, 2^32]")
    if any(s % 16 or not 0 < s < 1 << 40 for s in strides):
        problems.append(f"byte strides {strides} must be positive multiples of 16 below 2^40")
    if any(not 1 <= b <= 256 for b in box):
        problems.append(f"box {box} must be in [1, 256] per dimension")
    elif (box[0] * item) % 16 or (swizzle and box[0] * item > swizzle):
        problems.append(f"the box's inner extent ({box[0] * item} bytes) must be a multiple "
                        f"of 16 and at most the {swizzle}-byte swizzle")
    if swizzle not in (0, 32, 64, 128):
        problems.append(f"swizzle {swizzle} is not 0, 32, 64 or 128 bytes")
    if problems:
        raise DeviceError("cannot build a TMA tensor map: " + "; ".join(problems))


@lru_cache(maxsize=1024)
def tiled(dtype: str, address: int, dims: tuple[int, ...], strides: tuple[int, ...],
          box: tuple[int, ...], swizzle: int = 128) -> bytes:
    """The 128 raw bytes of a tiled tensor map (cuTensorMapEncodeTiled).

    ``dims`` innermost first (elements), ``strides`` the byte strides of dims 1.. (dim 0 is
    contiguous), ``box`` the elements one copy moves per dim. Out-of-bounds elements of a box
    read as zeros; L2 fills in 256-byte lines. Cached: a map depends on nothing else.
    """
    check_tiled(dtype, address, dims, strides, box, swizzle)
    sw = cu.CUtensorMapSwizzle
    swizzle_enum = {0: sw.CU_TENSOR_MAP_SWIZZLE_NONE, 32: sw.CU_TENSOR_MAP_SWIZZLE_32B,
                    64: sw.CU_TENSOR_MAP_SWIZZLE_64B, 128: sw.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        _data_type(dtype), len(dims), address,
        [u64(d) for d in dims], [u64(s) for s in strides],
        [u32(b) for b in box], [u32(1)] * len(dims),
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_enum,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),  # NONE: zeros
        f"cuTensorMapEncodeTiled({dtype}, dims={dims}, strides={strides}, box={box})")
    return raw_bytes(tensor_map)


def raw_bytes(tensor_map) -> bytes:
    """A CUtensorMap object's 128 bytes (its ``opaque`` field: 16 64-bit words)."""
    return _WORDS.pack(*(int(w) for w in tensor_map.opaque))


def matrix_map(dtype: str, address: int, rows: int, cols: int, batch: int, batch_stride: int,
               box_rows: int, box_cols: int = 64, swizzle: int = 128) -> bytes:
    """A 3-d map (k, row, batch) of ``batch`` row-major (rows, cols) matrices, matrix i at
    element offset i * batch_stride: the operand maps of the TMA GEMM (gemm_tma.cu) and the
    quantized one (quant_gemm.cu: its packed words and scales unswizzled, ``swizzle=0``).
    ``batch_stride`` is ignored for one matrix; for several it must be >= rows * cols."""
    item = _ITEMSIZE.get(dtype, 2)
    if batch == 1:
        batch_stride = rows * cols  # any valid stride: the kernel reads matrix 0 only
    elif batch_stride < rows * cols:
        raise DeviceError(f"a tensor map over {batch} matrices of {rows}x{cols} needs a batch "
                          f"stride of at least {rows * cols} elements, got {batch_stride}; "
                          "broadcast or overlapping operands take another kernel")
    return tiled(dtype, address, (cols, rows, batch), (cols * item, batch_stride * item),
                 (box_cols, box_rows, 1), swizzle)
