"""Queue: the device's in-order stream of work (CUDA: a CUstream; Metal: an MTLCommandQueue).

Everything is asynchronous: ``dispatch`` and device-side copies enqueue and return. The
host waits only in ``copy_to_host`` (it needs the data) and ``synchronize``;
``copy_to_host_later`` starts a read whose wait comes later. One queue per
device keeps every operation in program order, which is what lets the allocator recycle a
buffer as soon as its last user is *queued* rather than finished.

Dispatch ABI (docs/kernels.md): ``buffers`` are the kernel's buffer arguments in order,
``params`` the packed bytes of its one params struct, ``shared_bytes`` the dynamic shared
(threadgroup) memory per group, ``groups`` and ``threads`` the grid, each as (x, y, z).

This base class owns what every queue does alike — tracing (``NEEDLE_TRACE``), profiling,
recording into a CommandBuffer, refusing host copies while recording — and a backend's
queue implements only the hardware's part: the ``_``-prefixed methods below.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..errors import DeviceError
from . import trace
from .buffer import Buffer
from .command_buffer import CommandBuffer
from .event import Event
from .executable import Kernel
from .profiler import Profiler


def locked(method):
    """Run ``method`` holding its queue's lock (see ``Queue.lock``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return run


class Queue:
    """In-order device work on ``self.device``. Backends implement every method that
    raises NotImplementedError below."""

    def __init__(self):
        self.profiler: Profiler | None = None
        self.capturing: CommandBuffer | None = None
        # Threads may share a device (one trains while another generates): the public
        # methods hold this lock (@locked), so an open command buffer or encoder is never
        # used by one thread while another ends it. Re-entrant: methods call each other.
        self.lock = threading.RLock()

    # --- launches --------------------------------------------------------------------------
    def dispatch(self, kernel: Kernel, groups: tuple[int, int, int],
                 threads: tuple[int, int, int], buffers: Sequence[Buffer],
                 params: bytes = b"", shared_bytes: int = 0, raw_args=()) -> None:
        """Enqueue one kernel launch (recorded instead, while capturing). ``raw_args``:
        by-value arguments after the params struct, where the backend supports them."""
        with self.lock:  # inline, not @locked: every launch comes here
            command = self._prepare_dispatch(kernel, groups, threads, buffers, params,
                                             shared_bytes, raw_args)
            if command is None:
                return
            if self.capturing is None and self.profiler is None and not trace.enabled:
                self._submit(command)  # the hot path: one check, one call
            else:
                self._dispatch_slow(kernel, groups, threads, shared_bytes, buffers, command)

    def _dispatch_slow(self, kernel, groups, threads, shared_bytes, buffers, command) -> None:
        """A launch while capturing, tracing or profiling."""
        if self.capturing is not None:
            self._record_dispatch(command, buffers)
        elif trace.enabled:
            with trace.Span("dispatch", f"{kernel.name} groups={tuple(groups)} "
                                        f"threads={tuple(threads)} shared={shared_bytes}", self):
                self._submit(command)
        else:
            start, end = self.event(), self.event()
            start.record()
            self._submit(command)
            end.record()
            self.profiler.add(kernel.name, start, end)

    def _prepare_dispatch(self, kernel, groups, threads, buffers, params, shared_bytes,
                          raw_args):
        """Check the launch and turn it into the backend's command; None: nothing to run."""
        raise NotImplementedError

    def _submit(self, command) -> None:
        """Enqueue a prepared command for execution."""
        raise NotImplementedError

    def _record_dispatch(self, command, buffers) -> None:
        """Add a prepared command to the recording in ``self.capturing``."""
        raise NotImplementedError

    # --- copies ----------------------------------------------------------------------------
    @locked
    def copy_from_host(self, dst: Buffer, dst_offset: int, src: np.ndarray) -> None:
        """Enqueue a copy of the contiguous array ``src`` to ``dst`` at ``dst_offset`` bytes.
        ``src`` may be reused as soon as this returns."""
        self._no_host_copy_in_capture("copy from the host")
        if not src.nbytes:
            return
        if trace.enabled:
            with trace.Span("copy", f"host to {self.device.name}, "
                                    f"{trace.nbytes_str(src.nbytes)}", self):
                self._upload(dst, dst_offset, src)
            return
        self._upload(dst, dst_offset, src)

    @locked
    def copy_to_host(self, src: Buffer, src_offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes from ``src`` at ``src_offset`` into the contiguous
        array ``dst``, after all queued work; returns when the data is there."""
        self._no_host_copy_in_capture("read data back to the host")
        if trace.enabled:
            with trace.Span("copy", f"{self.device.name} to host, "
                                    f"{trace.nbytes_str(dst.nbytes)}"):
                self._download(src, src_offset, dst)
            return
        self._download(src, src_offset, dst)

    @locked
    def copy_to_host_later(self, src: Buffer, src_offset: int,
                           nbytes: int) -> Callable[[], np.ndarray]:
        """Start reading ``nbytes`` bytes of ``src`` at ``src_offset``, after all queued work,
        without waiting for them: returns a function that waits and returns the bytes (a new
        uint8 array). Work queued afterwards may run meanwhile; it does not change what is
        read. This default reads at once; backends with asynchronous copies override it."""
        out = np.empty(nbytes, np.uint8)
        self.copy_to_host(src, src_offset, out)
        return lambda: out

    @locked
    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int,
             nbytes: int) -> None:
        """Enqueue a device-to-device copy (recorded, while capturing)."""
        if not nbytes:
            return
        if self.capturing is not None:
            self._record_copy(src, src_offset, dst, dst_offset, nbytes)
        else:
            self._device_copy(src, src_offset, dst, dst_offset, nbytes)

    def _upload(self, dst: Buffer, dst_offset: int, src: np.ndarray) -> None:
        raise NotImplementedError

    def _download(self, src: Buffer, src_offset: int, dst: np.ndarray) -> None:
        """Copy into ``dst`` after all queued work, and wait for it."""
        raise NotImplementedError

    def _device_copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int,
                     nbytes: int) -> None:
        raise NotImplementedError

    def _record_copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int,
                     nbytes: int) -> None:
        raise NotImplementedError

    def _no_host_copy_in_capture(self, what: str) -> None:
        if self.capturing is not None:
            raise DeviceError(f"cannot {what} while recording device work: a recording "
                              "replays device work only. Copy inputs into recorded arrays "
                              "before replay() and read outputs after it")

    # --- waiting ---------------------------------------------------------------------------
    @locked
    def synchronize(self) -> None:
        """Block until all queued work has finished; raise if any of it failed."""
        if self.capturing is not None:
            raise DeviceError("cannot synchronize while recording device work")
        self._wait_all()

    def _wait_all(self) -> None:
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

    # --- recording -------------------------------------------------------------------------
    @contextmanager
    def capture(self) -> Iterator[CommandBuffer]:
        """Record the work enqueued inside the block, instead of running it, into the
        CommandBuffer yielded (ready to ``replay()`` after the block). Memory allocated
        inside comes from the recording's private pool."""
        if self.capturing is not None:
            raise DeviceError("device work is already being recorded on this queue")
        recording = self._new_recording()
        with self.device.allocator.private_pool(f"recording@{id(recording):x}") as pool:
            recording.pool = pool
            self._begin_capture(recording)
            self.capturing = recording
            try:
                yield recording
            except BaseException:
                self.capturing = None
                self._abort_capture(recording)
                recording.close()
                raise
            self.capturing = None
            self._end_capture(recording)
        if trace.enabled:
            trace.emit("capture", f"{recording.describe()} on {self.device.name}", 0.0)

    def _new_recording(self) -> CommandBuffer:
        raise NotImplementedError

    def _begin_capture(self, recording: CommandBuffer) -> None:
        """Start recording (CUDA: begin the stream capture)."""

    def _end_capture(self, recording: CommandBuffer) -> None:
        """Finish a recording so that it can be replayed."""

    def _abort_capture(self, recording: CommandBuffer) -> None:
        """Discard a recording whose block raised."""

    # --- profiling -------------------------------------------------------------------------
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
