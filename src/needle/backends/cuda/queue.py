"""The CUDA queue: one non-blocking CUstream; launches, copies, events and graph capture.

Launch arguments follow docs/kernels.md: buffer addresses, then one params struct. They
are packed into a scratch block whose i-th 8-byte slot holds argument i, so one fixed
``void*[]`` array (slot addresses) serves every kernel: with n buffers, argument n (the
params struct) starts at slot n. The driver copies arguments at launch, so the scratch
block is reused by the next launch.

Arguments larger than a slot that follow the params struct (``raw_args``: a TMA tensor map,
128 bytes passed by value) get their own 64-byte-aligned places in a second block and a
``void*[]`` array built for that launch; the common path does not change.

Inside a graph capture on sm_90+ (``CudaTuning.pdl``; ``NEEDLE_PDL=0`` turns it off),
kernels are launched with programmatic stream serialization (cuLaunchKernelEx): each kernel
of the captured sequence may be scheduled while its predecessor finishes, and waits for it
at its first line (``pdl_entry`` in common.cuh, called by every kernel). The 1.1B decode
step (~180 kernels) replays in 1.30 ms instead of 1.34 ms on an H100. Eager launches keep
cuLaunchKernel: they are bound by host time, where the cheaper call matters more, so they
call it through ``_launch`` (native/launch.cc: libcuda's function with the arguments as
integers) rather than cuda-bindings' wrapper, which converts every argument; the wrapper
remains where the module or the driver's symbol is missing, or with
``NEEDLE_CUDA_NATIVE_LAUNCH=0``. An eager launch without raw arguments, outside captures,
traces and profiles, skips the Python packing too: ``_launch.dispatch`` writes the buffer
addresses and the params struct into its own block (the same layout) and launches.
"""

from __future__ import annotations

import ctypes
import os
import struct

import numpy as np

from ...errors import DeviceError, KernelLaunchError
from ...hal import CommandBuffer, Event, Queue, trace
from ...hal.queue import locked
from .driver import bind, check, cu, error_text

try:
    from . import _launch as _native
except ImportError:  # a source tree whose extension was not built
    _native = None


def native_launch():
    """native/launch.cc's launch function, or None (then cuda-bindings launches)."""
    if os.environ.get("NEEDLE_CUDA_NATIVE_LAUNCH", "1") == "0":
        return None
    return _native.launch if _native is not None and _native.available() else None


def native_dispatch():
    """native/launch.cc's dispatch (arguments packed natively), or None where the launch
    module is not used."""
    return _native.dispatch if native_launch() is not None else None


_SLOTS = 64
_SCRATCH = 8 * _SLOTS
_PACK = [struct.Struct(f"{n}Q") for n in range(_SLOTS)]
_TOO_LARGE = -2  # _launch.dispatch: the arguments exceed its block (of _SCRATCH bytes)
_RAW_ALIGN = 64  # CUtensorMap's alignment; every raw argument starts on such a boundary
_RAW_SCRATCH = 1024
_PINNED_SLOT = 2048  # copy_to_host_later: reads this small (a serving step's 256 argmaxes)
# go through page-locked slots
_PINNED_SLOTS = 64
_UPLOAD_SLOT = 16384  # uploads this small go through page-locked slots (see _UploadRing)
_UPLOAD_SLOTS = 32


def _page_locked(size: int, context) -> tuple[int, np.ndarray]:
    """``size`` bytes of page-locked host memory: its address and a uint8 view of it."""
    bind(context)
    address = int(check(cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc"))
    return address, np.frombuffer((ctypes.c_ubyte * size).from_address(address), np.uint8)


class _PendingRead:
    """A read started by copy_to_host_later: calling it waits and returns the bytes."""

    __slots__ = ("_event", "_view", "_data")

    def __init__(self, event, view: np.ndarray):
        self._event, self._view, self._data = event, view, None

    def __call__(self) -> np.ndarray:
        if self._data is None:
            self._event.synchronize()
            self._data = self._view.copy()  # the slot may be reused once this returns
            self._event = self._view = None
        return self._data


class _UploadRing:
    """Page-locked slots for small host-to-device copies.

    A copy from pageable memory makes the driver wait for the stream's queued work first
    (CUDA's "API synchronization behavior": a stream sync before a pageable host-to-device
    transfer), so an eager step that uploads a few bytes (SoftmaxLoss's class indices, a
    label batch) waited for the GPU every time. Copied into a page-locked slot first, the
    transfer is queued like a kernel. A slot is reused only after the event recorded with
    its last copy, normally long done (32 uploads ago). The eager MLP and GPT steps did not
    get faster (they are host-bound: the device is idle when the loss uploads); the wait
    costs where the device runs behind the host (docs/training_notes.md).
    """

    def __init__(self, queue: CudaQueue):
        self._queue = queue
        self._address, self._memory = _page_locked(_UPLOAD_SLOT * _UPLOAD_SLOTS,
                                                   queue.device.context)
        self._events = [queue.event() for _ in range(_UPLOAD_SLOTS)]
        self._next = 0

    def upload(self, address: int, src: np.ndarray) -> None:
        slot = self._next
        self._next = (slot + 1) % _UPLOAD_SLOTS
        event = self._events[slot]
        event.synchronize()  # the slot's last copy has left it (never recorded: no wait)
        start = slot * _UPLOAD_SLOT
        self._memory[start:start + src.nbytes] = src.reshape(-1).view(np.uint8)
        check(cu.cuMemcpyHtoDAsync(address, self._address + start, src.nbytes,
                                   self._queue.stream), "cuMemcpyHtoDAsync")
        event.record()

    def __del__(self):
        try:
            cu.cuMemFreeHost(self._address)
        except Exception:  # never raise from a finalizer (e.g. at interpreter exit)
            pass


class CudaEvent(Event):
    def __init__(self, queue: CudaQueue):
        self._queue = queue
        bind(queue.device.context)
        self.event = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def record(self) -> None:
        check(cu.cuEventRecord(self.event, self._queue.stream), "cuEventRecord")

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.event), "cuEventSynchronize", KernelLaunchError)

    def query(self) -> bool:
        return cu.cuEventQuery(self.event)[0] == 0

    def elapsed_ms(self, end: Event) -> float:
        return float(check(cu.cuEventElapsedTime(self.event, end.event), "cuEventElapsedTime"))

    def __del__(self):
        try:
            cu.cuEventDestroy(self.event)
        except Exception:  # never raise from a finalizer (e.g. at interpreter exit)
            pass


class CudaGraph(CommandBuffer):
    """A captured stream, instantiated once; ``replay`` is one cuGraphLaunch.

    Holds every buffer its kernels touch, so their memory cannot be recycled while the
    graph may still run.
    """

    def __init__(self, queue: CudaQueue):
        super().__init__()
        self._queue = queue
        self.graph = self.exec = None
        self.buffers: list = []
        self.kernels = 0

    def replay(self) -> None:
        if self.exec is None:
            raise DeviceError("this graph cannot be replayed: "
                              + (self.closed_because or "it was not captured successfully "
                                 "or is closed"))
        check(cu.cuGraphLaunch(self.exec, self._queue.stream), "cuGraphLaunch",
              KernelLaunchError)

    def describe(self) -> str:
        return f"graph of {self.kernels} kernels"

    def _release(self) -> None:
        if self.exec is not None:
            cu.cuGraphExecDestroy(self.exec)
        if self.graph is not None:
            cu.cuGraphDestroy(self.graph)
        self.graph = self.exec = None
        self.buffers = []


class CudaQueue(Queue):
    def __init__(self, device):
        super().__init__()
        self.device = device
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING),
                            "cuStreamCreate")
        self.handle = int(self.stream)
        self._scratch = ctypes.create_string_buffer(_SCRATCH)
        base = ctypes.addressof(self._scratch)
        self._argv = (ctypes.c_void_p * _SLOTS)(*[base + 8 * i for i in range(_SLOTS)])
        self._argv_addr = ctypes.addressof(self._argv)
        self._view = memoryview(self._scratch).cast("B")
        self._raw = self._raw_argv = None  # raw-argument block, made at the first use
        self._raw_args = self._raw_fixed = self._raw_argv_addr = None  # what the block holds
        self.launch = native_launch()
        self._native_dispatch = native_dispatch()
        self.pdl = False  # set by the backend from its tuning (CudaTuning.pdl)
        self._pdl_config = None  # the CUlaunchConfig of PDL launches, made at the first use
        self._pinned = None  # page-locked slots of copy_to_host_later, made at the first use
        self._pinned_reads: list = [None] * _PINNED_SLOTS
        self._uploads: _UploadRing | None = None  # made at the first small upload
        self._pinned_next = 0

    # --- launches ------------------------------------------------------------------------
    def dispatch(self, kernel, groups, threads, buffers, params=b"", shared_bytes=0,
                 raw_args=()) -> None:
        """Queue.dispatch, with the eager hot path (no capture, trace or profile) in one
        native call that packs the arguments (raw ones included) and launches.

        The hot path takes no lock: the lock guards the queue's shared argument block and
        an open recording, and the native call packs into a block of its own thread and
        launches while holding the GIL (~0.25 us a launch saved; docs/cuda_notes.md v23).
        Queue.dispatch, the other path, takes the lock itself."""
        fast = self._native_dispatch
        if (fast is None or self.capturing is not None
                or self.profiler is not None or trace.enabled):
            Queue.dispatch(self, kernel, groups, threads, buffers, params, shared_bytes,
                           raw_args)
            return
        err = fast(kernel.address, groups, threads, shared_bytes, self.handle, buffers, params,
                   raw_args or None)
        if err:
            if err == _TOO_LARGE and raw_args:  # say which block overflowed
                self._place_raw(kernel, len(buffers) + (1 if params else 0), raw_args)
            self._launch_failed(kernel, groups, threads, shared_bytes, err,
                                8 * len(buffers) + len(params))

    def _launch_failed(self, kernel, groups, threads, shared_bytes, err, nbytes) -> None:
        if err == _TOO_LARGE:
            raise KernelLaunchError(f"{kernel.name}: {nbytes} bytes of arguments exceed "
                                    f"the {_SCRATCH}-byte launch block")
        raise KernelLaunchError(f"launching {kernel.name} with groups={groups} "
                                f"threads={threads} shared={shared_bytes} failed: "
                                f"{error_text(err)}")

    def _prepare_dispatch(self, kernel, groups, threads, buffers, params, shared_bytes,
                          raw_args):
        """The launch block: buffer addresses then the params struct; ``raw_args`` (e.g.
        128-byte tensor maps) each get their own 64-byte-aligned copy, which the driver
        copies at launch (graph capture included)."""
        nbytes = 8 * len(buffers) + len(params)
        if nbytes > _SCRATCH:
            self._launch_failed(kernel, groups, threads, shared_bytes, _TOO_LARGE, nbytes)
        args = _PACK[len(buffers)].pack(*[b.handle + b.offset for b in buffers]) + params
        argv = self._argv_addr if not raw_args else self._place_raw(
            kernel, len(buffers) + (1 if params else 0), raw_args)
        return kernel, groups, threads, args, shared_bytes, argv

    def _record_dispatch(self, command, buffers) -> None:
        self._submit(command)  # the stream is capturing: the launch is recorded
        self._keep(buffers)
        self.capturing.kernels += 1

    def keep(self, buffers) -> None:
        """While capturing, keep alive buffers that a launch reaches through its params
        (an address table) rather than its buffer arguments, as those are kept."""
        if self.capturing is not None:
            self._keep(buffers)

    def _keep(self, buffers) -> None:
        """Keep alive what the graph touches from outside its private pool (weights, caches,
        inputs): freed, their blocks could go to other work while the graph still runs.
        Blocks of the graph's own pool stay reserved for it until it closes, so a buffer of
        the pool freed inside the capture may serve a later allocation of the same capture,
        as eager work reuses memory in stream order: the graph holds its working set, not
        every intermediate it ever made (a 2,048-token prefill held 2 GiB)."""
        recording = self.capturing
        for b in buffers:
            pool = b.root().pool  # a view's memory is its root's
            if pool is None or pool is not recording.pool:
                recording.buffers.append(b)

    def _place_raw(self, kernel, fixed: int, raw_args) -> int:
        """Copy ``raw_args`` into the raw block (64-byte aligned each) and return the address
        of a ``void*[]`` whose first ``fixed`` entries are the usual slots (buffers, params)
        and whose next ones point at the raw copies. The same ``raw_args`` object as the
        last call's (a cached launch plan's) reuses the block as it is."""
        if raw_args is self._raw_args and fixed == self._raw_fixed:
            return self._raw_argv_addr
        if self._raw is None:
            self._raw = ctypes.create_string_buffer(_RAW_SCRATCH + _RAW_ALIGN)
        base = -(-ctypes.addressof(self._raw) // _RAW_ALIGN) * _RAW_ALIGN
        ptrs = [self._argv[i] for i in range(fixed)]
        offset = 0
        for raw in raw_args:
            if offset + len(raw) > _RAW_SCRATCH:
                raise KernelLaunchError(f"{kernel.name}: {offset + len(raw)} bytes of by-value "
                                        f"arguments exceed the {_RAW_SCRATCH}-byte raw block")
            ctypes.memmove(base + offset, raw, len(raw))
            ptrs.append(base + offset)
            offset += -(-len(raw) // _RAW_ALIGN) * _RAW_ALIGN
        # kept until the next raw launch: the driver reads the array during cuLaunchKernel
        self._raw_argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._raw_argv_addr = ctypes.addressof(self._raw_argv)
        self._raw_args, self._raw_fixed = raw_args, fixed
        return self._raw_argv_addr

    def _submit(self, command) -> None:
        kernel, groups, threads, args, shared_bytes, argv = command
        self._view[:len(args)] = args
        if self.capturing is not None and self.pdl:
            err = self._launch_pdl(kernel, groups, threads, shared_bytes, argv)
        elif self.launch is not None:
            err = self.launch(kernel.address, groups[0], groups[1], groups[2], threads[0],
                              threads[1], threads[2], shared_bytes, self.handle, argv)
        else:
            err = cu.cuLaunchKernel(kernel.handle, groups[0], groups[1], groups[2], threads[0],
                                    threads[1], threads[2], shared_bytes, self.stream, argv,
                                    0)[0]
        if err != 0:
            self._launch_failed(kernel, groups, threads, shared_bytes, err, len(args))

    def _launch_pdl(self, kernel, groups, threads, shared_bytes: int, argv: int):
        """cuLaunchKernelEx with programmatic stream serialization (see the module notes)."""
        cfg = self._pdl_config
        if cfg is None:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = self._pdl_config = cu.CUlaunchConfig()
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            cfg.hStream = self.stream
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = groups
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads
        cfg.sharedMemBytes = shared_bytes
        return cu.cuLaunchKernelEx(cfg, kernel.handle, argv, 0)[0]

    # --- copies --------------------------------------------------------------------------
    def _upload(self, dst, dst_offset: int, src: np.ndarray) -> None:
        address = dst.handle + dst.offset + dst_offset
        if src.nbytes <= _UPLOAD_SLOT:  # without waiting for the stream (_UploadRing)
            if self._uploads is None:
                self._uploads = _UploadRing(self)
            self._uploads.upload(address, src)
            return
        check(cu.cuMemcpyHtoDAsync(address, src.ctypes.data, src.nbytes, self.stream),
              "cuMemcpyHtoDAsync")

    def _download(self, src, src_offset: int, dst: np.ndarray) -> None:
        if dst.nbytes:
            address = src.handle + src.offset + src_offset
            check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, address, dst.nbytes, self.stream),
                  "cuMemcpyDtoHAsync", KernelLaunchError)
        self.synchronize()

    @locked
    def copy_to_host_later(self, src, src_offset: int, nbytes: int):
        """Small reads (a sampled token) go through a ring of page-locked slots: an
        asynchronous copy there plus an event, so the host waits for this copy only, not for
        work queued after it (a copy to pageable memory would wait for the whole stream)."""
        if nbytes > _PINNED_SLOT or self.capturing is not None:
            return super().copy_to_host_later(src, src_offset, nbytes)
        if self._pinned is None:
            self._pinned = _page_locked(_PINNED_SLOT * _PINNED_SLOTS, self.device.context)[1]
        slot = self._pinned_next
        self._pinned_next = (slot + 1) % _PINNED_SLOTS
        previous = self._pinned_reads[slot]
        if previous is not None:  # 64 reads ago, normally collected long since
            previous()
        view = self._pinned[slot * _PINNED_SLOT:slot * _PINNED_SLOT + nbytes]
        if nbytes:
            check(cu.cuMemcpyDtoHAsync(view.ctypes.data, src.handle + src.offset + src_offset,
                                       nbytes, self.stream), "cuMemcpyDtoHAsync",
                  KernelLaunchError)
        event = self.event()
        event.record()
        read = self._pinned_reads[slot] = _PendingRead(event, view)
        return read

    def _device_copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        check(cu.cuMemcpyDtoDAsync(dst.handle + dst.offset + dst_offset,
                                   src.handle + src.offset + src_offset, nbytes, self.stream),
              "cuMemcpyDtoDAsync")

    def _record_copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        self._device_copy(src, src_offset, dst, dst_offset, nbytes)  # captured by the stream
        self._keep((src, dst))

    # --- waiting -------------------------------------------------------------------------
    def _wait_all(self) -> None:
        check(cu.cuStreamSynchronize(self.stream), f"work on {self.device.name}",
              KernelLaunchError)

    def event(self) -> CudaEvent:
        return CudaEvent(self)

    def wait_for_stream(self, other_stream: int) -> None:
        """Make later work on this queue wait for what is queued now on ``other_stream``."""
        ev = self.event()
        check(cu.cuEventRecord(ev.event, cu.CUstream(other_stream)), "cuEventRecord")
        check(cu.cuStreamWaitEvent(self.stream, ev.event, 0), "cuStreamWaitEvent")

    def make_stream_wait(self, other_stream: int) -> None:
        """Make later work on ``other_stream`` wait for what is queued now on this queue."""
        ev = self.event()
        ev.record()
        check(cu.cuStreamWaitEvent(cu.CUstream(other_stream), ev.event, 0), "cuStreamWaitEvent")

    # --- graphs --------------------------------------------------------------------------
    def _new_recording(self) -> CudaGraph:
        return CudaGraph(self)

    def _begin_capture(self, graph: CudaGraph) -> None:
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        check(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")

    def _abort_capture(self, graph: CudaGraph) -> None:
        ret = cu.cuStreamEndCapture(self.stream)
        if ret[0] == 0 and ret[1] is not None:
            cu.cuGraphDestroy(ret[1])

    def _end_capture(self, graph: CudaGraph) -> None:
        graph.graph = check(cu.cuStreamEndCapture(self.stream), "capturing a graph",
                            KernelLaunchError)
        bind(self.device.context)
        graph.exec = check(cu.cuGraphInstantiate(graph.graph, 0), "cuGraphInstantiate",
                           KernelLaunchError)
