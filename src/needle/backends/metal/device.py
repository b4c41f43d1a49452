"""The Metal device: the system's default MTLDevice, one queue, one allocator, its kernels."""

from __future__ import annotations

from ...errors import DeviceError
from ...hal import Device
from .compiler import MetalExecutableCache
from .memory import MetalAllocator
from .queue import MetalQueue

# Metal reports no core count. Apple GPUs have 7 to 80 cores; work-splitting heuristics
# read this, and a mid-range figure keeps them sensible everywhere.
ESTIMATED_CORES = 16


class MetalDevice(Device):
    """``api`` is the ``Metal`` module (PyObjC's, or the emulator's stand-in)."""

    dtypes = frozenset({"float16", "bfloat16", "float32", "int32", "int64", "bool", "uint8",
                        "int8"})

    def __init__(self, api):
        mtl = api.MTLCreateSystemDefaultDevice()
        if mtl is None:
            raise DeviceError("Metal found no GPU (MTLCreateSystemDefaultDevice returned nil)")
        self.api = api
        self.mtl = mtl
        self.name = "metal"
        self.model = str(mtl.name())
        self.arch = _family(api, mtl)
        if not mtl.supportsFamily_(api.MTLGPUFamilyApple7):
            raise DeviceError(f"Metal GPU {self.model} ({self.arch}) is older than Apple7 (M1): "
                              "needle's kernels need its simd-group matrices. Virtual machines "
                              "(GitHub's macOS runners) expose such a paravirtual GPU")
        self.compute_units = ESTIMATED_CORES
        self.simd_width = 32
        self.max_threads_per_group = int(mtl.maxThreadsPerThreadgroup().width)
        self.max_shared_bytes = int(mtl.maxThreadgroupMemoryLength())
        self.total_memory = int(mtl.recommendedMaxWorkingSetSize())
        self.allocator = MetalAllocator(self.name, mtl, api)
        self.queue = MetalQueue(self)
        self.executables = MetalExecutableCache(self.name, mtl, api)

    def describe(self) -> str:
        return (f"metal {self.model} ({self.arch}, {self.total_memory / 2**30:.1f} GiB "
                "working set)")


def _family(api, mtl) -> str:
    """The newest Apple GPU family the device supports ("apple7" is M1, "apple9" M3/M4)."""
    for n in range(10, 0, -1):
        family = getattr(api, f"MTLGPUFamilyApple{n}", None)
        if family is not None and mtl.supportsFamily_(family):
            return f"apple{n}"
    return "unknown"
