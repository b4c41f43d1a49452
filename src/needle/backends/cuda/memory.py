"""Device memory: cuMemAlloc/cuMemFree behind the HAL's caching allocator."""

from __future__ import annotations

from ...hal import Allocator
from .driver import bind, check, cu

_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def address(a) -> int:
    """The CUdeviceptr of a GpuArray's first element (its block plus the view's offset)."""
    return a.buffer.handle + a.buffer.offset


class CudaAllocator(Allocator):
    """Blocks are CUdeviceptr addresses (ints); cuMemAlloc aligns them to 256 bytes. Every
    driver call binds the device's context first: the pool misses of any thread reach it."""

    def __init__(self, device_name: str, context):
        super().__init__(device_name)
        self.context = context

    def _allocate_raw(self, nbytes: int):
        bind(self.context)
        ret = cu.cuMemAlloc(nbytes)
        if ret[0] == _OOM:
            return None
        return int(check(ret, f"cuMemAlloc({nbytes})"))

    def _free_raw(self, handle) -> None:
        bind(self.context)
        check(cu.cuMemFree(handle), "cuMemFree")

    def available(self) -> int:
        bind(self.context)
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)
