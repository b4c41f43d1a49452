"""Profiler: device time summed per kernel over a block of code.

``with backend.profile() as prof: ...`` makes the queue bracket every dispatch with a pair
of events; on exit it waits for the device and adds up the time between each pair.
``prof.table()`` prints the kernels by total time. Unlike tracing, profiling keeps the
queue asynchronous, so the sum is what the kernels cost in a real run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KernelTime:
    calls: int = 0
    total_ms: float = 0.0

    @property
    def mean_us(self) -> float:
        return 1000.0 * self.total_ms / max(self.calls, 1)


class Profiler:
    """Collects (kernel name, start event, end event) while active; sums them on ``finish``."""

    def __init__(self):
        self._pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, KernelTime] = {}

    def add(self, name: str, start, end) -> None:
        """Record one dispatch bracketed by two recorded events (anything with
        ``elapsed_ms(end)``)."""
        self._pending.append((name, start, end))

    def finish(self) -> None:
        """Resolve recorded events into totals (the queue must have been synchronized)."""
        for name, start, end in self._pending:
            t = self.totals.setdefault(name, KernelTime())
            t.calls += 1
            t.total_ms += start.elapsed_ms(end)
        self._pending.clear()

    @property
    def total_ms(self) -> float:
        return sum(t.total_ms for t in self.totals.values())

    def table(self, limit: int = 30) -> str:
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1].total_ms)[:limit]
        width = max([len(name) for name, _ in rows] + [6])
        lines = [f"{'kernel':<{width}}  {'calls':>7}  {'total ms':>10}  {'mean us':>10}"]
        for name, t in rows:
            lines.append(f"{name:<{width}}  {t.calls:>7}  {t.total_ms:>10.3f}  {t.mean_us:>10.1f}")
        lines.append(f"{'total':<{width}}  {'':>7}  {self.total_ms:>10.3f}")
        return "\n".join(lines)
