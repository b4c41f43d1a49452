"""Device: one GPU and what it is made of (CUDA: CUdevice + primary context; Metal: MTLDevice).

A device owns exactly one queue, one allocator and one executable cache, and states the
limits that kernels and launch geometry are chosen by.
"""

from __future__ import annotations

from ..backend_ndarray.dtypes import ALL_DTYPES
from .allocator import Allocator
from .executable_cache import ExecutableCache
from .queue import Queue


class Device:
    """A GPU. Backends fill in every attribute in their constructor.

    ``arch``: what kernels are compiled for (``sm_90``, ``apple9``).
    ``compute_units``: streaming multiprocessors / GPU cores.
    ``simd_width``: threads in lockstep (32 on NVIDIA and Apple GPUs).
    ``max_threads_per_group``, ``max_shared_bytes``: per-group limits of the device.
    ``dlpack_device_type``: the DLPack device code (kDLCUDA = 2), or None when buffers
    cannot be exchanged through DLPack.
    """

    name: str
    arch: str
    compute_units: int
    simd_width: int
    max_threads_per_group: int
    max_shared_bytes: int
    total_memory: int
    dlpack_device_type: int | None = None
    dtypes: frozenset[str] = frozenset(ALL_DTYPES)  # what the hardware holds (Metal: no float64)
    dlpack_device_id: int = 0
    allocator: Allocator
    queue: Queue
    executables: ExecutableCache

    def synchronize(self) -> None:
        self.queue.synchronize()

    def describe(self) -> str:
        return (f"{self.name} ({self.arch}, {self.compute_units} compute units, "
                f"{self.total_memory / 2**30:.1f} GiB)")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
