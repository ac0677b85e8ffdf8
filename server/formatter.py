"""The OpenAI response bodies of one request: the full answer, each streamed chunk, the usage.

The shapes follow the OpenAI API (``/v1/completions`` and ``/v1/chat/completions``, see
``openai-openapi``): one formatter serves both endpoints (``is_chat``). Per-choice content
beyond text (logprobs, token ids) is handed in ready-made; the formatter only places it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.server.sse import EventTemplate, encode_event


@dataclass(slots=True)
class Usage:
    """Token counts of one request, filled in as its events arrive."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # every cache tier's: the pool, host memory, disk, shared store
    # Of ``cached_tokens``, per tier ("l1", "l2", "l3", "store"): the response header
    # ``x-splitserve-cached-tokens`` (server.cache_header), not the OpenAI body.
    cached_by_tier: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class ResponseFormatter:
    """Builds the response bodies of one request, for either endpoint (``is_chat``).

    ``include_usage``: streamed chunks carry ``usage`` (null but on the last, the usage chunk);
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): each chunk carries the usage its
    caller hands in, its choice's so far, instead of null.
    """

    rid: str
    created: int
    model: str
    is_chat: bool
    include_usage: bool = False
    continuous_usage: bool = False
    # Per choice index, the template of its text chunks' events (text_event).
    _text_events: dict[int, EventTemplate] = field(default_factory=dict, init=False, repr=False,
                                                   compare=False)

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response; ``token_ids`` (when asked for) are the generated ids and
        ``prompt_token_ids`` the prompt's (vLLM's extension), ``logprobs`` the
        legacy-completions logprobs object (``server.logprobs``). With ``tool_calls`` (chat)
        the message carries them, and ``content`` is null when no text came with them.
        ``reasoning`` (chat, a reasoning model): the thinking, as ``message.reasoning_content``
        (vLLM's and DeepSeek's name; null when empty)."""
        choice: dict[str, Any] = {
            "index": 0, "logprobs": logprobs, "finish_reason": finish_reason
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"] = {"role": "assistant", "content": text or None,
                                     "tool_calls": tool_calls}
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning or None
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.is_chat else "text_completion", [choice])
        body["usage"] = usage.as_dict()
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        index: int = 0,
        usage: Usage | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``. Chat chunks carry a ``delta``; the first one
        of each choice names the role. ``logprobs``: the object of this chunk's tokens
        (``server.logprobs``), when asked for; ``tool_calls``: OpenAI's call deltas
        (``server.tools.stream``); ``reasoning``: a piece of the thinking
        (``delta.reasoning_content``); ``usage``: the choice's usage so far, sent when
        ``continuous_usage``."""
        choice: dict[str, Any] = {
            "index": index, "logprobs": logprobs, "finish_reason": finish_reason
        }
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = self._envelope(
            "chat.completion.chunk" if self.is_chat else "text_completion", [choice]
        )
        if self.include_usage:
            # OpenAI: null on every chunk but the last; vLLM's continuous usage: so far.
            body["usage"] = (usage.as_dict() if self.continuous_usage and usage is not None
                             else None)
        return body

    def text_event(self, text: str, index: int = 0, usage: Usage | None = None) -> str:
        """The SSE event of ``chunk(text, index=index, usage=usage)``, the chunk of most
        streamed tokens, without building and encoding the body each time
        (``server.sse.EventTemplate``) unless its usage changes from chunk to chunk."""
        if self.continuous_usage:
            return encode_event(self.chunk(text, index=index, usage=usage))
        template = self._text_events.get(index)
        if template is None:
            template = EventTemplate(self.chunk(EventTemplate.MARK, index=index))
            self._text_events[index] = template
        return template.event(text)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: empty choices, full usage."""
        body = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        body["usage"] = usage.as_dict()
        return body
