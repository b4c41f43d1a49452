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
    def __init__(self, device, tuning: MetalTuning | None = None):
        super().__init__(device, "metal", tuning or MetalTuning.from_env())
        self._retuned()

    def _retuned(self) -> None:
        self.queue.commit_every = self.tuning.commit_every
        self.queue.max_in_flight = self.tuning.max_in_flight
