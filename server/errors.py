"""OpenAI-style errors: every failure the API reports has the body
``{"error": {"message", "type", "param", "code"}}``.

FastAPI answers bad input with 422 and its own body shape; OpenAI clients expect 400 and the
shape above, so the handlers here replace FastAPI's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error to report to the client as HTTP ``status_code`` with an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status_code: int = 400,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers  # extra response headers (429's Retry-After)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type or error_type(status_code)
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        # 503 is "busy or no healthy worker now": tell clients when to try again.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status_code == 503 else {}
        headers.update(self.headers or {})
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers or None)


def error_type(status_code: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: client errors vs. our own failures."""
    if status_code == 404:
        return "not_found_error"
    return "invalid_request_error" if 400 <= status_code < 500 else "server_error"


def format_loc(loc: Sequence[str | int]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``: the field named as a client wrote it."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 that names its field."""
    if not errors:
        return APIError("invalid request")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]  # FastAPI prefixes body fields
    if err.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    if not loc:
        return APIError(f"request body: {err.get('msg', 'invalid')}")
    param = format_loc(loc)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"{param}: {msg}", param=param)


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(exc.errors()).response()


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(str(exc.detail), status_code=exc.status_code).response()


async def _unexpected_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return APIError("internal server error", status_code=500).response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns use the OpenAI body shape (bad input: 400, not 422)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
