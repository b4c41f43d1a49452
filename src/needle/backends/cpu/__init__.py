"""The native CPU backend, ``cpu()``: the array API (design §3) in C++17 with OpenMP.

The kernels live in ``kernels/`` and are compiled by the package build into the extension
module ``_cpu`` (nanobind), which *is* the backend: every array-API function of
``numpy_ref`` with the same name, signature and meaning. This package only loads it.
"""

from __future__ import annotations

from types import ModuleType

from ...errors import DeviceError
from . import threads

# backends/api.py names what each one promises
CAPABILITIES = frozenset({"host_memory", "paged_attention", "int8", "int4"})


def load(index: int = 0) -> ModuleType:
    """The backend module, or DeviceError saying why the extension cannot be used here."""
    if index != 0:
        raise DeviceError(f"the cpu device has only index 0, got {index}")
    threads.configure()  # before the import loads the OpenMP runtime, which reads it once
    try:
        from . import _cpu
    except ModuleNotFoundError as e:
        raise DeviceError("the native extension is not built: run pip install -e . "
                          f"(needs a C++17 compiler and CMake) [{e}]") from e
    except ImportError as e:
        raise DeviceError(f"the native extension failed to load ({e}); rebuild it with "
                          "pip install -e .") from e
    _cpu.capabilities = CAPABILITIES
    return _cpu
