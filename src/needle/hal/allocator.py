"""Allocator: a caching pool of device memory, by size class, with statistics.

Device allocation is slow (cuMemAlloc synchronizes; MTLDevice.newBuffer is a system call)
and training loops free and reallocate the same sizes every step, so freed buffers go back
to a pool and the next request of the same size class takes one from there. All work of a
device runs in order on its one queue, so a block freed while a queued kernel still reads
it can be handed out again at once: whatever writes it next is queued after that kernel.

On out-of-memory the allocator empties the shared pool, retries once, and then raises
``OutOfMemoryError`` with the bytes requested and available.

A graph capture (``Queue.capture``) allocates from a *private* pool: blocks it frees during
capture are reused only inside the capture (replays repeat the same order), and blocks it
still holds stay out of the shared pool until the graph is dropped. A private pool's free
blocks are the graph's working memory, so ``empty_cache`` (and the out-of-memory retry)
leave them alone; closing the pool returns them.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import OutOfMemoryError
from . import trace
from ._native import Ledger, Pool, size_class
from .buffer import Buffer

MIN_BLOCK = size_class(0)  # the smallest size class (blocks.cc decides it)

__all__ = ["Allocator", "MemoryStats", "Pool", "size_class", "MIN_BLOCK"]


@dataclass(frozen=True)
class MemoryStats:
    """Bytes in live buffers, bytes held from the device (live + cached), the highest
    ``in_use`` so far, and how many requests the pool served (hits) or did not (misses)."""

    in_use: int
    reserved: int
    peak: int
    hits: int
    misses: int


class Allocator:
    """Caching device allocator. Backends implement the three raw hooks below.

    The pools (``Pool``: free blocks by size class) and the counters (``Ledger``) are native
    (hal/native/blocks.cc): taking a block, making its buffer and taking the block back when
    the buffer dies run without Python code or a lock (the GIL serializes them). The lock
    here guards the slow paths: reserving and releasing device blocks, emptying the cache.
    """

    buffer_type: type[Buffer] = Buffer

    def __init__(self, device_name: str):
        self.device_name = device_name
        self.lock = threading.RLock()
        self._ledger = Ledger()
        self._default = self._new_pool("default", private=False)
        self._pool = self._default

    def _new_pool(self, name: str, private: bool) -> Pool:
        return Pool(self._ledger, name, private, self._reserve, self._release_block,
                    self.buffer_type)

    # --- backend hooks -------------------------------------------------------------------
    def _allocate_raw(self, nbytes: int):
        """A new device block of ``nbytes``, or None when the device is out of memory."""
        raise NotImplementedError

    def _free_raw(self, handle) -> None:
        """Give one block back to the device."""
        raise NotImplementedError

    def available(self) -> int:
        """Bytes the device could still hand out (free device memory)."""
        raise NotImplementedError

    # --- the pool ------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes`` bytes, from the pool when a block is cached."""
        if trace.enabled:
            return self._allocate_traced(nbytes)
        return self._pool.allocate(nbytes)

    def _allocate_traced(self, nbytes: int) -> Buffer:
        start, hits, pool = time.perf_counter(), self._ledger.hits, self._pool
        buffer = pool.allocate(nbytes)
        hit = self._ledger.hits > hits
        trace.emit("alloc", f"{trace.nbytes_str(nbytes)} on {self.device_name} "
                   f"({'pool hit' if hit else 'new block'}, pool {pool.name})",
                   time.perf_counter() - start)
        return buffer

    def _reserve(self, capacity: int, requested: int):
        """A new block for a pool's miss (called by the native Pool.allocate)."""
        with self.lock:
            handle = self._allocate_raw(capacity)
            if handle is None:
                self.empty_cache()
                handle = self._allocate_raw(capacity)
            if handle is None:
                self._out_of_memory(capacity, requested)
            self._ledger.reserved += capacity
            return handle

    def _out_of_memory(self, capacity: int, requested: int):
        avail = self.available()
        raise OutOfMemoryError(
            f"out of memory on {self.device_name}: requested {requested} bytes "
            f"({trace.nbytes_str(requested)}, block {trace.nbytes_str(capacity)}), "
            f"{avail} bytes ({trace.nbytes_str(avail)}) available after emptying the "
            f"cache; {trace.nbytes_str(self._ledger.in_use)} are held by live arrays. Free "
            f"arrays you no longer need, or use smaller batches or a smaller dtype.")

    def _release_block(self, handle, capacity: int) -> None:
        """A block back to the device (a pool emptied, or a closed pool's block freed)."""
        with self.lock:
            self._ledger.reserved -= capacity
            self._free_raw(handle)

    def empty_cache(self) -> None:
        """Return every cached (unused) block of the shared pool to the device (a private
        pool's free blocks are its graph's memory: they go when the pool closes)."""
        with self.lock:
            self._default.empty()

    @contextmanager
    def private_pool(self, name: str):
        """Serve allocations from a fresh pool inside the block; yields the pool.

        The caller owns the pool and closes it when its user (a captured graph) is gone.
        """
        pool = self._new_pool(name, private=True)
        previous, self._pool = self._pool, pool
        try:
            yield pool
        finally:
            self._pool = previous

    def stats(self) -> MemoryStats:
        ledger = self._ledger
        return MemoryStats(ledger.in_use, ledger.reserved, ledger.peak, ledger.hits,
                           ledger.misses)

    def reset_peak(self) -> None:
        """Start measuring ``peak`` again from the current use."""
        self._ledger.peak = self._ledger.in_use
