"""How a rank waits for queued device work (``distributed.waiting.wait_until``, the NCCL
backend's ``synchronize`` and ``barrier``): a short wait is polled without sleeping (a
collective of tens of microseconds must not cost a sleep's ~150), a long one sleeps between
polls with growing intervals, errors stop it, and the deadline raises the caller's error."""

from __future__ import annotations

import time

import pytest

from needle.distributed import waiting
from needle.errors import DistributedError


class Countdown:
    """done() turns true on its n-th call."""

    def __init__(self, n: int):
        self.calls, self.n = 0, n

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def _never_expires() -> DistributedError:
    raise AssertionError("the deadline passed in a test that should not reach it")


def test_a_short_wait_never_sleeps(monkeypatch):
    sleeps = []
    monkeypatch.setattr(waiting.time, "sleep", sleeps.append)
    done = Countdown(200)
    waiting.wait_until(done, lambda: None, 10.0, _never_expires)
    assert done.calls == 200 and sleeps == []


def test_a_long_wait_sleeps_in_growing_steps_up_to_a_millisecond(monkeypatch):
    sleeps = []
    monkeypatch.setattr(waiting, "SPIN_S", -1.0)  # sleep from the first poll
    monkeypatch.setattr(waiting.time, "sleep", sleeps.append)
    waiting.wait_until(Countdown(12), lambda: None, 10.0, _never_expires)
    assert sleeps[0] == waiting.FIRST_SLEEP_S
    assert all(b == min(2 * a, waiting.LONGEST_SLEEP_S) for a, b in zip(sleeps, sleeps[1:]))
    assert max(sleeps) == waiting.LONGEST_SLEEP_S and len(sleeps) == 11


def test_the_deadline_raises_the_callers_error_once():
    made = []

    def expired() -> DistributedError:
        made.append(1)
        return DistributedError("gave up")

    start = time.monotonic()
    with pytest.raises(DistributedError, match="gave up"):
        waiting.wait_until(lambda: False, lambda: None, 0.05, expired)
    assert made == [1] and time.monotonic() - start < 5


def test_an_error_found_while_waiting_stops_the_wait():
    def check() -> None:
        raise DistributedError("a rank failed")

    done = Countdown(10**9)
    with pytest.raises(DistributedError, match="a rank failed"):
        waiting.wait_until(done, check, 10.0, _never_expires)
    assert done.calls == 0  # checked before the first poll


def test_a_wait_on_a_step_spins_as_long_as_asked(monkeypatch):
    """``spin``: a tensor-parallel server's rank waiting through a step for the next one's
    message polls without sleeping that long (a sleep can wake it up to 1 ms late)."""
    sleeps = []
    monkeypatch.setattr(waiting.time, "sleep", sleeps.append)
    start = time.monotonic()
    waiting.wait_until(lambda: time.monotonic() - start > 0.02, lambda: None, 10.0,
                       _never_expires, spin=0.05)
    assert sleeps == []
    start = time.monotonic()
    waiting.wait_until(lambda: time.monotonic() - start > 0.02, lambda: None, 10.0,
                       _never_expires, spin=0.0)
    assert sleeps  # no spin: it sleeps from the first poll that finds work outstanding
