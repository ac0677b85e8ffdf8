"""One chat choice's text as its parts: the thinking, the content, and the tool calls.

A reasoning model's thinking is split off first (``server.reasoning``: ``reasoning_content``),
and only the rest is content and tool calls (``server.tools``): call markup or JSON inside the
thinking is thinking, never a call, and the answer's calls and ``json_schema`` output come only
from after it. :class:`AnswerStream` does it piece by piece for a streamed answer,
:func:`answer_parts` for a whole one; both read the same parsers, so a stream reassembles to
exactly the full answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.server.job import Job
from splitserve.server.tools.parsers import parse_tool_calls
from splitserve.server.tools.stream import ToolCallStream, finish_reason


@dataclass(slots=True)
class AnswerParts:
    """A whole answer: ``reasoning`` (None where the answer is not split: no reasoning
    parser, or completions), ``content``, and its ``tool_calls`` (OpenAI's shape; None where
    the request has no tools)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


def answer_parts(job: Job, text: str, engine_reason: str) -> AnswerParts:
    """Split a whole answer's ``text`` as the job asks."""
    reasoning = None
    if job.reasoning is not None and job.splits_reasoning:
        reasoning, text = job.reasoning.split(text)
    if job.tool_format is None:
        return AnswerParts(reasoning, text, None, engine_reason)
    text, calls = parse_tool_calls(text, job.tool_format, functions=job.tool_functions,
                                   cut=engine_reason == "length")
    return AnswerParts(reasoning, text, [c.as_openai() for c in calls],
                       finish_reason(engine_reason, bool(calls)))


class AnswerStream:
    """Turns one choice's text, piece by piece, into chat deltas: ``{"reasoning_content":
    ...}``, ``{"content": ...}`` or ``{"tool_calls": [...]}``."""

    def __init__(self, job: Job) -> None:
        self.reasoning = (job.reasoning.parser()
                          if job.reasoning is not None and job.splits_reasoning else None)
        self.tools = (None if job.tool_format is None
                      else ToolCallStream(job.tool_format, job.tool_functions))

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for the next piece of text."""
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.feed(text)
        return self._reasoning(reasoning) + self._content(content)

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """Deltas for what was held back at the end (``cut``: ``max_tokens`` ended it)."""
        out: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            out = self._reasoning(reasoning) + self._content(content)
        if self.tools is not None:
            out += self.tools.finish(cut)
        return out

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` for an answer with calls that ended by itself, else the engine's."""
        return engine_reason if self.tools is None else self.tools.finish_reason(engine_reason)

    @staticmethod
    def _reasoning(text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text}] if text else []

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self.tools.feed(text)
        return [{"content": text}] if text else []
