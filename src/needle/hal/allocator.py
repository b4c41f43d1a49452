"""Allocator: a caching pool of device memory, by size class, with statistics.

Device allocation is slow (cuMemAlloc synchronizes; MTLDevice.newBuffer is a system call)
and training loops free and reallocate the same sizes every step, so freed buffers go back
to a pool and the next request of the same size class takes one from there. All work of a
device runs in order on its one queue, so a block freed while a queued kernel still reads
it can be handed out again at once: whatever writes it next is queued after that kernel.

On out-of-memory the allocator empties every pool, retries once, and then raises
``OutOfMemoryError`` with the bytes requested and available.

A graph capture (``Queue.capture``) allocates from a *private* pool: blocks it frees during
capture are reused only inside the capture (replays repeat the same order), and blocks it
still holds stay out of the shared pool until the graph is dropped. A private pool's free
blocks are the graph's working memory, so ``empty_cache`` (and the out-of-memory retry)
leave them alone; closing the pool returns them.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import OutOfMemoryError
from . import trace
from .buffer import Buffer

MIN_BLOCK = 512


def size_class(nbytes: int) -> int:
    """The block size serving a request: 8 classes per power of two (waste under 12.5%)."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    step = 1 << max(9, nbytes.bit_length() - 4)
    return (nbytes + step - 1) // step * step


@dataclass(frozen=True)
class MemoryStats:
    """Bytes in live buffers, bytes held from the device (live + cached), the highest
    ``in_use`` so far, and how many requests the pool served (hits) or did not (misses)."""

    in_use: int
    reserved: int
    peak: int
    hits: int
    misses: int


def _locked(method):
    """Run ``method`` holding the allocator's lock: threads allocate and free concurrently
    (a buffer is freed by whichever thread drops its last reference)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:  # a pool holds its allocator's lock
            return method(self, *args, **kwargs)

    return run


class Pool:
    """Free blocks by size class. The allocator's default pool, or a capture's private one."""

    def __init__(self, allocator: Allocator, name: str, private: bool = False):
        self.allocator = allocator
        self.lock = allocator.lock
        self.name = name
        self.free: dict[int, list] = {}
        self.closed = False
        self.private = private  # a capture's pool (private_pool): emptied only by close()

    @_locked
    def take(self, capacity: int):
        blocks = self.free.get(capacity)
        return blocks.pop() if blocks else None

    def give_back(self, handle, capacity: int) -> None:
        with self.lock:  # inline, not @_locked: every freed array comes here
            alloc = self.allocator
            alloc._in_use -= capacity
            if self.closed:
                alloc._release_block(handle, capacity)
            else:
                self.free.setdefault(capacity, []).append(handle)

    @_locked
    def empty(self) -> None:
        """Return every cached block of this pool to the device."""
        free, self.free = self.free, {}
        for capacity, blocks in free.items():
            for handle in blocks:
                self.allocator._release_block(handle, capacity)

    def close(self) -> None:
        """Empty the pool; blocks still in use go to the device when they are released."""
        self.empty()
        self.closed = True
        if self in self.allocator._pools:
            self.allocator._pools.remove(self)


class Allocator:
    """Caching device allocator. Backends implement the three raw hooks below."""

    buffer_type: type[Buffer] = Buffer

    def __init__(self, device_name: str):
        self.device_name = device_name
        self.lock = threading.RLock()  # its pools share it
        self._default = Pool(self, "default")
        self._pool = self._default
        self._pools: list[Pool] = [self._default]
        self._in_use = self._reserved = self._peak = self._hits = self._misses = 0

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
        start = time.perf_counter() if trace.enabled else 0.0
        capacity = MIN_BLOCK if nbytes <= MIN_BLOCK else size_class(nbytes)
        with self.lock:  # inline, not @_locked: the hot path of every op
            pool = self._pool
            blocks = pool.free.get(capacity)  # pool.take, inline
            handle = blocks.pop() if blocks else None
            hit = handle is not None
            if hit:
                self._hits += 1
            else:
                self._misses += 1
                handle = self._reserve(capacity, nbytes)
            self._in_use += capacity
            if self._in_use > self._peak:
                self._peak = self._in_use
        if trace.enabled:
            trace.emit("alloc", f"{trace.nbytes_str(nbytes)} on {self.device_name} "
                       f"({'pool hit' if hit else 'new block'}, pool {pool.name})",
                       time.perf_counter() - start)
        return self.buffer_type(handle, nbytes, capacity, pool)

    def _reserve(self, capacity: int, requested: int):
        handle = self._allocate_raw(capacity)
        if handle is None:
            self.empty_cache()
            handle = self._allocate_raw(capacity)
        if handle is None:
            avail = self.available()
            raise OutOfMemoryError(
                f"out of memory on {self.device_name}: requested {requested} bytes "
                f"({trace.nbytes_str(requested)}, block {trace.nbytes_str(capacity)}), "
                f"{avail} bytes ({trace.nbytes_str(avail)}) available after emptying the "
                f"cache; {trace.nbytes_str(self._in_use)} are held by live arrays. Free "
                f"arrays you no longer need, or use smaller batches or a smaller dtype.")
        self._reserved += capacity
        return handle

    def _release_block(self, handle, capacity: int) -> None:
        self._reserved -= capacity
        self._free_raw(handle)

    @_locked
    def empty_cache(self) -> None:
        """Return every cached (unused) block of the shared pool to the device (a private
        pool's free blocks are its graph's memory: they go when the pool closes)."""
        for pool in list(self._pools):
            if not pool.private:
                pool.empty()

    @contextmanager
    def private_pool(self, name: str):
        """Serve allocations from a fresh pool inside the block; yields the pool.

        The caller owns the pool and closes it when its user (a captured graph) is gone.
        """
        pool = Pool(self, name, private=True)
        self._pools.append(pool)
        previous, self._pool = self._pool, pool
        try:
            yield pool
        finally:
            self._pool = previous

    def stats(self) -> MemoryStats:
        return MemoryStats(self._in_use, self._reserved, self._peak, self._hits, self._misses)

    def reset_peak(self) -> None:
        """Start measuring ``peak`` again from the current use."""
        self._peak = self._in_use
