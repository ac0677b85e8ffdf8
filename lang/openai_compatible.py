"""``OpenAICompatible``: any server that speaks the OpenAI API (vLLM, SGLang, OpenAI itself...).

Role programs become chat messages (``/v1/chat/completions``); plain-text programs use
``/v1/completions``. ``gen(tools=...)`` sends ``tools``/``tool_choice``/``parallel_tool_calls``
on the chat endpoint and reads ``message.tool_calls`` back; a required or named call that does
not come back is an error. ``gen(reasoning=True)`` goes to the chat endpoint too and reads the
thinking from ``message.reasoning_content``. Constraints: ``json_schema`` through ``response_format`` (the OpenAI
API's own), and ``gen(grammar=...)`` in the ``grammar_field`` extension field (``ebnf``:
splitserve, SGLang), once a probe showed the server enforces it on that endpoint
(``lang.grammar_field``); regex, choices, typed ``dtype``, ``select`` (which needs prompt
logprobs) and a grammar the server does not enforce are a :class:`BackendError` with
``unsupported`` set, never a silent fallback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

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
from splitserve.lang.grammar_field import probe_grammar_field, unsupported_grammar
from splitserve.lang.http_client import (
    OpenAIHTTP,
    completion_output,
    sampling_fields,
    stream_deltas,
    usage_meta,
)
from splitserve.lang.tool_calls import parse_tool_calls


def json_schema_format(schema: dict[str, Any] | str) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON Schema (dict, or its JSON text)."""
    import json

    value = json.loads(schema) if isinstance(schema, str) else schema
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": value}}


class OpenAIBackendBase(BaseBackend):
    """Generation over the OpenAI HTTP API; subclasses decide templates and constraints."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.http = OpenAIHTTP(base_url, api_key, timeout_s)
        self.model = model

    def constraint_fields(self, constraint: tuple[str, Any] | None,
                          chat: bool = False) -> dict[str, Any]:
        """Body fields that enforce ``constraint`` on the chat (``chat``) or completions
        endpoint. Raises BackendError if unsupported."""
        raise NotImplementedError

    def request(self, prompt: Prompt, sampling: SamplingArgs,
                constraint: tuple[str, Any] | None) -> tuple[str, dict[str, Any], bool]:
        """``(path, body, is_chat)`` of the request that continues ``prompt``."""
        chat = isinstance(prompt, ChatPrompt)
        body: dict[str, Any] = {"model": self.model, **sampling_fields(sampling),
                                **self.constraint_fields(constraint, chat)}
        if isinstance(prompt, ChatPrompt):
            return "/chat/completions", {**body, "messages": prompt.messages}, True
        body["prompt"] = prompt.text
        if prompt.templated:
            body["add_special_tokens"] = False  # the template wrote them (splitserve, vLLM)
        return "/completions", body, False

    def generate(self, prompt: Prompt, sampling: SamplingArgs,
                 constraint: tuple[str, Any] | None) -> GenOutput:
        path, body, is_chat = self.request(prompt, sampling, constraint)
        return completion_output(self.http.post(path, body), is_chat)

    def stream(self, prompt: Prompt, sampling: SamplingArgs,
               constraint: tuple[str, Any] | None) -> Iterator[str | GenOutput]:
        path, body, is_chat = self.request(prompt, sampling, constraint)
        body["stream_options"] = {"include_usage": True}
        yield from stream_deltas(self.http.post_sse(path, body), is_chat)

    def generate_tools(self, prompt: ChatPrompt, sampling: SamplingArgs,
                       tools: ToolsArgs) -> GenOutput:
        return self._chat(prompt, sampling, None, tools)

    def generate_message(self, prompt: ChatPrompt, sampling: SamplingArgs,
                         constraint: tuple[str, Any] | None, tools: ToolsArgs | None,
                         reasoning_effort: str | None = None) -> GenOutput:
        extra = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
        out = self._chat(prompt, sampling, constraint, tools, extra)
        return out

    def _chat(self, prompt: ChatPrompt, sampling: SamplingArgs,
              constraint: tuple[str, Any] | None, tools: ToolsArgs | None,
              extra: dict[str, Any] | None = None) -> GenOutput:
        """One ``/chat/completions`` request: its answer, calls and thinking
        (``message.reasoning_content``, vLLM's and DeepSeek's field; ``reasoning`` as some
        servers name it)."""
        body: dict[str, Any] = {"model": self.model, **sampling_fields(sampling),
                                **self.constraint_fields(constraint),
                                "messages": prompt.messages, **(extra or {})}
        if tools is not None:
            body["tools"] = tools.tools
            if tools.tool_choice is not None:
                body["tool_choice"] = tools.tool_choice
            if tools.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = tools.parallel_tool_calls
        answer = self.http.post("/chat/completions", body)
        message = answer["choices"][0]["message"]
        out = completion_output(answer, is_chat=True)
        out.tool_calls = parse_tool_calls(message.get("tool_calls"))
        out.reasoning = message.get("reasoning_content", message.get("reasoning"))
        if tools is not None and tools.must_call() and not out.tool_calls:
            raise BackendError(
                f"tool_choice {tools.tool_choice!r} requires a call, but the server at "
                f"{self.http.base_url} answered without tool_calls (does it implement tools?)",
                unsupported=True)
        return out

    def prefill(self, prompt: Prompt) -> dict[str, Any]:
        # One token: the cheapest request every OpenAI-compatible server accepts.
        path, body, _ = self.request(prompt, SamplingArgs(max_tokens=1, temperature=0.0), None)
        return usage_meta(self.http.post(path, body))


class OpenAICompatible(OpenAIBackendBase):
    """Any OpenAI-compatible server.

    Args:
        base_url: the API root, e.g. ``http://host:8000/v1``.
        model: the model name to send.
        api_key: sent as a bearer token when set.
        grammar_field: the body field that carries a ``gen(grammar=...)`` GBNF grammar
            (``ebnf``: splitserve, SGLang; ``grammar``: llama.cpp's server), or None: grammars
            are refused.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 600.0, grammar_field: str | None = "ebnf") -> None:
        super().__init__(base_url, model, api_key, timeout_s)
        self.grammar_field = grammar_field
        self._grammar_lock = threading.Lock()
        self._grammar_refusal: dict[bool, str | None] = {}  # chat? -> why not (None: enforced)

    def chat_template(self) -> ChatTemplate | None:
        return None  # the server applies its own template to chat messages

    def grammar_refusal(self, chat: bool) -> str | None:
        """Why the server does not enforce a grammar on the chat (``chat``) or completions
        endpoint, probed once per endpoint; None when it does."""
        if self.grammar_field is None:
            return "this backend was built with grammar_field=None"
        with self._grammar_lock:
            if chat not in self._grammar_refusal:
                self._grammar_refusal[chat] = probe_grammar_field(
                    self.http, self.model, self.grammar_field, chat)
            return self._grammar_refusal[chat]

    def constraint_fields(self, constraint: tuple[str, Any] | None,
                          chat: bool = False) -> dict[str, Any]:
        if constraint is None:
            return {}
        kind, value = constraint
        if kind == "json_schema":
            return {"response_format": json_schema_format(value)}
        if kind == "grammar":
            why = self.grammar_refusal(chat)
            if why is not None:
                raise unsupported_grammar(self.http.base_url, why)
            return {self.grammar_field: value}
        raise BackendError(
            f"OpenAICompatible backend cannot enforce a {kind} constraint (the OpenAI API has "
            "none); use lang.Endpoint with a splitserve server", unsupported=True)

    def select(self, prompt: Prompt, choices: list[str]) -> SelectOutput:
        raise BackendError(
            "select needs prompt-token logprobs, which OpenAICompatible does not request; use "
            "lang.Endpoint with a splitserve server, or gen(choices=...) there", unsupported=True)
