"""The hardware abstraction layer (design §4): small classes, one hardware concept each.

GPU backends implement these for their API (CUDA through cuda-bindings, Metal through
PyObjC); ``needle.backends.gpu`` implements the array API once, against them.
"""

from . import trace
from .allocator import Allocator, MemoryStats, Pool, size_class
from .buffer import Buffer
from .command_buffer import CommandBuffer
from .device import Device
from .event import Event
from .executable import Executable, Kernel
from .executable_cache import DiskCache, ExecutableCache
from .profiler import KernelTime, Profiler
from .queue import Queue

__all__ = [
    "Allocator", "Buffer", "CommandBuffer", "Device", "DiskCache", "Event", "Executable",
    "ExecutableCache", "Kernel", "KernelTime", "MemoryStats", "Pool", "Profiler", "Queue",
    "size_class", "trace",
]
