"""The HAL's native module (hal/native/blocks.cc), with a clear error where it was not built."""

from __future__ import annotations

try:
    from ._blocks import BufferBase, Ledger, Pool, size_class
except ImportError as e:  # a source tree used without `pip install -e .`
    raise ImportError(
        "needle's native module needle.hal._blocks is missing: needle must be installed "
        "(pip install -e . in the source tree) so that its C++ extensions are built") from e

__all__ = ["BufferBase", "Ledger", "Pool", "size_class"]
