"""``MetalBackend``: the generic GPU backend over a Metal device, with Metal's tuning.

Every kernel Metal runs is one of the generic families' (backends/gpu); what is Metal's own
is how work is batched into command buffers, read once per device from the environment
(docs/metal.md lists the variables):

- ``NEEDLE_METAL_COMMIT_EVERY``: dispatches encoded into one command buffer before it is
  committed, so the GPU starts while the host keeps encoding (default 64).
- ``NEEDLE_METAL_IN_FLIGHT``: committed command buffers allowed to run ahead of the host
  before it waits for the oldest (default 8).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import DeviceError
from ..gpu import GpuBackend, GpuTuning
from ..gpu.array import SUFFIX


def _positive(env, name: str, default: int) -> int:
    text = env.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DeviceError(f"{name} must be a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class MetalTuning(GpuTuning):
    commit_every: int = 64
    max_in_flight: int = 8

    @classmethod
    def from_env(cls, env=os.environ) -> MetalTuning:
        return cls(commit_every=_positive(env, "NEEDLE_METAL_COMMIT_EVERY", 64),
                   max_in_flight=_positive(env, "NEEDLE_METAL_IN_FLIGHT", 8))


class MetalBackend(GpuBackend):
    wide_column_reduce = True  # reduce.metal's reduce_wide (gpu/reduce.py)

    def __init__(self, device, tuning: MetalTuning | None = None):
        super().__init__(device, "metal", tuning or MetalTuning.from_env())
        self._retuned()

    def _retuned(self) -> None:
        self.queue.commit_every = self.tuning.commit_every
        self.queue.max_in_flight = self.tuning.max_in_flight

    # --- pipelines allowing fewer threads than a kernel's tile ------------------------------
    # A Metal pipeline may report maxTotalThreadsPerThreadgroup below 256 (register pressure);
    # the generic paths launch 256-thread tiles, so these take over for such pipelines.

    def _matmul_special(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        dt = a.dtype
        if dt == "float32":
            tiles = self._kernel("matmul", f"matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}_f32")
            if tiles.max_threads >= 256:
                return False
        generic = self._kernel("matmul", f"matmul_{SUFFIX[dt]}")
        if dt != "float32" and generic.max_threads >= 256:
            return False
        # the 16x16 tile with threads (16, ty): each thread covers 16 / ty rows
        ty = max((t for t in (16, 8, 4, 2) if 16 * t <= generic.max_threads), default=2)
        self._matmul_tiles("matmul", f"matmul_{SUFFIX[dt]}", a, b, out, m, n, p, batch,
                           stride_a, stride_b, (16, 16), (16, ty), 0, ta, tb)
        return True

    def _attention_special(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                           kv_capacity, head_dim, scale, causal, window) -> bool:
        fused = self._kernel("nn", f"attention_{SUFFIX[q.dtype]}")
        if fused.max_threads >= 256:
            return False
        # composed from matmul and softmax, which fit any pipeline limit
        self._attention_composed(q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                                 kv_capacity, head_dim, scale, causal, window)
        return True
