"""Argument checks shared by the public API: each names the function and the argument, so a
bad value fails at the call that made it, with an error that says what to pass."""

from __future__ import annotations

import math
import numbers

from .errors import ArgumentError, ArgumentTypeError


def integer(value, name: str, where: str, minimum: int | None = None) -> int:
    """``value`` as an int (bools and floats refused), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{where}: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def positive(value, name: str, where: str) -> int:
    return integer(value, name, where, 1)


def number(value, name: str, where: str, low: float | None = None, high: float | None = None,
           high_open: bool = False, low_open: bool = False) -> float:
    """``value`` as a finite float within [low, high] (ends open where asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{where}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{where}: {name} must be finite, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        span = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        raise ArgumentError(f"{where}: {name} must be in {span}, got {value}")
    return value


def probability(value, name: str, where: str) -> float:
    return number(value, name, where, 0.0, 1.0)


def int_tuple(value, name: str, where: str) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints) as a tuple of ints; what the ints may be is left
    to the caller (reshape accepts -1, an axis list may be negative)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value),)
    try:
        items = tuple(value)
    except TypeError:
        raise ArgumentTypeError(f"{where}: {name} must be a tuple of ints, got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in items):
        raise ArgumentTypeError(f"{where}: {name} must be a tuple of ints, got {value!r}")
    return tuple(int(v) for v in items)

