"""The CUDA backend: NVIDIA GPUs through the driver API (cuda-bindings) and NVRTC.

``load(i)`` builds the array API for device ``i`` (a ``CudaBackend``: the generic GPU
backend over a ``CudaDevice``, with CUDA's tuning and kernels) or raises ``DeviceError``
saying why CUDA cannot be used here: no cuda-bindings, no NVRTC, no driver, or no such
device.
"""

from __future__ import annotations

from ...errors import DeviceError
from . import driver

_BACKENDS: dict[int, object] = {}


def device_count() -> int:
    """How many CUDA devices this process can use (0 without a driver or cuda-bindings)."""
    return driver.device_count()


def load(index: int = 0):
    """The array-API backend for CUDA device ``index`` (one per device, created once)."""
    backend = _BACKENDS.get(index)
    if backend is None:
        if driver.IMPORT_ERROR:
            raise DeviceError(driver.IMPORT_ERROR)
        from .backend import CudaBackend
        from .device import CudaDevice

        backend = _BACKENDS[index] = CudaBackend(CudaDevice(index))
    return backend
