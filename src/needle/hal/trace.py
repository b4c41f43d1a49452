"""Tracing: ``NEEDLE_TRACE=1`` prints every allocation, copy, compile and dispatch.

Like Halide's Debug target, tracing makes the device synchronous: each queue waits for
every operation it traces, so the printed time is that operation's own (its enqueue plus
its execution), not the time of whatever happened to be queued before it. Use it to find
what a program does and what each step costs; never leave it on for benchmarks.
"""

from __future__ import annotations

import os
import sys
import time

enabled: bool = os.environ.get("NEEDLE_TRACE", "") not in ("", "0")


def set_enabled(on: bool) -> None:
    """Turn tracing on or off at run time (tests and interactive sessions)."""
    global enabled
    enabled = bool(on)


def emit(kind: str, what: str, seconds: float) -> None:
    """Print one trace line: what happened, and how long it took."""
    print(f"[needle] {kind:<9} {seconds * 1e6:11.1f} us  {what}", file=sys.stderr, flush=True)


class Span:
    """Times one traced operation: ``with Span("copy", "h2d 4 KiB", queue): ...``.

    When given a queue, the span waits for it before stopping the clock, so device work
    is counted. Cheap to construct; does nothing when tracing is off.
    """

    __slots__ = ("kind", "what", "queue", "start")

    def __init__(self, kind: str, what: str, queue=None):
        self.kind, self.what, self.queue = kind, what, queue
        self.start = 0.0

    def __enter__(self) -> Span:
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.queue is not None:
            self.queue.synchronize()
        emit(self.kind, self.what, time.perf_counter() - self.start)


def nbytes_str(n: int) -> str:
    """A short human size: 512 B, 4.0 KiB, 1.5 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
