"""``GpuBackend``: the array API (design §3) for every GPU, written once against the HAL.

Each kernel family is a mixin in its own module (elementwise, layout, reduce, matmul, nn,
decode, optim) and the services beyond the array API are in ``services``; this class puts them
together over one ``hal.Device``. Everything here is generic: a device backend supplies the
HAL device (queue, allocator, executable cache) and kernel files that follow the ABI in
docs/kernels.md, and subclasses this class for its own tuning and its own faster kernels
(``backends/cuda/backend.py``, ``backends/metal/backend.py``).

Work is asynchronous: functions enqueue and return; only ``to_numpy`` and ``synchronize``
wait. Temporary workspaces go back to the pool as soon as their launches are queued, which
is safe because one queue runs everything in order.
"""

from __future__ import annotations

from ...hal import Device
from .base import GpuTuning
from .decode import DecodeOps
from .elementwise import ElementwiseOps
from .layout import LayoutOps
from .matmul import MatmulOps
from .nn import NNOps
from .optim import OptimOps
from .paged import PagedOps
from .quant import QuantOps
from .reduce import ReduceOps
from .services import ServiceOps


class GpuBackend(ElementwiseOps, LayoutOps, ReduceOps, MatmulOps, NNOps, DecodeOps,
                 OptimOps, PagedOps, QuantOps, ServiceOps):
    """The array API over one HAL device. One instance per device."""

    def __init__(self, device: Device, name: str, tuning: GpuTuning | None = None):
        super().__init__(device, name, tuning or GpuTuning())
        caps = {"graphs", "profiling", "memory_stats", "async_read", "paged_attention", "int8",
                "int4"}
        if device.dlpack_device_type is not None:
            caps.add("dlpack")
        self.capabilities = frozenset(caps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device.describe()})"
