"""The plumbing every kernel family of the generic GPU backend uses: kernel lookup, array
and workspace allocation, and the launch shapes shared by many kernels.

Launch geometry comes from each kernel's limits (``max_threads``, ``preferred_threads``,
``resident_groups``), never from a hard-coded size (design §4).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import DTypeError
from ...hal import Buffer, Device
from .array import GpuArray, cdiv


@dataclass(frozen=True)
class GpuTuning:
    """Choices a device backend makes about its kernels, read once per device. The generic
    families make none; ``CudaTuning`` and ``MetalTuning`` subclass this with their own."""


class GpuBase:
    """State and helpers of one GPU backend instance (one per device)."""

    def __init__(self, device: Device, name: str, tuning: GpuTuning):
        self.device = device
        self.name = name
        self.tuning = tuning
        self.queue = device.queue
        self.allocator = device.allocator
        self._kernels: dict[str, object] = {}
        self._geometry: dict[str, tuple] = {}
        self._map_plans: dict[str, tuple] = {}
        self._counter_array: GpuArray | None = None
        self._outgrown_counters: list[GpuArray] = []  # still read by captured graphs
        self.Array = self._new_array

    @contextmanager
    def tuned(self, **changes) -> Iterator[GpuTuning]:
        """Run a block with some tuning choices changed (tests and scripts compare kernels
        this way), e.g. ``with backend.tuned(gemm="wgmma"): ...``."""
        previous = self.tuning
        self.tuning = replace(previous, **changes)
        self._retuned()
        try:
            yield self.tuning
        finally:
            self.tuning = previous
            self._retuned()

    def _retuned(self) -> None:
        """Apply a tuning change to state outside this object (CUDA: the queue's PDL)."""

    def _kernel(self, family: str, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self.device.executables.kernel(family, name)
        return k

    @staticmethod
    def _need(dtype: str, names, op: str) -> str:
        if dtype not in names:
            raise DTypeError(f"{op} is not defined for {dtype} arrays on the GPU")
        return dtype

    def _new_array(self, size: int, dtype: str = "float32") -> GpuArray:
        if dtype not in self.device.dtypes:
            raise DTypeError(f"{dtype} is not supported on {self.device.name}: its hardware has "
                             f"no {dtype}; use float32 instead")
        return GpuArray(self.allocator.allocate(size * ITEMSIZE[dtype]), size, dtype)

    def _workspace(self, nbytes: int) -> Buffer:
        """Scratch memory; it may go back to the pool as soon as its launches are queued,
        because one queue runs everything in order."""
        return self.allocator.allocate(nbytes)

    def _counters(self, n: int) -> Buffer:
        """n zeroed 32-bit counters that kernels using them leave zeroed (kept, not pooled)."""
        have = self._counter_array
        if have is None or have.size < n:
            if have is not None:  # a captured graph may use it: never give it back
                self._outgrown_counters.append(have)
            have = self._counter_array = self._new_array(max(n, 2 * have.size if have else 0,
                                                              1024), "int32")
            self.fill(have, 0)
        return have.buffer

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
        """An elementwise launch: each thread handles 16 bytes of the wider dtype."""
        if n:
            plan = self._map_plans.get(name) or self._map_plan(name, in_dtype, out_dtype)
            k, chunk, resident, threads = plan
            self.queue.dispatch(k, (min(-(-n // chunk), resident) or 1, 1, 1), threads,
                                buffers, params)

    def _map_plan(self, name: str, in_dtype: str, out_dtype: str) -> tuple:
        """(kernel, elements a group covers, resident groups, threads) of an elementwise
        kernel, kept per name (a name fixes both dtypes): the hot path of every small op."""
        width = 16 // max(ITEMSIZE[in_dtype], ITEMSIZE[out_dtype])
        k, t, resident = self._geometry.get(name) or self._geometry_1d(name, "elementwise")
        plan = self._map_plans[name] = (k, width * t, resident, (t, 1, 1))
        return plan

    @staticmethod
    def _row_geometry(kernel, dim: int) -> tuple[int, int]:
        """(TX, TY) for a row kernel: enough threads per row for ~8 elements each."""
        limit = kernel.max_threads
        tx = 32
        while tx * 8 < dim and tx * 2 <= limit:
            tx *= 2
        ty = max(1, min(256, limit) // tx)
        return tx, ty

    def _rows_launch(self, family: str, name: str, n_rows: int, dim: int, width: int,
                     buffers, params) -> None:
        """A group per row (group-stride), its threads across the row."""
        k = self._kernel(family, name)
        t = max(32, min(k.preferred_threads, cdiv(cdiv(dim, width), 32) * 32))
        groups = max(1, min(n_rows, k.resident_groups(t)))
        self.queue.dispatch(k, (groups, 1, 1), (t, 1, 1), buffers, params)
