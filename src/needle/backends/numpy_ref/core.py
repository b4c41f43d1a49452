"""The reference backend's buffer type and the helpers every function uses."""

from __future__ import annotations

import numpy as np

from ...backend_ndarray.dtypes import to_numpy_dtype
from ...errors import OutOfMemoryError


class Array:
    """A flat buffer of ``size`` elements of ``dtype`` held in a numpy array."""

    __slots__ = ("array", "dtype", "__weakref__")  # weak: ndl.compile's watch

    def __init__(self, size: int, dtype: str = "float32"):
        try:
            self.array = np.empty(size, dtype=to_numpy_dtype(dtype))
        except (MemoryError, ValueError):  # ValueError: more bytes than numpy can address
            raise OutOfMemoryError(f"cannot allocate {size} elements of {dtype} "
                                   f"({size * to_numpy_dtype(dtype).itemsize} bytes) on "
                                   "cpu_numpy; use smaller arrays") from None
        self.dtype = dtype

    @property
    def size(self) -> int:
        return self.array.size

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data


_HALF = (np.dtype(np.float16), to_numpy_dtype("bfloat16"))


def _f(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype: fp16/bf16 compute in float32."""
    return x.astype(np.float32) if x.dtype in _HALF else x


def _store(out: Array, value) -> None:
    out.array[:] = np.asarray(value).astype(out.array.dtype, copy=False).reshape(-1)


def _view(a: Array, shape, strides, offset) -> np.ndarray:
    item = a.array.itemsize
    return np.lib.stride_tricks.as_strided(
        a.array[offset:], shape=tuple(shape), strides=tuple(s * item for s in strides)
    )
