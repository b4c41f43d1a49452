"""The generic GPU backend: the array API written once against the HAL (``backend.py``),
one module per kernel family. Nothing here imports a device backend (cuda, metal)."""

from .array import GpuArray
from .backend import GpuBackend
from .base import GpuTuning

__all__ = ["GpuArray", "GpuBackend", "GpuTuning"]
