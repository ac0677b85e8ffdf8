"""OpenAI-style errors: every failure the API reports has the body
``{"error": {"message", "type", "param", "code"}}``.

FastAPI answers bad input with 422 and its own body shape; OpenAI clients expect 400 and the
shape above, so the handlers here replace FastAPI's. Paths of another API (Anthropic's
Messages) answer in that API's shape instead: :func:`use_error_body`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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

    def response(self, body: dict[str, Any] | None = None) -> JSONResponse:
        """The error as a response: with ``body`` (default: :meth:`body`), its status and
        headers."""
        # 503 is "busy or no healthy worker now": tell clients when to try again.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status_code == 503 else {}
        headers.update(self.headers or {})
        return JSONResponse(self.body() if body is None else body,
                            status_code=self.status_code, headers=headers or None)


ErrorBody = Callable[[APIError], dict[str, Any]]


def use_error_body(app: FastAPI, on_path: Callable[[str], bool], body: ErrorBody) -> None:
    """Answer every error of a request whose path ``on_path`` accepts with ``body(error)``
    instead of OpenAI's body (status and headers unchanged)."""
    app.state.error_bodies = [*getattr(app.state, "error_bodies", []), (on_path, body)]


def _respond(request: Request, exc: APIError) -> JSONResponse:
    for on_path, body in getattr(request.app.state, "error_bodies", ()):
        if on_path(request.url.path):
            return exc.response(body(exc))
    return exc.response()


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


_NO_BODY = object()


def from_validation_errors(errors: Sequence[Any], body: Any = _NO_BODY) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 that names its field.

    With ``body`` (the decoded request), a value that matched no member of a union field
    (``tool_choice``, ``json_schema.schema``) is named by where it sits in the body: pydantic
    puts each member's tag in the ``loc`` of its error (``tool_choice.literal['none','auto',
    'required']``, ``schema.dict[str,any]``), which is nothing the client wrote. Of the
    members' errors, the one that reaches deepest into the body is reported: the member the
    value was written for (``tool_choice.function.name`` for a named choice whose name is
    not a string), not the first member tried.
    """
    if not errors:
        return APIError("invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    loc = _body_loc(err)
    if body is not _NO_BODY:
        err, loc = _union_member_error(errors, body)
    if not loc:
        return APIError(f"request body: {err.get('msg', 'invalid')}")
    param = format_loc(loc)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"{param}: {msg}", param=param)


def _body_loc(err: Any) -> list[str | int]:
    return [p for p in err.get("loc", ()) if p != "body"]  # FastAPI prefixes body fields


def _in_body(err: Any, body: Any) -> tuple[list[str | int], int | None]:
    """``err``'s loc without the union-member tags (the steps the body does not have), and
    the index in its loc of the first tag dropped (None: none). A field the body's object
    lacks, the last step of its error, is kept (tags such as ``literal['none',...]`` or
    ``dict[str,any]`` are no identifiers, and a model's tag never ends the loc of an error
    on an object)."""
    raw = _body_loc(err)
    out: list[str | int] = []
    first_tag = None
    cur = body
    for i, step in enumerate(raw):
        in_dict = isinstance(cur, dict) and step in cur
        if in_dict or (isinstance(cur, list) and isinstance(step, int) and 0 <= step < len(cur)):
            cur = cur[step]
        elif (i == len(raw) - 1 and isinstance(cur, dict) and isinstance(step, str)
              and step.isidentifier()):
            pass  # a field of this object the body lacks (missing, or its default refused)
        else:
            if first_tag is None:
                first_tag = i
            continue
        out.append(step)
    return out, first_tag


def _union_member_error(errors: Sequence[Any], body: Any) -> tuple[Any, list[str | int]]:
    """The error to report of ``errors`` (the first one, or its union's deepest member
    error) and its loc in ``body``."""
    first = errors[0]
    loc, tag = _in_body(first, body)
    if tag is None:
        return first, loc
    union_at = _body_loc(first)[:tag]
    best, best_loc = first, loc
    for err in errors[1:]:
        raw = _body_loc(err)
        if raw[:tag] != union_at or len(raw) <= tag:
            continue  # another field's error, not a member of the same union
        err_loc, err_tag = _in_body(err, body)
        if err_tag == tag and len(err_loc) > len(best_loc):
            best, best_loc = err, err_loc
    return best, best_loc


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _respond(request, exc)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _respond(request, from_validation_errors(exc.errors()))


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _respond(request, APIError(str(exc.detail), status_code=exc.status_code))


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return _respond(request, APIError("internal server error", status_code=500))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns use the OpenAI body shape (bad input: 400, not 422)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
