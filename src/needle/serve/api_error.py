"""The error every OpenAI-shaped endpoint answers with: an HTTP status and OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body; and the checks of request fields
that answer with it."""

from __future__ import annotations

import numbers

from ..errors import NeedleError


class ApiError(NeedleError):
    """An error answered as OpenAI does: HTTP status and {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400: the request asked for something wrong or unsupported (``param`` names it)."""
    return ApiError(400, message, param)


def number(body: dict, name: str, lo: float, hi: float, default=None, *, open_lo=False):
    """``body[name]`` checked to be a number in [lo, hi] (``open_lo``: (lo, hi]); ``default``
    where it is absent or null; a 400 naming the field otherwise."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or \
            not (lo < value if open_lo else lo <= value) or value > hi:
        interval = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)
