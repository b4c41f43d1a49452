"""Buffer: a range of device memory (CUDA: a CUdeviceptr; Metal: an MTLBuffer).

A buffer knows the pool its block came from and goes back there when released,
explicitly or when the last reference to it dies. Buffers imported from another framework
(DLPack) have no pool: releasing one drops the reference that keeps the foreign memory
alive.

The fields and the finalizer are native (``BufferBase``, hal/native/blocks.cc): every op
makes and frees a buffer, and a Python ``__init__`` and ``__del__`` cost more than the
rest of the allocation (docs/cuda_notes.md v23). The methods are here.
"""

from __future__ import annotations

from ._native import BufferBase


class Buffer(BufferBase):
    """``nbytes`` usable bytes at ``offset`` bytes into the backend object ``handle``.

    ``capacity`` is the size of the block actually reserved (a size class), ``pool`` the
    pool that block returns to. ``owner`` keeps foreign memory alive for imported buffers.
    Backends subclass this (with ``__slots__ = ()``) to add methods (Metal: ``host_view``).
    """

    __slots__ = ()

    def view(self, offset: int, nbytes: int) -> Buffer:
        """The bytes ``[offset, offset + nbytes)`` of this buffer, sharing its memory (the view
        keeps this buffer alive and never returns memory to a pool itself)."""
        return type(self)(self.handle, nbytes, 0, None, self.offset + offset, owner=self)

    def root(self) -> Buffer:
        """The buffer that owns this one's memory: itself, or the block a view was made of."""
        root = self
        while isinstance(root.owner, Buffer):
            root = root.owner
        return root

    def release(self) -> None:
        """Give the memory back now (to its pool, or to its foreign owner)."""
        pool, self.pool, self.owner = self.pool, None, None
        if pool is not None:
            pool.give_back(self.handle, self.capacity)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.nbytes} bytes)"
