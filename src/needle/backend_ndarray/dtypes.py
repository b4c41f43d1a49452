"""dtypes and type promotion.

needle names dtypes by strings ("float32", ...). Each maps to a numpy dtype; bfloat16 comes
from ``ml_dtypes``. The promotion rules, applied by NDArray before it calls a backend (so
backend binary functions always see inputs of one dtype):

1. Two arrays: the result is the higher of the two on the ladder
   ``bool < uint8 | int8 < int32 < int64 < float16 | bfloat16 < float32 < float64``;
   float16 with bfloat16 gives float32, uint8 with int8 gives int32 (needle has no int16).
2. An array and a Python scalar: the array's dtype wins within its kind. A float scalar
   with an integer or bool array gives float32; an int scalar with a bool array gives int32.
   A Python int with an integer array must fit its range (``check_scalar``).
3. True division of integers or bools gives float32.
4. Arithmetic (+ - * / ** max min) on bool arrays computes in int32.
5. Transcendental functions (exp, log, sqrt, rsqrt, sin, cos, tanh, sigmoid, silu, gelu)
   of integers or bools compute in float32.
6. Comparisons give bool.

Data given without a dtype (``NDArray(x)``, ``Tensor(x)``): a numpy array keeps its dtype,
float64 included (as ``torch.tensor`` does; on a device without float64 it becomes float32);
Python floats become float32, Python ints int64. A list operand of an op follows rule 2.
Integer arithmetic wraps (uint8/int8 modulo 2^8); sums of bool, uint8 and int8 count in
int64 (``sum_dtype``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import DTypeError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("uint8", "int8", "int32", "int64")
SMALL_INT_DTYPES = ("uint8", "int8")
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)
DEFAULT_FLOAT = "float32"

_NUMPY = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}

_RANK = {"bool": 0, "uint8": 1, "int8": 1, "int32": 2, "int64": 3, "float16": 4, "bfloat16": 4,
         "float32": 5, "float64": 6}

ITEMSIZE = {name: dt.itemsize for name, dt in _NUMPY.items()}


def canonical(dtype) -> str:
    """Return needle's name for ``dtype`` (a string, numpy dtype, or torch-like name)."""
    if dtype is None:
        return DEFAULT_FLOAT
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").removeprefix("numpy.")
        aliases = {"float": "float32", "half": "float16", "double": "float64", "int": "int32",
                   "long": "int64", "byte": "uint8", "char": "int8", "bf16": "bfloat16",
                   "fp16": "float16", "fp32": "float32", "bool_": "bool"}
        name = aliases.get(name, name)
        if name in _NUMPY:
            return name
        raise DTypeError(f"unknown dtype {dtype!r}; use one of {', '.join(ALL_DTYPES)}")
    try:
        npdt = np.dtype(dtype)
    except TypeError:
        raise DTypeError(f"unknown dtype {dtype!r}; use one of {', '.join(ALL_DTYPES)}") from None
    if npdt in _FROM_NUMPY:
        return _FROM_NUMPY[npdt]
    raise DTypeError(
        f"numpy dtype {npdt} is not supported by needle; use one of {', '.join(ALL_DTYPES)}"
    )


def to_numpy_dtype(dtype: str) -> np.dtype:
    npdt = _NUMPY.get(dtype) if isinstance(dtype, str) else None
    return npdt if npdt is not None else _NUMPY[canonical(dtype)]


def is_floating(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_integer(dtype: str) -> bool:
    return dtype in INT_DTYPES


def promote(a: str, b: str) -> str:
    """Result dtype of a binary operation between two arrays (rule 1)."""
    if a == b:
        return a
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    if {a, b} == {"uint8", "int8"}:
        return "int32"  # the smallest type holding both ranges (needle has no int16)
    return a if _RANK[a] > _RANK[b] else b


def promote_scalar(a: str, value) -> str:
    """Result dtype of a binary operation between an array and a Python scalar (rule 2)."""
    if isinstance(value, (bool, np.bool_)):
        return a
    if isinstance(value, (int, np.integer)):
        return "int32" if a == "bool" else a
    if isinstance(value, (float, np.floating)):
        return a if is_floating(a) else DEFAULT_FLOAT
    raise DTypeError(f"cannot combine an array with a scalar of type {type(value).__name__}")


_INT_RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int32": (-2**31, 2**31 - 1),
              "int64": (-2**63, 2**63 - 1)}


def check_scalar(dtype: str, value) -> None:
    """A Python int combined with (or filled into) an integer array must fit its range, as
    in numpy 2: ``uint8_array + (-3)`` or ``int32_array + 2**40`` is a DTypeError on every
    backend rather than a wrapped, clipped or backend-dependent value. (The result of the
    arithmetic itself wraps.)"""
    if dtype in _INT_RANGE and isinstance(value, (int, np.integer)) \
            and not isinstance(value, (bool, np.bool_)):
        lo, hi = _INT_RANGE[dtype]
        if not lo <= int(value) <= hi:
            wider = {"int32": "int64", "int64": "float64"}.get(dtype, "int32")
            raise DTypeError(f"the Python integer {int(value)} does not fit {dtype} "
                             f"({lo}..{hi}); cast the array first, e.g. a.astype('{wider}')")


def sum_dtype(dtype: str) -> str:
    """dtype a sum accumulates and returns in: bool and 8-bit integers count in int64 (so
    they don't wrap); every other dtype in itself."""
    return "int64" if dtype == "bool" or dtype in SMALL_INT_DTYPES else dtype


def arithmetic(dtype: str) -> str:
    """dtype an arithmetic op computes in (rule 4)."""
    return "int32" if dtype == "bool" else dtype


def floating(dtype: str) -> str:
    """dtype a transcendental op computes in (rules 3 and 5)."""
    return dtype if is_floating(dtype) else DEFAULT_FLOAT
