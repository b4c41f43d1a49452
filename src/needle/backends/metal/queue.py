"""The Metal queue: an MTLCommandQueue fed by one open command buffer at a time.

Dispatches are encoded into the open MTLCommandBuffer's compute encoder (many dispatches,
one encoder; a serial encoder runs them in order). The buffer is committed when the host
needs data, or after ``commit_every`` dispatches so the GPU starts while the host keeps
encoding; at most ``max_in_flight`` committed buffers run ahead of the host (both set by the
backend from its ``MetalTuning``). A command
buffer's status and error are checked once it completes, and a failed one raises
``KernelLaunchError`` naming the kernels it ran.

Metal hands back command buffers, encoders and errors autoreleased: every method that makes
them runs inside ``objc.autorelease_pool()``, so they are freed per dispatch instead of piling
up (a Python program has no pool of its own).

Host memory is shared with the GPU, so uploads are copies into the buffer's contents: done
directly when the GPU is idle, otherwise staged in a fresh buffer and copied by a blit in
queue order (a block recycled by the allocator may still be read by queued kernels).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ...errors import DeviceError, KernelLaunchError
from ...hal import CommandBuffer, Event, Queue
from ...hal.queue import locked

MAX_SET_BYTES = 4096  # setBytes limit; larger params go in a buffer


class MetalEvent(Event):
    """A point in the queue: the command buffer committed last when it was recorded.

    Metal times whole command buffers (GPUStartTime/GPUEndTime), so ``elapsed_ms`` between
    two events recorded around one dispatch (what the profiler does) is that dispatch's
    command buffer's GPU time; across several buffers it is the GPU time between their ends.
    """

    def __init__(self, queue: MetalQueue):
        self._queue = queue
        self.seq = -1
        self.command_buffer = None

    def record(self) -> None:
        self._queue.commit()
        self.seq, self.command_buffer = self._queue.last_committed()

    def synchronize(self) -> None:
        self._queue.wait_through(self.seq)

    def query(self) -> bool:
        return self._queue.reached(self.seq)

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, MetalEvent) or end.command_buffer is None or end.seq <= self.seq:
            return 0.0
        cb = end.command_buffer
        if end.seq == self.seq + 1 or self.command_buffer is None:
            return 1000.0 * (float(cb.GPUEndTime()) - float(cb.GPUStartTime()))
        return 1000.0 * (float(cb.GPUEndTime()) - float(self.command_buffer.GPUEndTime()))


class MetalCapture(CommandBuffer):
    """Recorded dispatches and device copies; ``replay`` encodes them again, in order.

    Holds every buffer they touch, so that memory cannot be recycled while a replay may use it.
    """

    def __init__(self, queue: MetalQueue):
        super().__init__()
        self._queue = queue
        self.commands: list[tuple] = []

    def replay(self) -> None:
        if self.closed:
            raise DeviceError("this recording is closed"
                              + (f": {self.closed_because}" if self.closed_because else ""))
        with self._queue.lock:
            for kind, args in self.commands:
                if kind == "dispatch":
                    self._queue._encode_dispatch(*args)
                else:
                    self._queue._encode_copy(*args)

    @property
    def kernels(self) -> int:
        """Dispatches recorded (copies not counted), as CudaGraph.kernels."""
        return sum(1 for kind, _ in self.commands if kind == "dispatch")

    def describe(self) -> str:
        return f"recording of {len(self.commands)} commands"

    def _release(self) -> None:
        self.commands = []


class MetalQueue(Queue):
    def __init__(self, device):
        super().__init__()
        import objc  # PyObjC (or the emulator's stand-in), present wherever Metal is

        self._pool = objc.autorelease_pool
        self.device = device
        self._api = device.api
        self.mtl_queue = device.mtl.newCommandQueue()
        if self.mtl_queue is None:
            raise DeviceError("Metal could not create a command queue")
        self._cb = None
        self._encoder = None
        self._encoder_kind = ""
        self._encoder_shared = 0  # threadgroup memory length set on the open encoder
        self._names: list[str] = []  # kernels encoded into the open command buffer
        self._in_flight: deque[tuple[int, object, list[str]]] = deque()
        self._seq = 0
        self._last = (0, None)
        # tests/metal_emulator's fake Metal wants each argument's length (not a Metal API)
        self._emulated = bool(getattr(self._api, "NEEDLE_EMULATOR", False))
        self.commit_every = 64
        self.max_in_flight = 8

    # --- command buffers ---------------------------------------------------------------
    def _encoder_for(self, kind: str):
        if self._encoder_kind != kind:
            self._end_encoding()
            if self._cb is None:
                self._cb = self.mtl_queue.commandBuffer()
            self._encoder = (self._cb.computeCommandEncoder() if kind == "compute"
                             else self._cb.blitCommandEncoder())
            self._encoder_kind = kind
            self._encoder_shared = 0  # a new encoder starts with no threadgroup memory set
        return self._encoder

    def _end_encoding(self) -> None:
        if self._encoder is not None:
            self._encoder.endEncoding()
            self._encoder, self._encoder_kind = None, ""

    @locked
    def commit(self) -> None:
        """Send the open command buffer to the GPU (does not wait)."""
        if self._cb is None:
            return
        with self._pool():
            self._commit()

    def _commit(self) -> None:
        self._end_encoding()
        self._cb.commit()
        self._seq += 1
        self._in_flight.append((self._seq, self._cb, self._names))
        self._last = (self._seq, self._cb)
        self._cb, self._names = None, []
        while len(self._in_flight) > self.max_in_flight:
            self._wait_oldest()

    @locked
    def last_committed(self) -> tuple[int, object]:
        return self._last

    def _wait_oldest(self) -> None:
        with self._pool():
            self._wait_for(*self._in_flight.popleft())

    def _wait_for(self, seq: int, cb, names: list[str]) -> None:
        cb.waitUntilCompleted()
        if cb.status() == self._api.MTLCommandBufferStatusError:
            error = cb.error()
            text = error.localizedDescription() if error is not None else "no error information"
            shown = ", ".join(dict.fromkeys(names[:8])) + (", ..." if len(names) > 8 else "")
            raise KernelLaunchError(f"a Metal command buffer on {self.device.name} failed: "
                                    f"{text}. It ran {len(names)} dispatch(es): {shown}")

    @locked
    def wait_through(self, seq: int) -> None:
        """Wait for every command buffer committed up to number ``seq``; raise if one failed."""
        while self._in_flight and self._in_flight[0][0] <= seq:
            self._wait_oldest()

    @locked
    def reached(self, seq: int) -> bool:
        done = (self._api.MTLCommandBufferStatusCompleted, self._api.MTLCommandBufferStatusError)
        return all(cb.status() in done for s, cb, _ in self._in_flight if s <= seq)

    @locked
    def idle(self) -> bool:
        """True when no work is open or in flight (the host may touch any buffer)."""
        return self._cb is None and not self._in_flight

    def _wait_all(self) -> None:
        self.commit()
        self.wait_through(self._seq)

    def event(self) -> MetalEvent:
        return MetalEvent(self)

    # --- dispatch ----------------------------------------------------------------------
    def _prepare_dispatch(self, kernel, groups, threads, buffers, params, shared_bytes,
                          raw_args):
        if raw_args:
            raise KernelLaunchError(f"kernel {kernel.name}: Metal takes no by-value arguments "
                                    "beyond the params struct")
        count = threads[0] * threads[1] * threads[2]
        if count > kernel.max_threads or min(threads) < 1:
            raise KernelLaunchError(
                f"kernel {kernel.name}: a threadgroup of {tuple(threads)} ({count} threads) is "
                f"more than its pipeline allows (maxTotalThreadsPerThreadgroup "
                f"{kernel.max_threads}, threadExecutionWidth {kernel.simd_width}); launch "
                f"geometry must come from the kernel's limits")
        shared = (shared_bytes + 15) // 16 * 16  # Metal wants multiples of 16 bytes
        if shared + kernel.static_shared > self.device.max_shared_bytes:
            raise KernelLaunchError(
                f"kernel {kernel.name}: {shared + kernel.static_shared} bytes of threadgroup "
                f"memory exceed the device's {self.device.max_shared_bytes}")
        if groups[0] * groups[1] * groups[2] == 0:
            return None
        return kernel, tuple(groups), tuple(threads), list(buffers), bytes(params), shared

    def _submit(self, command) -> None:
        self._encode_dispatch(*command)

    def _record_dispatch(self, command, buffers) -> None:
        self.capturing.commands.append(("dispatch", command))

    def _encode_dispatch(self, kernel, groups, threads, buffers, params: bytes,
                         shared: int) -> None:
        with self._pool():
            self._encode(kernel, groups, threads, buffers, params, shared)
        if len(self._names) >= self.commit_every:
            self.commit()

    def _encode(self, kernel, groups, threads, buffers, params: bytes, shared: int) -> None:
        enc = self._encoder_for("compute")
        enc.setComputePipelineState_(kernel.handle)
        for i, b in enumerate(buffers):
            enc.setBuffer_offset_atIndex_(b.handle, b.offset, i)
            if self._emulated:  # the emulator checks bounds against the buffer, not its block
                enc.needleSetArgumentLength_atIndex_(b.nbytes, i)
        if len(params) > MAX_SET_BYTES:
            blob = self.device.mtl.newBufferWithBytes_length_options_(
                params, len(params), self._api.MTLResourceStorageModeShared)
            enc.setBuffer_offset_atIndex_(blob, 0, len(buffers))
        elif params:
            enc.setBytes_length_atIndex_(params, len(params), len(buffers))
        # the length set on an encoder stays for its later dispatches, and Metal counts it
        # against each one's limit: a kernel without dynamic memory after one with 24 KB
        # would be refused, so set it whenever it changes, back to 0 too
        if shared != self._encoder_shared:
            enc.setThreadgroupMemoryLength_atIndex_(shared, 0)
            self._encoder_shared = shared
        size = self._api.MTLSizeMake
        enc.dispatchThreadgroups_threadsPerThreadgroup_(size(*groups), size(*threads))
        self._names.append(kernel.name)

    # --- copies ------------------------------------------------------------------------
    def _upload(self, dst, dst_offset: int, src: np.ndarray) -> None:
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if self.idle():
            dst.host_view()[dst_offset:dst_offset + data.nbytes] = data
            return
        staging = self.device.mtl.newBufferWithBytes_length_options_(
            data.tobytes(), data.nbytes, self._api.MTLResourceStorageModeShared)
        if staging is None:  # no memory for a staging copy: wait, then write in place
            self.synchronize()
            dst.host_view()[dst_offset:dst_offset + data.nbytes] = data
        else:
            self._encode_copy(_Staging(staging), 0, dst, dst_offset, data.nbytes)

    def _download(self, src, src_offset: int, dst: np.ndarray) -> None:
        self.synchronize()
        if dst.nbytes:
            out = dst.reshape(-1).view(np.uint8)
            out[:] = src.host_view()[src_offset:src_offset + out.nbytes]

    def _device_copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        self._encode_copy(src, src_offset, dst, dst_offset, nbytes)

    def _record_copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        self.capturing.commands.append(("copy", (src, src_offset, dst, dst_offset, nbytes)))

    def _encode_copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        with self._pool():
            blit = self._encoder_for("blit")
            blit.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size_(
                src.handle, src.offset + src_offset, dst.handle, dst.offset + dst_offset,
                nbytes)

    def _no_host_copy_in_capture(self, what: str) -> None:
        if self.capturing is not None:
            raise DeviceError(f"cannot {what} while recording a command buffer: a recording "
                              "replays device work only. Copy inputs into recorded arrays "
                              "before replay() and read outputs after it")

    # --- recording ---------------------------------------------------------------------
    def _new_recording(self) -> MetalCapture:
        return MetalCapture(self)


class _Staging:
    """A one-off upload buffer in the shape ``_encode_copy`` reads (handle, offset)."""

    __slots__ = ("handle", "offset")

    def __init__(self, handle):
        self.handle, self.offset = handle, 0
