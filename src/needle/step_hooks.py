"""The few places where library code asks whether ``ndl.compile`` is recording a step.

``compiled.py`` sets ``recorder`` while it runs a step to record it. Optimizers and
learning-rate schedulers hand their ``step`` to it (``handled``): their scalars (learning
rate, step count) change every call, so a recording runs them on the host at every replay
instead of freezing them. Code that would read device memory on the host only to validate
its input (``nn.SoftmaxLoss`` on host-memory devices) checks ``recording()`` and validates on
the device instead, so that the step stays capturable.
"""

from __future__ import annotations

recorder = None  # the active compiled.StepRecorder, or None


def recording() -> bool:
    return recorder is not None


def deferred(run, *arrays) -> bool:
    """Device work that reaches the device's queue without going through its backend (NCCL
    collectives on its stream) calls this first: while ``ndl.compile`` keeps a step's
    backend calls back to fuse them, it keeps ``run`` back too, in its place among them, and
    returns True (the caller returns). ``arrays``: the NDArrays ``run`` reads or writes.
    False otherwise (the caller runs it now)."""
    return recorder is not None and recorder.defer(run, arrays)


def handled(owner, run) -> bool:
    """Give ``run`` (``owner``'s step without this hook) to the recorder; True when it took
    it (the caller returns), False outside a recording (the caller runs it)."""
    return recorder is not None and recorder.host_step(owner, run)
