"""The error a request is answered with, in OpenAI's shape."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server answers with an error: HTTP ``status`` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)
