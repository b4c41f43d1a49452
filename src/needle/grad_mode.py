"""Grad mode: whether ops record a graph, per thread (as in PyTorch).

A thread generating under ``no_grad`` does not stop another thread from recording, and every
new thread starts with grad enabled. ``no_grad``/``enable_grad`` restore the previous mode on
the way out of their block, exceptions included.
"""

from __future__ import annotations

import contextlib
import threading


class _ThreadState(threading.local):
    """Autograd state private to each thread; a new thread sees the class defaults."""

    grad_enabled: bool = True


_state = _ThreadState()


class _GradMode(contextlib.ContextDecorator):
    """Set this thread's grad mode for a block (or a decorated function) and restore the
    previous mode on the way out, exceptions included."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._previous: list[bool] = []  # a stack, so one object may be re-entered

    def __enter__(self) -> None:
        self._previous.append(_state.grad_enabled)
        _state.grad_enabled = self.enabled

    def __exit__(self, *exc_info) -> bool:
        _state.grad_enabled = self._previous.pop()
        return False


def _grad_mode(enabled: bool) -> _GradMode:
    return _GradMode(enabled)


def no_grad() -> _GradMode:
    """Context manager (and decorator) in which ops record no graph: for inference and for
    updating parameters in optimizers. Affects only the calling thread."""
    return _GradMode(False)


def enable_grad() -> _GradMode:
    """Context manager (and decorator) that turns graph recording back on inside ``no_grad``
    (in the calling thread)."""
    return _GradMode(True)


def is_grad_enabled() -> bool:
    """Whether ops called from this thread record a graph."""
    return _state.grad_enabled


class set_grad_enabled:  # noqa: N801 (PyTorch's name: a function or a context manager)
    """Turn graph recording on or off for the calling thread, now; used in a ``with``
    block, the previous mode comes back at its end (as ``torch.set_grad_enabled``)."""

    def __init__(self, enabled: bool) -> None:
        self._previous = _state.grad_enabled
        _state.grad_enabled = bool(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> bool:
        _state.grad_enabled = self._previous
        return False
