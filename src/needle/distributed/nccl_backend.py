"""The "nccl" backend: collectives on CUDA arrays, enqueued on the device's stream.

NCCL reads and writes device memory in stream order, so a collective is one more piece
of queued work: the host does not wait, and inside a capture (``queue.capture()``) the
collective is recorded into the CUDA graph like a kernel. The graph keeps the buffers it
reads alive, as it does for kernels. Waiting (``barrier``, ``synchronize``) polls with a
deadline (``waiting.wait_until``) and aborts the communicator when it passes, which makes
the device's pending collectives return instead of spinning forever.

A graph that recorded a collective holds a reference on the communicator inside NCCL, and
``ncclCommDestroy`` (``ncclCommAbort`` too) waits until every such graph is destroyed: a
tensor-parallel decoder's captured steps, still alive when the group was left, kept
``needle generate --tp 2``'s ranks from exiting (seen on two H200s). So the backend keeps
the recordings its collectives went into and closes them before it frees the
communicator; replaying one afterwards raises an error that says why.

``symmetric_empty`` gives arrays in NCCL symmetric memory (NCCL >= 2.27): ``ncclMemAlloc``
memory registered as a window at the same place on every rank. An all-reduce whose buffers
lie in one takes NCCL's symmetric kernels, which read the peers' memory directly: on two
H200s an 8 KiB all-reduce in a graph takes 4.3 µs instead of 6.8. The windows are
deregistered when the group is left; the memory is freed when the last array over it dies
(a model may outlive its group).
"""

from __future__ import annotations

import math
import os
import weakref

from .. import step_hooks
from ..backend_ndarray import NDArray, dtypes
from ..backends.gpu.array import GpuArray
from ..errors import DistributedError
from ..hal import Buffer
from . import nccl
from .waiting import wait_until

_CLOSED = ("it recorded NCCL collectives of a process group that has since been destroyed "
           "(destroy_process_group); record the work again in a new group")


class NcclBackend:
    name = "nccl"

    def __init__(self, rank: int, world_size: int, device, store, timeout: float):
        self.rank, self.world_size, self.device, self.timeout = rank, world_size, device, timeout
        self.queue = device.backend.queue  # also makes the device's context current
        if rank == 0:
            store.set("nccl/id", nccl.unique_id())
        uid = store.get("nccl/id", what="rank 0's NCCL unique id")
        self.comm = nccl.comm_init_rank(world_size, uid, rank)
        self._stream = self.queue.handle
        self._scratch = None
        self._recordings: weakref.WeakSet = weakref.WeakSet()  # graphs holding the comm
        self._windows: list = []  # symmetric memory windows registered with the comm

    # --- symmetric memory ----------------------------------------------------------------
    def symmetric_empty(self, shape: tuple[int, ...], dtype: str) -> NDArray | None:
        """An array in a new symmetric window, or None where NCCL has no windows (before
        2.27) or NEEDLE_NCCL_SYMMETRIC=0 turns them off. Collective: every rank calls it
        with the same shape and dtype, in the same order."""
        if os.environ.get("NEEDLE_NCCL_SYMMETRIC", "1") == "0" or not nccl.has_windows():
            return None
        size = math.prod(shape)
        nbytes = max(size * dtypes.ITEMSIZE[dtype], 1)
        address, window = nccl.symmetric_alloc(self.comm, nbytes)
        self._windows.append(window)
        memory = _SymmetricMemory(address)
        buffer = Buffer(address, nbytes, 0, None, 0, owner=memory)
        return NDArray.make(shape, None, self.device, GpuArray(buffer, size, dtype), 0, dtype)

    def _deregister_windows(self) -> None:
        for window in self._windows:
            nccl.window_deregister(self.comm, window)
        self._windows.clear()

    # --- pointers ------------------------------------------------------------------------
    def _address(self, x: NDArray) -> int:
        if x.device != self.device:
            raise DistributedError(f"this process group's NCCL communicator is on "
                                   f"{self.device.name}, the array on {x.device.name}")
        buf = x.handle.buffer
        recording = self.queue.capturing
        if recording is not None:  # a recorded collective must keep its memory alive
            recording.buffers.append(buf)
            self._recordings.add(recording)
        return buf.handle + buf.offset + x.offset * x.itemsize

    def _check(self, result: int, what: str) -> None:
        nccl.check(result, what, self.comm)

    # --- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: NDArray, op: str, out: NDArray | None = None) -> None:
        out = x if out is None else out
        if step_hooks.deferred(lambda: self.all_reduce(x, op, out), x, out):  # ndl.compile
            return
        self._check(nccl.library().ncclAllReduce(self._address(x), self._address(out), x.size,
                                                 nccl.DTYPES[x.dtype], nccl.OPS[op],
                                                 self.comm, self._stream), "ncclAllReduce")

    def all_gather(self, x: NDArray, out: NDArray) -> None:
        if step_hooks.deferred(lambda: self.all_gather(x, out), x, out):
            return
        self._check(nccl.library().ncclAllGather(self._address(x), self._address(out), x.size,
                                                 nccl.DTYPES[x.dtype], self.comm, self._stream),
                    "ncclAllGather")

    def reduce_scatter(self, x: NDArray, out: NDArray, op: str) -> None:
        if step_hooks.deferred(lambda: self.reduce_scatter(x, out, op), x, out):
            return
        self._check(nccl.library().ncclReduceScatter(
            self._address(x), self._address(out), out.size, nccl.DTYPES[x.dtype],
            nccl.OPS[op], self.comm, self._stream), "ncclReduceScatter")

    def broadcast(self, x: NDArray, src: int) -> None:
        if step_hooks.deferred(lambda: self.broadcast(x, src), x):
            return
        p = self._address(x)
        self._check(nccl.library().ncclBroadcast(p, p, x.size, nccl.DTYPES[x.dtype], src,
                                                 self.comm, self._stream), "ncclBroadcast")

    # --- waiting -------------------------------------------------------------------------
    def barrier(self) -> None:
        """A one-element all-reduce, then a wait for it (and all work queued before it)."""
        from .. import backend_ndarray as nd

        if self._scratch is None:
            self._scratch = nd.zeros((1,), "float32", self.device)
        self.all_reduce(self._scratch, "sum")
        self.synchronize()

    def synchronize(self, spin: float | None = None) -> None:
        """Wait for the queued work, at most the timeout; on expiry abort the communicator
        (so that the device stops waiting for the missing rank) and raise. ``spin``:
        ``wait_until``'s."""
        event = self.queue.event()
        event.record()
        wait_until(event.query, self._raise_async_error, self.timeout, self._expired, spin)

    def _raise_async_error(self) -> None:
        error = nccl.async_error(self.comm)
        if error:
            self._abort()
            nccl.check(error, "a queued NCCL collective")

    def _expired(self) -> DistributedError:
        self._abort()
        return DistributedError(f"NCCL work did not finish within {self.timeout:.0f} s: "
                                "another rank has not joined a collective (hung, died, or "
                                "called a different one); the communicator was aborted")

    def _close_recordings(self) -> None:
        """Destroy the graphs that recorded this communicator's collectives: until they
        are gone, NCCL's destroy and abort wait for them."""
        for recording in list(self._recordings):
            recording.close(because=_CLOSED)
        self._recordings.clear()

    def _abort(self) -> None:
        if self.comm is not None:
            self._close_recordings()
            nccl.library().ncclCommAbort(self.comm)
            self.comm = None

    def close(self) -> None:
        """Wait (with the deadline) for queued collectives, close the graphs that recorded
        any, then free the communicator; a wait that times out has aborted it instead, and
        raises."""
        if self.comm is not None:
            self.synchronize()
            self._close_recordings()
            self._deregister_windows()
            nccl.library().ncclCommDestroy(self.comm)
            self.comm = None


class _SymmetricMemory:
    """Owns ``ncclMemAlloc``'d memory: freed when the last buffer over it is released."""

    def __init__(self, address: int):
        self.address = address
        weakref.finalize(self, _free_quietly, address)


def _free_quietly(address: int) -> None:
    try:  # a finalizer: at exit the driver may already be gone
        nccl.mem_free(address)
    except Exception:  # noqa: BLE001
        pass
