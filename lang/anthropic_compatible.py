"""``AnthropicCompatible``: a server that speaks Anthropic's Messages API (``POST /v1/messages``):
a splitserve server, or any other that serves it.

Role programs become Messages requests (``lang.anthropic_messages``); a ``gen`` may continue
text already inside an assistant message, which goes as a final assistant turn the server
continues (prefill). ``gen(tools=...)`` sends ``tools``/``tool_choice`` and reads the
``tool_use`` blocks back. Constraints the Messages API can carry go as ``output_config.format``
(a JSON Schema): ``json_schema``, and ``choices`` as a schema of one string from the list (the
answer's JSON string is parsed back into the choice). What it cannot carry is a
:class:`BackendError` with ``unsupported`` set, never a silent fallback: ``regex`` and the typed
``dtype`` (int, float, bool compile to a regex), ``select`` (it scores choices by their
logprobs, which the Messages API does not return: use ``gen(choices=...)``), a plain-text
program (Messages has no raw completion: use roles), and ``seed``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from splitserve.lang.anthropic_messages import (
    message_output,
    messages_body,
    tools_fields,
    usage_meta,
)
from splitserve.lang.backend import (
    BaseBackend,
    ChatPrompt,
    GenOutput,
    Prompt,
    SamplingArgs,
    SelectOutput,
    ToolsArgs,
)
from splitserve.lang.chat_template import ChatTemplate
from splitserve.lang.errors import BackendError
from splitserve.lang.http_client import OpenAIHTTP

ANTHROPIC_VERSION = "2023-06-01"  # the API version header every Messages client sends
MESSAGES = "/v1/messages"


class AnthropicCompatible(BaseBackend):
    """A server with Anthropic's Messages API.

    Args:
        base_url: the server's root, as the ``anthropic`` client takes it
            (``http://127.0.0.1:8000``; requests go to ``{base_url}/v1/messages``).
        model: the model name to send (``default`` on a splitserve server).
        api_key: sent as ``x-api-key`` when set.
    """

    continues_assistant = True

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        self.http = OpenAIHTTP(base_url, timeout_s=timeout_s, headers=headers)
        self.model = model

    def chat_template(self) -> ChatTemplate | None:
        return None  # the server renders the messages

    def _body(self, prompt: Prompt, sampling: SamplingArgs,
              constraint: tuple[str, Any] | None) -> dict[str, Any]:
        if not isinstance(prompt, ChatPrompt):
            raise BackendError("AnthropicCompatible needs a role program (lang.user, "
                               "lang.assistant ...): the Messages API has no raw-text "
                               "completion", unsupported=True)
        body = messages_body(self.model, prompt, sampling)
        if constraint is not None:
            body["output_config"] = {"format": {"type": "json_schema",
                                                "schema": _schema(*constraint)}}
        return body

    def generate(self, prompt: Prompt, sampling: SamplingArgs,
                 constraint: tuple[str, Any] | None) -> GenOutput:
        out = message_output(self.http.post(MESSAGES, self._body(prompt, sampling, constraint)))
        return _as_choice(out, constraint)

    def stream(self, prompt: Prompt, sampling: SamplingArgs,
               constraint: tuple[str, Any] | None) -> Iterator[str | GenOutput]:
        """Text deltas as they come (a ``choices`` answer only whole, once parsed), then the
        :class:`GenOutput`."""
        events = self.http.post_sse(MESSAGES, self._body(prompt, sampling, constraint))
        parts: list[str] = []
        usage: dict[str, Any] = {}
        stop_reason = None
        for event in events:
            kind = event.get("type")
            if kind == "message_start":
                usage.update(event["message"].get("usage") or {})
            elif kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
                parts.append(event["delta"]["text"])
                if constraint is None or constraint[0] != "choices":
                    yield event["delta"]["text"]
            elif kind == "message_delta":
                usage.update(event.get("usage") or {})
                stop_reason = event["delta"].get("stop_reason")
        out = _as_choice(GenOutput("".join(parts), usage_meta(stop_reason, usage)), constraint)
        if constraint is not None and constraint[0] == "choices":
            yield out.text
        yield out

    def generate_tools(self, prompt: ChatPrompt, sampling: SamplingArgs,
                       tools: ToolsArgs) -> GenOutput:
        body = {**self._body(prompt, sampling, None), **tools_fields(tools)}
        out = message_output(self.http.post(MESSAGES, body))
        if tools.must_call() and not out.tool_calls:
            raise BackendError(
                f"tool_choice {tools.tool_choice!r} requires a call, but the server at "
                f"{self.http.base_url} answered without tool_use blocks", unsupported=True)
        return out

    def select(self, prompt: Prompt, choices: list[str]) -> SelectOutput:
        raise BackendError(
            "select scores each choice by its logprobs, which the Messages API does not "
            "return; use gen(choices=...) (enforced here through output_config.format) or "
            "lang.Endpoint with a splitserve server", unsupported=True)

    def prefill(self, prompt: Prompt) -> dict[str, Any]:
        # One token: the cheapest request every Messages server accepts.
        body = self._body(prompt, SamplingArgs(max_tokens=1, temperature=0.0), None)
        return message_output(self.http.post(MESSAGES, body)).meta


def _schema(kind: str, value: Any) -> dict[str, Any]:
    """The JSON Schema that carries a ``(kind, value)`` constraint.

    Raises:
        BackendError: a ``regex`` (a ``dtype`` compiles to one): Messages carries JSON Schema
            only.
    """
    if kind == "json_schema":
        return json.loads(value) if isinstance(value, str) else value
    if kind == "choices":
        return {"type": "string", "enum": list(value)}
    raise BackendError(
        f"AnthropicCompatible cannot enforce a {kind} constraint (gen's regex, or a dtype of int, "
        "float or bool, which compile to one): the Messages API carries only JSON Schema "
        "(output_config.format); use json_schema or choices, or lang.Endpoint with a "
        "splitserve server", unsupported=True)


def _as_choice(out: GenOutput, constraint: tuple[str, Any] | None) -> GenOutput:
    """A ``choices`` answer (a JSON string) as the choice itself.

    Raises:
        BackendError: the answer is not one of the choices (the server did not enforce it).
    """
    if constraint is None or constraint[0] != "choices":
        return out
    try:
        choice = json.loads(out.text)
    except ValueError:
        choice = None
    if choice not in constraint[1]:
        raise BackendError(f"the server answered {out.text[:200]!r}, not one of the choices "
                           "as a JSON string: it did not enforce output_config.format")
    out.text = choice
    return out
