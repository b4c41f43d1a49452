"""The "nccl" backend: collectives on CUDA arrays, enqueued on the device's stream.

NCCL reads and writes device memory in stream order, so a collective is one more piece
of queued work: the host does not wait, and inside a capture (``queue.capture()``) the
collective is recorded into the CUDA graph like a kernel. The graph keeps the buffers it
reads alive, as it does for kernels. Waiting (``barrier``, ``synchronize``) polls with a
deadline and aborts the communicator when it passes, which makes the device's pending
collectives return instead of spinning forever.
"""

from __future__ import annotations

import time

from .. import step_hooks
from ..backend_ndarray import NDArray
from ..errors import DistributedError
from . import nccl


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

    # --- pointers ------------------------------------------------------------------------
    def _address(self, x: NDArray) -> int:
        if x.device != self.device:
            raise DistributedError(f"this process group's NCCL communicator is on "
                                   f"{self.device.name}, the array on {x.device.name}")
        buf = x.handle.buffer
        recording = self.queue.capturing
        if recording is not None:  # a recorded collective must keep its memory alive
            recording.buffers.append(buf)
        return buf.handle + buf.offset + x.offset * x.itemsize

    def _check(self, result: int, what: str) -> None:
        nccl.check(result, what, self.comm)

    # --- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: NDArray, op: str) -> None:
        if step_hooks.deferred(lambda: self.all_reduce(x, op), x):  # ndl.compile, fusing
            return
        p = self._address(x)
        self._check(nccl.library().ncclAllReduce(p, p, x.size, nccl.DTYPES[x.dtype],
                                                 nccl.OPS[op], self.comm, self._stream),
                    "ncclAllReduce")

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

    def synchronize(self) -> None:
        """Wait for the queued work, at most the timeout; on expiry abort the communicator
        (so that the device stops waiting for the missing rank) and raise."""
        event = self.queue.event()
        event.record()
        deadline = time.monotonic() + self.timeout
        while not event.query():
            error = nccl.async_error(self.comm)
            if error:
                self._abort()
                nccl.check(error, "a queued NCCL collective")
            if time.monotonic() > deadline:
                self._abort()
                raise DistributedError(f"NCCL work did not finish within {self.timeout:.0f} s: "
                                       "another rank has not joined a collective (hung, died, "
                                       "or called a different one); the communicator was "
                                       "aborted")
            time.sleep(1e-4)

    def _abort(self) -> None:
        if self.comm is not None:
            nccl.library().ncclCommAbort(self.comm)
            self.comm = None

    def close(self) -> None:
        """Wait (with the deadline) for queued collectives, then free the communicator; a
        wait that times out has aborted it instead, and raises."""
        if self.comm is not None:
            self.synchronize()
            nccl.library().ncclCommDestroy(self.comm)
            self.comm = None
