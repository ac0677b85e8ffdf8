"""The response object (OpenAI's ``Response``): what a request asked for, echoed, around the
answer's status, output items and usage.

One :class:`Envelope` per response, made when the request is accepted; :meth:`Envelope.body`
shapes it at any moment of its life (``queued``, ``in_progress``, ``completed``,
``incomplete``, ``failed``, ``cancelled``), for the stream's events, the JSON answer and the
store alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from splitserve.server.formatter import Usage
from splitserve.server.responses_api.protocol import ResponsesRequest

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def usage_body(usage: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """OpenAI's ``ResponseUsage`` of ``usage`` (None: not known yet). ``cache_write_tokens`` is
    0: nothing here writes the cache on request (``prompt_cache_breakpoint``); the prefix cache
    keeps every prompt on its own."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def error_code(status_code: int) -> str:
    """OpenAI's ``ResponseError.code`` for an HTTP status of ours."""
    if status_code == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= status_code < 500 else "server_error"


@dataclass(slots=True)
class Envelope:
    """The parts of one response object that do not come from its answer."""

    response_id: str
    req: ResponsesRequest
    created_at: int

    @classmethod
    def new(cls, response_id: str, req: ResponsesRequest) -> Envelope:
        return cls(response_id, req, int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]] | None = None,
             usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
        """The response object in ``status``, with ``output`` items and ``usage``
        (:func:`usage_body`); ``error``: ``{"code", "message"}`` when failed."""
        req = self.req
        fmt = req.format
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None:
            text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status in TERMINAL else None,
            "background": bool(req.background),
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {},
            "model": req.model,
            "output": output or [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.stores,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format},
            "tool_choice": _tool_choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
