"""The error every OpenAI-shaped endpoint answers with: an HTTP status and OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body."""

from __future__ import annotations

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
