"""The caching allocator: size classes, pool reuse, statistics, the OOM path, private pools."""

from __future__ import annotations

import gc
import sys

import pytest

from needle.errors import OutOfMemoryError
from needle.hal import Buffer, Pool, size_class, trace
from needle.hal._native import Ledger

from .host_memory import HostAllocator

MIB = 1 << 20


def test_size_classes_round_up_with_bounded_waste():
    assert size_class(0) == size_class(1) == 512
    for n in (513, 1000, 4097, 10**6, 3 * MIB + 1, 1 << 30, (1 << 30) + 1):
        c = size_class(n)
        assert n <= c <= n * 1.125 + 512
    assert size_class(1 << 30) == 1 << 30  # powers of two are classes exactly


def test_freed_blocks_are_reused_and_counted():
    alloc = HostAllocator(64 * MIB)
    a = alloc.allocate(1000)
    assert alloc.stats().misses == 1 and alloc.stats().hits == 0
    handle = a.handle
    del a
    gc.collect()
    b = alloc.allocate(900)  # same size class: served from the pool
    assert b.handle == handle
    s = alloc.stats()
    assert (s.hits, s.misses, alloc.raw_allocs) == (1, 1, 1)
    assert s.in_use == size_class(900) and s.reserved == size_class(1000)


def test_stats_track_in_use_reserved_and_peak():
    alloc = HostAllocator(64 * MIB)
    bufs = [alloc.allocate(MIB) for _ in range(3)]
    s = alloc.stats()
    assert s.in_use == s.reserved == s.peak == 3 * MIB
    bufs.pop().release()
    s = alloc.stats()
    assert (s.in_use, s.reserved, s.peak) == (2 * MIB, 3 * MIB, 3 * MIB)
    alloc.empty_cache()
    assert alloc.stats().reserved == 2 * MIB and alloc.used == 2 * MIB
    alloc.reset_peak()
    assert alloc.stats().peak == 2 * MIB


def test_out_of_memory_empties_the_pool_and_retries():
    alloc = HostAllocator(4 * MIB)
    a = alloc.allocate(3 * MIB)
    a.release()  # cached, not returned: the device budget is still spent
    assert alloc.available() == MIB
    b = alloc.allocate(2 * MIB)  # fails once, empties the pool, succeeds on the retry
    assert alloc.raw_frees == 1 and b.nbytes == 2 * MIB


def test_out_of_memory_error_says_requested_and_available():
    alloc = HostAllocator(4 * MIB)
    keep = alloc.allocate(3 * MIB)
    with pytest.raises(OutOfMemoryError, match=r"requested 2097152 bytes.*1048576 bytes"):
        alloc.allocate(2 * MIB)
    assert keep.nbytes == 3 * MIB  # the live buffer is untouched


def test_private_pool_keeps_its_blocks_until_closed():
    alloc = HostAllocator(64 * MIB)
    with alloc.private_pool("graph") as pool:
        inside = alloc.allocate(MIB)
        inside_handle = inside.handle
        inside.release()  # back to the private pool only
        again = alloc.allocate(MIB)
        assert again.handle == inside_handle
    outside = alloc.allocate(MIB)  # the default pool cannot see the private pool's blocks
    assert outside.handle != inside_handle
    again.release()
    assert pool.free and alloc.stats().reserved == 2 * MIB
    pool.close()
    assert alloc.stats().reserved == MIB and alloc.raw_frees == 1
    late = alloc.allocate(2 * MIB)
    with alloc.private_pool("short") as p2:
        held = alloc.allocate(MIB)
    p2.close()
    held.release()  # a closed pool's block goes straight back to the device
    assert alloc.stats().reserved == MIB + 2 * MIB
    assert late.nbytes == 2 * MIB


def test_a_private_pools_free_blocks_survive_empty_cache_and_oom():
    """A capture's freed blocks are its graph's working memory (a later kernel of the graph
    reuses them): emptying the cache, or the out-of-memory retry, must not free them."""
    alloc = HostAllocator(4 * MIB)
    with alloc.private_pool("graph") as pool:
        alloc.allocate(2 * MIB).release()  # freed inside the capture: kept by the pool
    assert alloc.stats().reserved == 2 * MIB
    alloc.empty_cache()
    assert alloc.stats().reserved == 2 * MIB and alloc.raw_frees == 0
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(3 * MIB)  # the retry empties the shared pool only
    assert pool.free and alloc.raw_frees == 0
    pool.close()
    assert alloc.stats().reserved == 0 and alloc.raw_frees == 1


def test_views_share_memory_and_never_free():
    alloc = HostAllocator(64 * MIB)
    base = alloc.allocate(4096)
    view = base.view(1024, 512)
    assert view.handle == base.handle and view.offset == 1024 and view.owner is base
    view.release()
    assert alloc.stats().in_use == 4096


def test_trace_prints_allocations(capsys):
    alloc = HostAllocator(64 * MIB)
    trace.set_enabled(True)
    try:
        alloc.allocate(2048).release()
        alloc.allocate(2048)
    finally:
        trace.set_enabled(False)
    err = capsys.readouterr().err
    assert "alloc" in err and "2.0 KiB on host (new block" in err and "pool hit" in err


class _Block:
    """A block handle that is a Python object with state (as Metal's MTLBuffer wrappers)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _ObjectAllocator(HostAllocator):
    def _allocate_raw(self, nbytes: int):
        return _Block(nbytes) if super()._allocate_raw(nbytes) is not None else None

    def _free_raw(self, handle) -> None:
        self.used -= handle.nbytes
        self.raw_frees += 1


def test_a_buffer_dying_in_a_garbage_cycle_returns_an_intact_block():
    """An array dropped inside a reference cycle (a traceback's frames, say) is freed by the
    cycle collector: its block must come back to the pool unbroken, not with its handle's
    state cleared by the collector first."""
    alloc = _ObjectAllocator(64 * MIB)
    for _ in range(20):
        cycle = [alloc.allocate(1000)]
        cycle.append(cycle)
        del cycle
        gc.collect()
        again = alloc.allocate(1000)
        assert again.handle.nbytes == size_class(1000)  # the same block, its state intact
        assert alloc.stats().in_use == size_class(1000)
        del again
    assert alloc.raw_allocs == 1 and alloc.stats().hits == 39


def test_buffers_made_by_the_pool_are_the_allocators_buffer_type():
    class Tagged(Buffer):
        __slots__ = ()

        def tag(self) -> str:
            return f"tagged {self.nbytes}"

    class TaggedAllocator(HostAllocator):
        buffer_type = Tagged

    alloc = TaggedAllocator(64 * MIB)
    buf = alloc.allocate(100)
    assert type(buf) is Tagged and buf.tag() == "tagged 100" and buf.capacity == 512
    assert buf.pool is not None and buf.owner is None and buf.offset == 0
    view = buf.view(16, 32)
    assert type(view) is Tagged and view.root() is buf and view.capacity == 0
    import weakref

    ref = weakref.ref(buf)
    del buf
    assert ref() is not None  # the view keeps its base alive
    del view
    assert ref() is None and alloc.stats().in_use == 0


def test_a_pool_refuses_a_negative_size_and_a_foreign_buffer_type():
    alloc = HostAllocator(64 * MIB)
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)
    with pytest.raises(TypeError, match="BufferBase"):
        Pool(Ledger(), "bad", False, alloc._reserve, alloc._release_block, dict)


def test_an_uninitialized_pool_raises_instead_of_crashing():
    pool = Pool.__new__(Pool)
    with pytest.raises(RuntimeError, match="never initialized"):
        pool.allocate(16)
    with pytest.raises(RuntimeError, match="never initialized"):
        pool.give_back(123, 512)
    with pytest.raises(RuntimeError, match="never initialized"):
        pool.empty()
    with pytest.raises(RuntimeError, match="never initialized"):
        _ = pool.free
    reports = []
    previous, sys.unraisablehook = sys.unraisablehook, reports.append
    try:
        buf = Buffer(5, 8, 512)
        buf.pool = pool  # its finalizer reports the refusal as unraisable, and goes on
        del buf
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert len(reports) == 1 and isinstance(reports[0].exc_value, RuntimeError)
