"""Device memory: cuMemAlloc/cuMemFree behind the HAL's caching allocator."""

from __future__ import annotations

from ...hal import Allocator
from .driver import check, cu

_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


class CudaAllocator(Allocator):
    """Blocks are CUdeviceptr addresses (ints); cuMemAlloc aligns them to 256 bytes."""

    def _allocate_raw(self, nbytes: int):
        ret = cu.cuMemAlloc(nbytes)
        if ret[0] == _OOM:
            return None
        return int(check(ret, f"cuMemAlloc({nbytes})"))

    def _free_raw(self, handle) -> None:
        check(cu.cuMemFree(handle), "cuMemFree")

    def available(self) -> int:
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)
