"""Devices: which backends exist, whether each can run here, and which one to use.

A device is a name plus a lazily loaded backend (an object or module that implements the
array API, design §3). This layer never imports a backend module at import time; it asks
``needle.backends.<kind>.load(index)``, which returns the backend or raises ``DeviceError``
saying why the device cannot be used.
"""

from __future__ import annotations

import importlib
import os

import numpy as np

from ..backends.api import missing_functions
from ..errors import DeviceError
from . import dtypes

_MODULES = {
    "cpu_numpy": "needle.backends.numpy_ref",
    "cpu": "needle.backends.cpu",
    "cuda": "needle.backends.cuda",
    "metal": "needle.backends.metal",
}
_PRIORITY = ("cuda", "metal", "cpu", "cpu_numpy")


class Device:
    """A device on which NDArrays live: ``cpu_numpy()``, ``cpu()``, ``cuda(i)``, ``metal()``."""

    def __init__(self, kind: str, index: int = 0):
        self.kind = kind
        self.index = index
        self._backend = None
        self._reason: str | None = None

    @property
    def name(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind

    def _load(self) -> None:
        if self._backend is not None or self._reason is not None:
            return
        try:
            module = importlib.import_module(_MODULES[self.kind])
            load = getattr(module, "load", None)
            if load is None:  # e.g. a source folder without its package (a namespace package)
                raise DeviceError(f"{module.__name__} has no load(), so it does not implement "
                                  "the array API")
            backend = load(self.index)
            missing = missing_functions(backend)
            if missing:  # e.g. an extension built from older sources
                raise DeviceError(f"the {self.kind} backend lacks {', '.join(missing[:6])}"
                                  f"{' ...' if len(missing) > 6 else ''} of the array API "
                                  "(backends/api.py); reinstall needle (pip install -e .)")
            self._backend = backend
        except DeviceError as e:
            self._reason = str(e)
        except ImportError as e:
            self._reason = f"{self.kind} backend could not be imported: {e}"

    def enabled(self) -> bool:
        self._load()
        return self._backend is not None

    @property
    def reason(self) -> str | None:
        """Why the device is disabled, or None when it is enabled."""
        self._load()
        return self._reason

    @property
    def backend(self):
        backend = self._backend
        if backend is not None:  # the hot path: every array-API call asks
            return backend
        self._load()
        if self._backend is None:
            raise DeviceError(f"device {self.name} is not available: {self._reason}")
        return self._backend

    def synchronize(self) -> None:
        """Block until all work queued on this device has finished."""
        self.backend.synchronize()

    # needle-style constructors --------------------------------------------------------
    def empty(self, shape, dtype="float32"):
        from .ndarray import NDArray

        return NDArray.make(tuple(shape), device=self, dtype=dtypes.canonical(dtype))

    def full(self, shape, fill_value, dtype="float32"):
        arr = self.empty(shape, dtype)
        arr.fill(fill_value)
        return arr

    def rand(self, *shape, dtype="float32", generator: np.random.Generator | None = None):
        gen = generator or np.random.default_rng()
        from .ndarray import NDArray

        return NDArray(gen.random(shape, dtype=np.float64), device=self, dtype=dtype)

    def randn(self, *shape, dtype="float32", generator: np.random.Generator | None = None):
        gen = generator or np.random.default_rng()
        from .ndarray import NDArray

        return NDArray(gen.standard_normal(shape), device=self, dtype=dtype)

    def one_hot(self, n: int, i, dtype="float32"):
        from .ndarray import NDArray

        idx = np.asarray(i.numpy() if hasattr(i, "numpy") else i, dtype=np.int64)
        return NDArray(np.eye(n)[idx], device=self, dtype=dtype)

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{self.name}()" if self.kind != "cuda" else f"cuda({self.index})"


_DEVICES: dict[tuple[str, int], Device] = {}


def _get(kind: str, index: int = 0) -> Device:
    key = (kind, index)
    if key not in _DEVICES:
        _DEVICES[key] = Device(kind, index)
    return _DEVICES[key]


def cpu_numpy() -> Device:
    """The numpy reference backend: always enabled, defines what every op means."""
    return _get("cpu_numpy")


def cpu() -> Device:
    """The native CPU backend (C++17 + OpenMP)."""
    return _get("cpu")


def cuda(i: int = 0) -> Device:
    """NVIDIA GPU number ``i`` (CUDA driver API, kernels compiled by NVRTC)."""
    if not isinstance(i, int) or isinstance(i, bool) or i < 0:
        raise DeviceError(f"cuda device index must be a non-negative int, got {i!r}")
    return _get("cuda", i)


def metal() -> Device:
    """The system's default Apple GPU (Metal through PyObjC)."""
    return _get("metal")


def all_devices() -> list[Device]:
    """Every device needle knows of, enabled or not (each GPU listed once per index)."""
    devices = [cpu_numpy(), cpu(), metal()]
    count = 1
    try:
        count = max(1, importlib.import_module(_MODULES["cuda"]).device_count())
    except Exception:  # the cuda module reports its own reason through cuda(0)
        count = 1
    devices[1:1] = [cuda(i) for i in range(count)]
    return devices


def as_device(device) -> Device | None:
    """Whatever names a device, as a Device: a Device, a name ('cpu', 'cuda:1', 'auto'), an
    int (``device=0`` is cuda:0, as in PyTorch) or None (left to the caller's default). A
    device that cannot run here raises DeviceError with the reason."""
    if device is None or isinstance(device, Device):
        return device
    if isinstance(device, str):
        dev = device_from_name(device)
    elif isinstance(device, int) and not isinstance(device, bool):
        dev = cuda(device)
    else:
        raise DeviceError(f"device must be a Device, a name such as 'cpu' or 'cuda:0', or a "
                          f"CUDA index, got {device!r}")
    if not dev.enabled():
        raise DeviceError(f"device {dev.name} is not available: {dev.reason}")
    return dev


def device_from_name(name: str) -> Device:
    """Parse 'cpu', 'cpu_numpy', 'cuda', 'cuda:1', 'metal' or 'auto'."""
    name = name.strip().lower()
    if name in ("auto", "default", ""):
        return default_device()
    kind, _, idx = name.partition(":")
    if kind not in _MODULES:
        raise DeviceError(f"unknown device {name!r}; use auto, cpu, cpu_numpy, cuda[:i] or metal")
    if idx and (kind != "cuda" or not idx.isdigit()):
        raise DeviceError(f"bad device index in {name!r}; only cuda takes one, as cuda:0")
    return _get(kind, int(idx or 0))


def default_device() -> Device:
    """The best enabled device (cuda, then metal, then cpu), or ``$NEEDLE_DEVICE``."""
    env = os.environ.get("NEEDLE_DEVICE")
    if env:
        dev = device_from_name(env)
        if not dev.enabled():
            raise DeviceError(f"NEEDLE_DEVICE={env} names a disabled device: {dev.reason}")
        return dev
    for kind in _PRIORITY:
        dev = _get(kind)
        if dev.enabled():
            return dev
    return cpu_numpy()
