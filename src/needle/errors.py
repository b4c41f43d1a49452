"""Errors raised by needle.

Every error a user can cause is a ``NeedleError`` subclass whose message says what was
wrong and what to do about it. Subclasses also derive from the matching built-in
exception (``ValueError``, ``IndexError``, ...) so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class NeedleError(Exception):
    """Base class of every error needle raises on purpose."""


class ShapeError(NeedleError, ValueError):
    """Shapes do not fit: mismatch, impossible broadcast, reshape to a different size."""


class AxisError(NeedleError, IndexError):
    """An axis is out of range or repeated."""


class IndexOutOfRangeError(NeedleError, IndexError):
    """An index or slice falls outside an array or table."""


class DTypeError(NeedleError, TypeError):
    """A dtype is unknown, or not supported by an operation or device."""


class DeviceError(NeedleError, RuntimeError):
    """A device is unavailable, or arrays on different devices were combined."""


class GradientError(NeedleError, RuntimeError):
    """A gradient was asked of a tensor outside any graph (no input requires grad)."""


class OutOfMemoryError(NeedleError, MemoryError):
    """A device allocation failed even after the caching pool was emptied."""


class KernelCompileError(NeedleError, RuntimeError):
    """A kernel source failed to compile; the message carries the compiler's log."""


class KernelLaunchError(NeedleError, RuntimeError):
    """A kernel launch or command buffer failed on the device."""


class ModelFormatError(NeedleError, ValueError):
    """A model or checkpoint file is missing, malformed or inconsistent."""


class GenerationError(NeedleError, ValueError):
    """A text-generation request is invalid: sampling settings, token counts, sequence length."""


class DataFormatError(NeedleError, ValueError):
    """A dataset file is missing, malformed or inconsistent, or its reader is not installed."""


class ArgumentError(NeedleError, ValueError):
    """An argument has a value the function cannot accept (a size <= 0, a rate outside its
    range, NaN); the message names the argument."""


class ArgumentTypeError(NeedleError, TypeError):
    """An argument is of the wrong kind (a string where a number goes, a non-Module in a
    Sequential); the message names the argument."""


class DistributedError(NeedleError, RuntimeError):
    """A process group cannot start or a collective failed: a launch variable missing or
    inconsistent, a rank that did not join or died, a timeout, a backend not installed."""
