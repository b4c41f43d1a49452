"""Metal memory: MTLBuffers in shared storage behind the HAL's caching allocator.

Apple GPUs share memory with the CPU, so a buffer's ``contents()`` is plain host memory
that numpy views without a copy (``host_view``). Only the host must not touch it while
queued GPU work may still use it: the queue stages uploads and waits before reads.
"""

from __future__ import annotations

import numpy as np

from ...hal import Allocator, Buffer


class MetalBuffer(Buffer):
    """``handle`` is an MTLBuffer (one per pool block); ``offset`` bytes into it."""

    __slots__ = ()

    def host_view(self) -> np.ndarray:
        """The buffer's bytes as a uint8 numpy array aliasing the MTLBuffer (no copy)."""
        length = int(self.handle.length())
        whole = np.frombuffer(self.handle.contents().as_buffer(length), dtype=np.uint8)
        return whole[self.offset:self.offset + self.nbytes]


class MetalAllocator(Allocator):
    """Blocks are MTLBuffers with ``MTLResourceStorageModeShared``."""

    buffer_type = MetalBuffer

    def __init__(self, device_name: str, mtl_device, api):
        super().__init__(device_name)
        self._mtl = mtl_device
        self._options = api.MTLResourceStorageModeShared

    def _allocate_raw(self, nbytes: int):
        return self._mtl.newBufferWithLength_options_(nbytes, self._options)  # None when full

    def _free_raw(self, handle) -> None:
        """Nothing to do: PyObjC releases the MTLBuffer with its last Python reference."""

    def available(self) -> int:
        return max(0, int(self._mtl.recommendedMaxWorkingSetSize())
                   - int(self._mtl.currentAllocatedSize()))
