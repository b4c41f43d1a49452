"""Queue: the device's in-order stream of work (CUDA: a CUstream; Metal: an MTLCommandQueue).

Everything is asynchronous: ``dispatch`` and device-side copies enqueue and return. The
host waits only in ``copy_to_host`` (it needs the data) and ``synchronize``;
``copy_to_host_later`` starts a read whose wait comes later. One queue per
device keeps every operation in program order, which is what lets the allocator recycle a
buffer as soon as its last user is *queued* rather than finished.

Dispatch ABI (docs/kernels.md): ``buffers`` are the kernel's buffer arguments in order,
``params`` the packed bytes of its one params struct, ``shared_bytes`` the dynamic shared
(threadgroup) memory per group, ``groups`` and ``threads`` the grid, each as (x, y, z).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np

from .buffer import Buffer
from .event import Event
from .executable import Kernel
from .profiler import Profiler


class Queue:
    """In-order device work. Backends implement every method that raises below."""

    def __init__(self):
        self.profiler: Profiler | None = None

    def dispatch(self, kernel: Kernel, groups: tuple[int, int, int],
                 threads: tuple[int, int, int], buffers: Sequence[Buffer],
                 params: bytes = b"", shared_bytes: int = 0) -> None:
        """Enqueue one kernel launch."""
        raise NotImplementedError

    def copy_from_host(self, dst: Buffer, dst_offset: int, src: np.ndarray) -> None:
        """Enqueue a copy of the contiguous array ``src`` to ``dst`` at ``dst_offset`` bytes.
        ``src`` may be reused as soon as this returns."""
        raise NotImplementedError

    def copy_to_host(self, src: Buffer, src_offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes from ``src`` at ``src_offset`` into the contiguous
        array ``dst``, after all queued work; returns when the data is there."""
        raise NotImplementedError

    def copy_to_host_later(self, src: Buffer, src_offset: int,
                           nbytes: int) -> Callable[[], np.ndarray]:
        """Start reading ``nbytes`` bytes of ``src`` at ``src_offset``, after all queued work,
        without waiting for them: returns a function that waits and returns the bytes (a new
        uint8 array). Work queued afterwards may run meanwhile; it does not change what is
        read. This default reads at once; backends with asynchronous copies override it."""
        out = np.empty(nbytes, np.uint8)
        self.copy_to_host(src, src_offset, out)
        return lambda: out

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int,
             nbytes: int) -> None:
        """Enqueue a device-to-device copy."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until all queued work has finished; raise if any of it failed."""
        raise NotImplementedError

    def event(self) -> Event:
        """A new, unrecorded event of this queue."""
        raise NotImplementedError

    def wait_for_stream(self, stream: int) -> None:
        """Make later work on this queue wait for the work queued now on a foreign stream
        (DLPack import: the producer's stream handle)."""
        raise NotImplementedError

    def make_stream_wait(self, stream: int) -> None:
        """Make later work on a foreign stream wait for the work queued now on this queue
        (DLPack export: the consumer's stream handle)."""
        raise NotImplementedError

    def capture(self):
        """A context manager that records the work enqueued inside its block, instead of
        running it, into the CommandBuffer it yields (ready to ``replay()`` after the block).
        """
        raise NotImplementedError

    @contextmanager
    def profile(self):
        """Sum device time per kernel over the block; yields the Profiler."""
        prof = Profiler()
        previous, self.profiler = self.profiler, prof
        try:
            yield prof
        finally:
            self.profiler = previous
            self.synchronize()
            prof.finish()
