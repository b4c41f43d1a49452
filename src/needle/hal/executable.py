"""Executable: one compiled kernel file (CUDA: a CUmodule; Metal: an MTLLibrary).

Kernels are looked up by their stable ABI name (``ewise_add_f32``, see docs/kernels.md)
and each carries the limits that launch geometry is computed from, so no caller ever
hard-codes a group size the kernel cannot run with.
"""

from __future__ import annotations

from ..errors import KernelLaunchError


class Kernel:
    """One entry point of an executable and its launch limits.

    ``max_threads``: the most threads a group may have (registers and the device decide).
    ``preferred_threads``: a group size that reaches the best occupancy.
    ``simd_width``: threads that run in lockstep (CUDA warp, Metal SIMD-group).
    ``static_shared``: group memory the kernel declares itself, on top of what a launch asks
    for (Metal reports it per pipeline; CUDA's kernels declare none that counts here).
    """

    __slots__ = ("name", "handle", "max_threads", "preferred_threads", "simd_width",
                 "static_shared", "_resident")

    def __init__(self, name: str, handle, max_threads: int, preferred_threads: int,
                 simd_width: int):
        self.name = name
        self.handle = handle
        self.max_threads = max_threads
        self.preferred_threads = preferred_threads
        self.simd_width = simd_width
        self.static_shared = 0
        self._resident: dict[tuple[int, int], int] = {}

    def resident_groups(self, threads: int, shared_bytes: int = 0) -> int:
        """Groups of ``threads`` that can run at once on the whole device (grid-stride loops
        launch this many). Cached per (threads, shared bytes)."""
        key = (threads, shared_bytes)
        n = self._resident.get(key)
        if n is None:
            n = self._resident[key] = max(1, self._occupancy(threads, shared_bytes))
        return n

    def _occupancy(self, threads: int, shared_bytes: int) -> int:
        raise NotImplementedError

    def check_threads(self, threads: int) -> None:
        """Raise if a fixed group size (a tile kernel's) exceeds what this kernel allows."""
        if threads > self.max_threads:
            raise KernelLaunchError(
                f"kernel {self.name} needs {threads} threads per group but this device allows "
                f"only {self.max_threads} for it (register use); rebuild with smaller tiles")

    def reserve_shared(self, shared_bytes: int) -> None:
        """Allow ``shared_bytes`` of dynamic shared (threadgroup) memory per group.

        CUDA needs an opt-in above 48 KiB; Metal takes any size up to the device limit.
        """

    def __repr__(self) -> str:
        return f"Kernel({self.name}, max_threads={self.max_threads})"


class Executable:
    """A compiled kernel file; ``kernel(name)`` finds an entry point (cached)."""

    def __init__(self, name: str):
        self.name = name
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self._load_kernel(name)
        return k

    def _load_kernel(self, name: str) -> Kernel:
        raise NotImplementedError
