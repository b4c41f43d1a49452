# ruff: noqa: N802 -- method names are the Objective-C selectors PyObjC exposes
"""A CPU stand-in for PyObjC's ``Metal`` module: the subset of the API needle's backend calls.

Installed as ``sys.modules["Metal"]`` (see ``install()``), it lets ``needle.backends.metal`` run
unmodified on Linux. Kernels are compiled and run by the harness (harness.py). The fake
keeps Metal's observable contract where the backend could get it wrong:

* Command buffers run only when the host waits for them (``waitUntilCompleted``), in commit
  order. A backend that reads shared memory before waiting reads stale data here, every time,
  instead of only sometimes on a real GPU.
* Misuse Metal's validation layer would stop (encoding after commit, two open encoders, a
  threadgroup larger than the pipeline allows, threadgroup memory not a multiple of 16 bytes)
  raises ``MetalValidationError``.
* A dispatch that fails in the emulator (a divergent barrier, an unbound buffer) marks the
  command buffer ``MTLCommandBufferStatusError`` with an ``NSError``, as a GPU fault does.
* Fast math is on unless the options turn it off, as in Metal.
* New buffers are filled with 0xff bytes (NaN, -1), so reading memory nobody wrote shows.
* The emulated macOS release (``NEEDLE_METAL_EMULATOR_MACOS``, default 15.0) decides which
  MSL versions compile (3.1 from macOS 14) and whether ``MTLCompileOptions`` has
  ``setMathMode:`` (macOS 15); ``languageVersion`` sets ``__METAL_VERSION__`` and bfloat.
* Command buffers, encoders and errors made with no ``objc.autorelease_pool()`` open are
  counted in ``unpooled`` (on a Mac they would pile up).
"""

from __future__ import annotations

import fnmatch
import mmap
import os
import threading
import time
import weakref

import numpy as np

from . import fake_objc, harness
from .fake_foundation import (  # noqa: F401 -- re-exported: the Metal module has them
    MTLCompileOptions,
    MTLLanguageVersion2_4,
    MTLLanguageVersion3_0,
    MTLLanguageVersion3_1,
    MTLMathModeFast,
    MTLMathModeRelaxed,
    MTLMathModeSafe,
    NSProcessInfo,
    _ObjC,
    macos_version,
)

MTLResourceStorageModeShared = 0
MTLResourceStorageModeManaged = 1 << 4
MTLResourceStorageModePrivate = 2 << 4

MTLCommandBufferStatusNotEnqueued = 0
MTLCommandBufferStatusEnqueued = 1
MTLCommandBufferStatusCommitted = 2
MTLCommandBufferStatusScheduled = 3
MTLCommandBufferStatusCompleted = 4
MTLCommandBufferStatusError = 5

MTLGPUFamilyApple7 = 1007
MTLGPUFamilyApple8 = 1008
MTLGPUFamilyApple9 = 1009

MTLLibraryErrorCompileFailure = 3
MTLCommandBufferErrorInternal = 1

MAX_THREADS_PER_GROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024
SIMD_WIDTH = 32
MAX_SET_BYTES = 4096
GUARD_BYTES = 256 * 1024  # unused address space on each side of a buffer (bounds checks)

# Not part of Metal: tells needle's queue that it may say how many bytes of each bound buffer a
# dispatch may use (``needleSetArgumentLength_atIndex_``), which Metal's API cannot carry. The
# pool hands out blocks of a size class, so without it the bounds check would see the block.
NEEDLE_EMULATOR = True


class MetalValidationError(AssertionError):
    """What Metal's API validation would abort the process for."""


# Objective-C objects created with no autorelease pool open, by class name
unpooled: dict[str, int] = {}


def _autoreleased(obj):
    if fake_objc.depth() == 0:
        name = type(obj).__name__
        unpooled[name] = unpooled.get(name, 0) + 1
    return obj


class MTLSize:
    """PyObjC's MTLSize struct: ``MTLSize(width, height, depth)``."""

    __slots__ = ("width", "height", "depth")

    def __init__(self, width: int = 0, height: int = 0, depth: int = 0):
        self.width, self.height, self.depth = int(width), int(height), int(depth)

    def __iter__(self):
        return iter((self.width, self.height, self.depth))

    def __repr__(self) -> str:
        return f"MTLSize({self.width}, {self.height}, {self.depth})"


def MTLSizeMake(width: int, height: int, depth: int) -> MTLSize:
    return MTLSize(width, height, depth)


class NSError:
    def __init__(self, domain: str, code: int, description: str):
        self._domain, self._code, self._description = domain, code, description

    def domain(self) -> str:
        return self._domain

    def code(self) -> int:
        return self._code

    def localizedDescription(self) -> str:
        return self._description

    def __str__(self) -> str:
        return f"Error Domain={self._domain} Code={self._code} \"{self._description}\""


# ---- memory ----------------------------------------------------------------------------------

class _Contents:
    """What ``MTLBuffer.contents()`` returns in PyObjC (an objc.varlist): ``as_buffer(n)``."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def as_buffer(self, count: int) -> memoryview:
        return memoryview(self._array[:count])


class _Buffer:
    def __init__(self, device: _Device, length: int):
        self._device = device
        # page-aligned like a real MTLBuffer, inside guard bands of address space no other
        # buffer uses (untouched pages cost nothing), so that an overrun is seen as one;
        # 0xff so that reading unwritten memory shows
        span = GUARD_BYTES + (length + 4095) // 4096 * 4096 + GUARD_BYTES
        self._map = mmap.mmap(-1, span)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.extent = (whole.ctypes.data, whole.ctypes.data + span)
        self._memory = whole[GUARD_BYTES:GUARD_BYTES + length]
        self._memory[:] = 0xFF
        self._length = length
        device._allocated += length
        weakref.finalize(self, device._release, length)

    def length(self) -> int:
        return self._length

    def contents(self) -> _Contents:
        return _Contents(self._memory)

    def address(self, offset: int = 0) -> int:
        return self._memory.ctypes.data + offset


# ---- libraries and pipelines -----------------------------------------------------------------

class _Function:
    def __init__(self, library: _Library, name: str):
        self._library, self._name = library, name

    def name(self) -> str:
        return self._name


class _Library:
    def __init__(self, compiled: harness.Library):
        self._compiled = compiled

    def functionNames(self) -> list[str]:
        return sorted(self._compiled.kernels)

    def newFunctionWithName_(self, name: str):
        return _Function(self, name) if name in self._compiled.kernels else None


# Per-pipeline thread limits for tests: fnmatch pattern of kernel names -> limit; the first
# match wins, then NEEDLE_METAL_EMULATOR_MAX_THREADS, then the limit derived from the kernel.
pipeline_limits: dict[str, int] = {}


def thread_limit(kernel: str, derived: int) -> int:
    """maxTotalThreadsPerThreadgroup of ``kernel``'s pipeline. Real pipelines report less than
    the device's 1024 when a kernel needs many registers; ``derived`` is the emulator's model of
    that (harness.derived_thread_limit). Tests may replace it per pipeline, through
    ``pipeline_limits`` or ``NEEDLE_METAL_EMULATOR_MAX_THREADS`` (a number for every pipeline,
    or ``pattern=N,...`` with fnmatch patterns of kernel names, e.g. ``matmul_*=128,*=512``)."""
    rules = list(pipeline_limits.items())
    env = os.environ.get("NEEDLE_METAL_EMULATOR_MAX_THREADS", "").strip()
    if env and "=" not in env:
        rules.append(("*", int(env)))
    elif env:
        for rule in env.split(","):
            pattern, _, value = rule.partition("=")
            rules.append((pattern.strip(), int(value)))
    for pattern, limit in rules:
        if fnmatch.fnmatchcase(kernel, pattern):
            if not SIMD_WIDTH <= limit <= MAX_THREADS_PER_GROUP or limit % SIMD_WIDTH:
                raise ValueError(f"pipeline limit {limit} for {kernel}: use a multiple of "
                                 f"{SIMD_WIDTH} up to {MAX_THREADS_PER_GROUP}")
            return limit
    return derived


class _PipelineState:
    def __init__(self, function: _Function):
        self._function = function
        compiled = function._library._compiled
        self._max_threads = thread_limit(function.name(), compiled.max_threads[function.name()])
        # the kernel's own `threadgroup` variables, as Metal's compiler sizes them
        self._static = compiled.static_bytes[function.name()]

    def maxTotalThreadsPerThreadgroup(self) -> int:
        return self._max_threads

    def threadExecutionWidth(self) -> int:
        return SIMD_WIDTH

    def staticThreadgroupMemoryLength(self) -> int:
        return self._static

    def run(self, buffers, bounds, tg_lengths, groups, threads) -> str | None:
        f = self._function
        return f._library._compiled.run(f._name, buffers, tg_lengths, groups, threads,
                                        SIMD_WIDTH, bounds=bounds)


# ---- command submission ----------------------------------------------------------------------

class _Encoder:
    def __init__(self, command_buffer: _CommandBuffer):
        self._cb = command_buffer
        self._ended = False

    def _check_open(self) -> None:
        if self._ended:
            raise MetalValidationError("encoding into an encoder after endEncoding")

    def endEncoding(self) -> None:
        self._check_open()
        self._ended = True
        self._cb._open_encoder = None


class _ComputeEncoder(_Encoder):
    def __init__(self, command_buffer: _CommandBuffer):
        super().__init__(command_buffer)
        self._pipeline: _PipelineState | None = None
        self._buffers: dict[int, int] = {}
        self._bounds: dict[int, tuple[int, int, int]] = {}  # (length, allocation start, end)
        self._keep: dict[int, object] = {}  # what a bound index keeps alive, as Metal retains
        self._tg: dict[int, int] = {}

    def setComputePipelineState_(self, pipeline: _PipelineState) -> None:
        self._check_open()
        self._pipeline = pipeline

    def setBuffer_offset_atIndex_(self, buffer: _Buffer, offset: int, index: int) -> None:
        self._check_open()
        if not 0 <= offset <= buffer.length():
            raise MetalValidationError(f"offset {offset} outside a buffer of {buffer.length()}")
        self._buffers[index] = buffer.address(offset)
        self._bounds[index] = (buffer.length() - offset, *buffer.extent)
        self._keep[index] = buffer

    def needleSetArgumentLength_atIndex_(self, length: int, index: int) -> None:
        """Not Metal: the bytes of the buffer bound at ``index`` the dispatch may use."""
        self._check_open()
        bound, lo, hi = self._bounds[index]
        if not 0 <= length <= bound:
            raise MetalValidationError(f"argument length {length} beyond the {bound} bytes bound "
                                       f"at index {index}")
        self._bounds[index] = (length, lo, hi)

    def setBytes_length_atIndex_(self, data: bytes, length: int, index: int) -> None:
        self._check_open()
        if length > MAX_SET_BYTES:
            raise MetalValidationError(f"setBytes of {length} bytes (the limit is 4 KiB)")
        copy = np.frombuffer(bytes(data[:length]) + bytes(16), dtype=np.uint8).copy()
        self._buffers[index] = copy.ctypes.data
        self._bounds[index] = (length, copy.ctypes.data, copy.ctypes.data + copy.nbytes)
        self._keep[index] = copy

    def setThreadgroupMemoryLength_atIndex_(self, length: int, index: int) -> None:
        self._check_open()
        if length % 16:
            raise MetalValidationError(f"threadgroup memory length {length} is not a multiple "
                                       "of 16 bytes")
        self._tg[index] = length

    def dispatchThreadgroups_threadsPerThreadgroup_(self, groups, threads) -> None:
        self._check_open()
        if self._pipeline is None:
            raise MetalValidationError("dispatch without a compute pipeline state")
        g, t = tuple(groups), tuple(threads)
        if t[0] * t[1] * t[2] > self._pipeline.maxTotalThreadsPerThreadgroup():
            raise MetalValidationError(
                f"threadsPerThreadgroup {t} exceeds the pipeline's "
                f"maxTotalThreadsPerThreadgroup {self._pipeline.maxTotalThreadsPerThreadgroup()}")
        used = sum(self._tg.values()) + self._pipeline.staticThreadgroupMemoryLength()
        if used > MAX_THREADGROUP_MEMORY:
            raise MetalValidationError(f"{used} bytes of threadgroup memory (dynamic and the "
                                       f"pipeline's static) exceed {MAX_THREADGROUP_MEMORY}")
        self._cb._commands.append(("dispatch", self._pipeline, dict(self._buffers),
                                   dict(self._bounds), dict(self._keep), dict(self._tg), g, t))


class _BlitEncoder(_Encoder):
    def copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size_(
            self, src: _Buffer, src_offset: int, dst: _Buffer, dst_offset: int,
            size: int) -> None:
        self._check_open()
        if src_offset + size > src.length() or dst_offset + size > dst.length():
            raise MetalValidationError("blit copy outside a buffer")
        self._cb._commands.append(("copy", src, src_offset, dst, dst_offset, size))


class _CommandBuffer:
    def __init__(self, queue: _CommandQueue):
        self._queue = queue
        self._commands: list[tuple] = []
        self._open_encoder: _Encoder | None = None
        self._status = MTLCommandBufferStatusNotEnqueued
        self._error: NSError | None = None
        self._times = (0.0, 0.0)

    def _new_encoder(self, cls):
        if self._status != MTLCommandBufferStatusNotEnqueued:
            raise MetalValidationError("creating an encoder on a committed command buffer")
        if self._open_encoder is not None:
            raise MetalValidationError("creating an encoder while another one is still open")
        self._open_encoder = cls(self)
        return self._open_encoder

    def computeCommandEncoder(self) -> _ComputeEncoder:
        return _autoreleased(self._new_encoder(_ComputeEncoder))

    def blitCommandEncoder(self) -> _BlitEncoder:
        return _autoreleased(self._new_encoder(_BlitEncoder))

    def commit(self) -> None:
        if self._status != MTLCommandBufferStatusNotEnqueued:
            raise MetalValidationError("commit of a command buffer that was already committed")
        if self._open_encoder is not None:
            raise MetalValidationError("commit while an encoder is still open (endEncoding)")
        self._status = MTLCommandBufferStatusCommitted
        self._queue._pending.append(self)

    def waitUntilCompleted(self) -> None:
        if self._status == MTLCommandBufferStatusNotEnqueued:
            raise MetalValidationError("waitUntilCompleted on a command buffer never committed")
        self._queue._run_through(self)

    def status(self) -> int:
        return self._status

    def error(self) -> NSError | None:
        return None if self._error is None else _autoreleased(self._error)

    def GPUStartTime(self) -> float:
        return self._times[0]

    def GPUEndTime(self) -> float:
        return self._times[1]

    def _execute(self) -> None:
        start = time.perf_counter()
        for cmd in self._commands:
            if cmd[0] == "copy":
                _, src, so, dst, do, size = cmd
                dst._memory[do:do + size] = src._memory[so:so + size]
                continue
            _, pipeline, buffers, bounds, _keep, tg, groups, threads = cmd
            message = pipeline.run(buffers, bounds, tg, groups, threads)
            if message:
                self._error = NSError("MTLCommandBufferErrorDomain", MTLCommandBufferErrorInternal,
                                      f"Execution of the command buffer was aborted due to an "
                                      f"error during execution. ({message})")
                self._status = MTLCommandBufferStatusError
                break
        else:
            self._status = MTLCommandBufferStatusCompleted
        self._commands = []  # release what the commands kept alive, as Metal does
        self._times = (start, time.perf_counter())


class _CommandQueue:
    def __init__(self, device: _Device):
        self._device = device
        self._pending: list[_CommandBuffer] = []
        self._lock = threading.Lock()

    def commandBuffer(self) -> _CommandBuffer:
        return _autoreleased(_CommandBuffer(self))

    def _run_through(self, cb: _CommandBuffer) -> None:
        """Execute committed command buffers in order, up to and including ``cb``."""
        with self._lock:
            while cb in self._pending:
                self._pending.pop(0)._execute()


# ---- the device ------------------------------------------------------------------------------

class _Device:
    def __init__(self):
        self._allocated = 0
        budget = os.environ.get("NEEDLE_METAL_EMULATOR_MEMORY")
        self._budget = int(budget) if budget else 8 << 30

    def _release(self, length: int) -> None:
        self._allocated -= length

    def name(self) -> str:
        return "Apple GPU (needle MSL emulator)"

    def supportsFamily_(self, family: int) -> bool:
        return family <= MTLGPUFamilyApple8  # an M2-class GPU

    def hasUnifiedMemory(self) -> bool:
        return True

    def maxThreadsPerThreadgroup(self) -> MTLSize:
        return MTLSize(MAX_THREADS_PER_GROUP, MAX_THREADS_PER_GROUP, 64)

    def maxThreadgroupMemoryLength(self) -> int:
        return MAX_THREADGROUP_MEMORY

    def maxBufferLength(self) -> int:
        return self._budget

    def recommendedMaxWorkingSetSize(self) -> int:
        return self._budget

    def currentAllocatedSize(self) -> int:
        return self._allocated

    def newCommandQueue(self) -> _CommandQueue:
        return _CommandQueue(self)

    def newBufferWithLength_options_(self, length: int, options: int):
        if length <= 0 or length > self.maxBufferLength() or \
                self._allocated + length > self._budget:
            return None  # Metal returns nil when it cannot allocate
        return _Buffer(self, int(length))

    def newBufferWithBytes_length_options_(self, data, length: int, options: int):
        buf = self.newBufferWithLength_options_(length, options)
        if buf is not None:
            buf._memory[:] = np.frombuffer(data, dtype=np.uint8, count=length)
        return buf

    def newLibraryWithSource_options_error_(self, source: str, options, error):
        options = options or MTLCompileOptions.new()
        msl = options.msl()
        if msl not in (240, 300, 310) or (msl == 310 and macos_version() < (14, 0, 0)):
            return None, NSError("MTLLibraryErrorDomain", MTLLibraryErrorCompileFailure,
                                 f"Invalid language version {msl / 100:.1f} for macOS "
                                 f"{'.'.join(map(str, macos_version()))}")
        try:
            compiled = harness.build(str(source), fast_math=options.effective_fast_math(),
                                     msl=msl)
        except harness.MSLCompileError as e:
            return None, NSError("MTLLibraryErrorDomain", MTLLibraryErrorCompileFailure,
                                 f"Compilation failed: \n\n{e.log}")
        return _Library(compiled), None

    def newComputePipelineStateWithFunction_error_(self, function: _Function, error):
        return _PipelineState(function), None


_DEVICE: _Device | None = None


def MTLCreateSystemDefaultDevice() -> _Device:
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = _Device()
    return _DEVICE
