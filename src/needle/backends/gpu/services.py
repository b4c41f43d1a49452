"""What a GPU backend offers beyond the array API (capabilities in ``backends/api.py``):
recording and replaying work, profiling, memory statistics, and DLPack exchange."""

from __future__ import annotations

import math

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import DeviceError, DTypeError
from ...hal import Buffer, dlpack
from .array import GpuArray
from .base import GpuBase


class ServiceOps(GpuBase):
    # --- graphs, profiling, memory ("graphs", "profiling", "memory_stats") ------------------
    def capture(self):
        """``with backend.capture() as graph: ...`` records the enclosed device work;
        ``graph.replay()`` runs it again with one launch (see hal.CommandBuffer)."""
        return self.queue.capture()

    def profile(self):
        """``with backend.profile() as prof: ...``; then ``print(prof.table())``."""
        return self.queue.profile()

    def memory_stats(self):
        return self.allocator.stats()

    def memory_available(self) -> int:
        """Bytes this backend can still hand out: free device memory plus what the caching
        pool holds unused."""
        stats = self.allocator.stats()
        return int(self.allocator.available()) + stats.reserved - stats.in_use

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    # --- DLPack ("dlpack", where the device has a DLPack device type) -----------------------
    def dlpack_device(self) -> tuple[int, int]:
        if self.device.dlpack_device_type is None:
            raise DeviceError(f"{self.device.name} arrays cannot be exchanged through DLPack")
        return self.device.dlpack_device_type, self.device.dlpack_device_id

    def to_dlpack(self, a: GpuArray, shape, strides, offset, stream=None):
        """A DLPack capsule viewing the array's memory (no copy). The consumer's ``stream``
        (CUDA stream handle; None: the host) is made to wait for work queued on this array."""
        dev_type, dev_id = self.dlpack_device()
        if a.dtype not in dlpack._CODES:
            raise DTypeError(f"{a.dtype} cannot be exchanged through DLPack")
        if stream is None:
            self.queue.synchronize()
        elif stream != -1:
            self.queue.make_stream_wait(int(stream))
        address = a.buffer.handle + a.buffer.offset + offset * ITEMSIZE[a.dtype]
        return dlpack.export(address, tuple(shape), tuple(strides), a.dtype, dev_type, dev_id,
                             a)

    def from_dlpack(self, x, ndarray_cls):
        """Wrap a DLPack-exporting device array (PyTorch, CuPy) as an NDArray, zero-copy."""
        from ...backend_ndarray.device import device_from_name

        dev_type, dev_id = self.dlpack_device()
        try:
            capsule = x.__dlpack__(stream=self.queue.handle)
        except TypeError:
            capsule = x.__dlpack__()
        t = dlpack.consume(capsule)
        if (t.device_type, t.device_id) != (dev_type, dev_id):
            raise DeviceError(f"DLPack tensor is on device ({t.device_type}, {t.device_id}), "
                              f"not on {self.device.name}; move it there first")
        item = ITEMSIZE[t.dtype]
        strides = t.strides
        if strides is None:
            strides, step = [], 1
            for d in reversed(t.shape):
                strides.insert(0, step)
                step *= d
            strides = tuple(strides)
        if math.prod(t.shape) == 0:
            lo, hi = 0, 0
        else:
            lo = sum(s * (d - 1) for d, s in zip(t.shape, strides) if s < 0)
            hi = sum(s * (d - 1) for d, s in zip(t.shape, strides) if s > 0) + 1
        span = hi - lo
        buffer = Buffer(t.address + lo * item, span * item, 0, None, 0, owner=t.owner)
        array = GpuArray(buffer, span, t.dtype)
        return ndarray_cls.make(t.shape, strides, device_from_name(self.device.name), array,
                                -lo, t.dtype)
