"""The error a request is answered with, in OpenAI's shape, and how answers are written: as a
JSON response, or as a server-sent event of a stream.  Light on purpose (no model packages): the
Ray endpoint writes its own errors with it."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


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


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)
