"""The engine's counters, which ``GET /metrics`` reports."""

from __future__ import annotations

import time
from collections import deque


class EngineMetrics:
    """Counters for /metrics: tokens made, and a trailing window for tokens per second."""

    WINDOW = 10.0  # seconds

    def __init__(self):
        self.generated = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # prompt tokens whose keys were found cached
        self.steps = 0
        self.queued_ahead = 0  # steps queued before the previous step's tokens were read
        self.finished: dict[str, int] = {}
        self._recent: deque[tuple[float, int]] = deque()

    def record_step(self, tokens: int, seconds: float) -> None:
        now = time.perf_counter()
        self.generated += tokens
        self.steps += 1
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - self.WINDOW:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        recent = [n for t, n in self._recent if t >= now - self.WINDOW]
        return sum(recent) / self.WINDOW if recent else 0.0
