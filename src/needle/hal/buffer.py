"""Buffer: a range of device memory (CUDA: a CUdeviceptr; Metal: an MTLBuffer).

A buffer knows the allocator (and pool) it came from and goes back there when released,
explicitly or when the last reference to it dies. Buffers imported from another framework
(DLPack) have no allocator: releasing one drops the reference that keeps the foreign
memory alive.
"""

from __future__ import annotations


class Buffer:
    """``nbytes`` usable bytes at ``offset`` bytes into the backend object ``handle``.

    ``capacity`` is the size of the block actually reserved (a size class), ``pool`` the
    pool that block returns to. ``owner`` keeps foreign memory alive for imported buffers.
    Backends subclass this to add what their dispatch needs (CUDA: the device address).
    """

    __slots__ = ("handle", "offset", "nbytes", "capacity", "pool", "owner", "__weakref__")

    def __init__(self, handle, nbytes: int, capacity: int, pool=None, offset: int = 0,
                 owner=None):
        self.handle = handle
        self.offset = offset
        self.nbytes = nbytes
        self.capacity = capacity
        self.pool = pool
        self.owner = owner

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

    def __del__(self):
        try:  # release(), inline: every array an op makes ends here
            pool = self.pool
            if pool is not None:
                pool.give_back(self.handle, self.capacity)
        except Exception:  # never raise from a finalizer (e.g. at interpreter exit)
            pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.nbytes} bytes)"
