"""Event: a point in a queue's stream of work (CUDA: CUevent; Metal: MTLSharedEvent).

Recording an event marks "everything queued so far"; the host can wait for that point,
ask whether it was reached, or measure device time between two recorded events.
"""

from __future__ import annotations


class Event:
    """A marker recorded into a queue. Backends implement all four methods."""

    def record(self) -> None:
        """Mark the current end of the queue."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until the queue reaches this event."""
        raise NotImplementedError

    def query(self) -> bool:
        """True when the queue has reached this event (never blocks)."""
        raise NotImplementedError

    def elapsed_ms(self, end: Event) -> float:
        """Device milliseconds from this event to ``end`` (both recorded and reached)."""
        raise NotImplementedError
