"""The Metal backend: Apple GPUs through PyObjC's Metal bindings, kernels in MSL.

``load(index)`` builds the array API (a ``MetalBackend``: the generic GPU backend over a
``MetalDevice``) or raises ``DeviceError`` saying why Metal cannot be used here (not macOS,
PyObjC's Metal bindings missing, no GPU). Metal has no float64: asking for it raises
``DTypeError``. Without a Mac the backend runs through the MSL emulator in
``tests/metal_emulator`` (docs/metal.md).
"""

from __future__ import annotations

from ...errors import DeviceError

_BACKEND = None


def load(index: int = 0):
    """The array-API backend of the system's default Metal device (created once)."""
    global _BACKEND
    if index != 0:
        raise DeviceError(f"metal has one device (the system default), not device {index}")
    if _BACKEND is None:
        try:
            import Metal
        except ImportError as e:
            raise DeviceError(f"Metal needs macOS and PyObjC's Metal bindings ({e}); install "
                              "them with: pip install 'needle[metal]'") from None
        from .backend import MetalBackend
        from .device import MetalDevice

        _BACKEND = MetalBackend(MetalDevice(Metal))
    return _BACKEND
