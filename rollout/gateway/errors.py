"""Refused gateway requests: :class:`ApiError`, answered as OpenAI-style error JSON."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A refused request: HTTP ``status``, a message and the request field it concerns (``param``)."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        408: "timeout_error",
        409: "conflict_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; ``code`` is the HTTP status)."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status and headers (e.g. ``Retry-After``)."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def ended(sid: str, during: bool = False) -> ApiError:
    """409: the session ``sid`` has ended (``during``: while a call of it was being served)."""
    return ApiError(409, f"session_id: {sid!r} {'ended during the call' if during else 'has ended'}", "session_id")
