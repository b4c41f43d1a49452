"""A CUDA device: CUdevice + its primary context, one queue, one allocator, NVRTC kernels."""

from __future__ import annotations

from ...errors import DeviceError
from ...hal import Device
from . import driver
from .compiler import CudaExecutableCache, nvrtc_version
from .driver import check, cu
from .memory import CudaAllocator
from .queue import CudaQueue


def _attribute(dev, name: str) -> int:
    attr = getattr(cu.CUdevice_attribute, name)
    return int(check(cu.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


class CudaDevice(Device):
    dlpack_device_type = 2  # kDLCUDA

    def __init__(self, index: int):
        driver.init()
        nvrtc_version()  # fail now, with the reason, rather than at the first kernel
        count = driver.device_count()
        if not 0 <= index < count:
            raise DeviceError(f"cuda({index}) does not exist: {count} CUDA device(s) found")
        dev = check(cu.cuDeviceGet(index), "cuDeviceGet")
        self.cu_device = dev
        self.context = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        driver.bind(self.context)
        major = _attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = _attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        self.capability = 10 * major + minor
        self.arch = f"sm_{self.capability}"
        self.model = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0")[0]
        self.model = self.model.decode(errors="replace")
        self.name = f"cuda:{index}"
        self.dlpack_device_id = index
        self.compute_units = _attribute(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        self.simd_width = _attribute(dev, "CU_DEVICE_ATTRIBUTE_WARP_SIZE")
        self.max_threads_per_group = _attribute(dev, "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK")
        self.max_shared_bytes = _attribute(
            dev, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        self.total_memory = int(check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
        if self.capability < 70:
            raise DeviceError(f"{self.model} (compute capability {major}.{minor}) is older "
                              "than needle's kernels support (7.0)")
        self.allocator = CudaAllocator(self.name, self.context)
        self.executables = CudaExecutableCache(self.name, self.capability, self.compute_units,
                                               self.context)
        self.queue = CudaQueue(self)

    def describe(self) -> str:
        return f"{self.name} {self.model} ({self.arch}, {self.compute_units} SMs, " \
               f"{self.total_memory / 2**30:.1f} GiB)"
