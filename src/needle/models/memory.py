"""How much device memory a model will need, and whether the device has it.

Checked before a single weight is copied, so that a model too big for the device fails in
a second with a message saying what to change, instead of minutes later in the middle of
loading. The estimate has three parts: the weights, the KV cache preallocated for the chosen
maximum sequence length, and the working set of one forward pass over a full-length prompt
(activations, the MLP's widest intermediate, last-position logits).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..backend_ndarray import dtypes
from ..backends.api import has
from ..errors import OutOfMemoryError
from .config import LlamaConfig

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model needs on its device, by part."""

    weights: int
    kv_cache: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB (weights {self.weights / GIB:.2f} GiB, KV cache "
                f"{self.kv_cache / GIB:.2f} GiB, working set {self.workspace / GIB:.2f} GiB)")


def parameter_count(cfg: LlamaConfig) -> int:
    """Number of weights in the model, the output head counted once when tied."""
    return sum(math.prod(shape) for shape in cfg.tensor_shapes().values())


def kv_cache_bytes(cfg: LlamaConfig, max_seq_len: int, batch: int = 1,
                   dtype: str = "float32") -> int:
    """Keys and values of every layer for ``max_seq_len`` positions, in the model's dtype
    (the KV cache's; see KVCache)."""
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return batch * max_seq_len * per_position * dtypes.ITEMSIZE[dtype]


def workspace_bytes(cfg: LlamaConfig, dtype: str, seq_len: int, batch: int = 1) -> int:
    """Live activations of one forward pass over ``seq_len`` tokens (a generous bound)."""
    d = cfg.head_dim
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size
                 + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * d)
    rope_tables = 2 * seq_len * d * (2 if cfg.rope_local is not None else 1)
    return (batch * seq_len * per_token + rope_tables + batch * cfg.vocab_size) * \
        dtypes.ITEMSIZE[dtype]


def estimate(cfg: LlamaConfig, dtype: str, max_seq_len: int, batch: int = 1) -> MemoryEstimate:
    return MemoryEstimate(weights=parameter_count(cfg) * dtypes.ITEMSIZE[dtype],
                          kv_cache=kv_cache_bytes(cfg, max_seq_len, batch, dtype),
                          workspace=workspace_bytes(cfg, dtype, max_seq_len, batch))


def available_bytes(device) -> int | None:
    """Free memory on ``device``, or None when it cannot be told: what a device backend's
    pool can still hand out (capability ``memory_stats``), or, for backends in host memory,
    the memory the operating system says is available."""
    backend = device.backend
    if has(backend, "memory_stats"):
        return int(backend.memory_available())
    if has(backend, "host_memory"):
        return _host_available()
    return None


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(need: MemoryEstimate, device, max_seq_len: int, dtype: str) -> None:
    """Raise OutOfMemoryError, with what to change, when ``need`` exceeds the free memory."""
    free = available_bytes(device)
    if free is None or need.total <= free:
        return
    hints = [f"a smaller max_seq_len (now {max_seq_len})"]
    if dtype == "float32":
        hints.append("dtype bfloat16 or float16 (half the bytes)")
    hints.append("another device")
    raise OutOfMemoryError(f"the model needs {need.describe()} on {device.name}, which has "
                           f"{free / GIB:.2f} GiB free; try " + ", ".join(hints))


def peak_bytes(device) -> tuple[int, str] | None:
    """(bytes, what was measured): the device pool's peak use where the backend keeps
    statistics, else the process's peak resident memory for backends in host memory."""
    backend = device.backend
    if has(backend, "memory_stats"):
        return int(backend.memory_stats().peak), f"peak {device.name} memory"
    if has(backend, "host_memory"):
        try:
            import resource
        except ImportError:  # not on Unix
            return None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if os.uname().sysname == "Darwin" else 1024  # bytes on macOS, KiB on Linux
        return rss * scale, "peak host memory (process RSS)"
    return None
