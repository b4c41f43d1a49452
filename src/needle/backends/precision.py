"""How float32 matrix products may run: ``"highest"`` (IEEE float32, the default) or
``"high"`` (TF32 tensor cores where a backend has them).

TF32 keeps float32's range and 10 of its 23 mantissa bits in the products (the operands'
low 13 bits are dropped), accumulating in float32: about 1e-3 relative error instead of
1e-6, for 5-10x the speed on GPUs with TF32 tensor cores. PyTorch calls the same switch
``torch.set_float32_matmul_precision``; needle takes the same two names. Backends without
a TF32 path (cpu, numpy, Metal, CUDA before Hopper: the TF32 kernel is the TMA GEMM)
compute in float32 whatever the setting.

The setting is process-wide and read at each product: CUDA graphs captured before a
change (``ndl.compile``, ``backend.capture``) replay the kernels they captured. The
environment variable ``NEEDLE_FLOAT32_MATMUL_PRECISION`` gives the starting value.
"""

from __future__ import annotations

import os

from ..errors import ArgumentError

PRECISIONS = ("highest", "high")
_ENV = "NEEDLE_FLOAT32_MATMUL_PRECISION"
_precision: str | None = None  # None: not set yet (the environment's value, else highest)


def _checked(value, source: str) -> str:
    if value not in PRECISIONS:
        raise ArgumentError(f"{source}: float32 matmul precision must be one of "
                            f"{', '.join(repr(p) for p in PRECISIONS)} (\"high\" allows "
                            f"TF32), got {value!r}")
    return value


def set_float32_matmul_precision(precision: str) -> None:
    """``"highest"``: float32 products in IEEE float32; ``"high"``: in TF32 where the
    device has a TF32 path (module docstring)."""
    global _precision
    _precision = _checked(precision, "set_float32_matmul_precision")


def get_float32_matmul_precision() -> str:
    global _precision
    if _precision is None:
        _precision = _checked(os.environ.get(_ENV, "highest"), _ENV)
    return _precision


def tf32_allowed() -> bool:
    """Whether float32 products may run in TF32 (a backend's hot path asks this)."""
    return (_precision or get_float32_matmul_precision()) == "high"
