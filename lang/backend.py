"""The seam between the interpreter and a model server. Implementations: ``lang.endpoint``
(a splitserve server), ``lang.openai_compatible`` (any OpenAI-compatible server) and
``lang.anthropic_compatible`` (any server with Anthropic's Messages API)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from splitserve.lang.chat_template import ChatTemplate
from splitserve.lang.errors import BackendError
from splitserve.lang.tool_calls import ToolCall


@dataclass(slots=True)
class TextPrompt:
    """A prompt as text. ``templated``: it was rendered through the chat template and already
    holds its special tokens (the server must not add BOS again)."""

    text: str
    templated: bool = False


@dataclass(slots=True)
class ChatPrompt:
    """A prompt as chat messages, for backends without a client-side template and for programs
    that use tools (the server renders the tools and the tool turns). Generation starts a fresh
    assistant message, or, for a backend that ``continues_assistant``, continues a last
    assistant message. Messages are OpenAI's: an assistant message may carry ``tool_calls``
    (its ``content`` then may be None), a ``tool`` message its ``tool_call_id``."""

    messages: list[dict[str, Any]]


Prompt = TextPrompt | ChatPrompt


@dataclass(slots=True)
class SamplingArgs:
    """Resolved sampling for one step (``None``: the server's default)."""

    max_tokens: int = 128
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass(slots=True)
class ToolsArgs:
    """The tool fields of one chat request, in OpenAI's form (``lang.tool_spec``)."""

    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def must_call(self) -> bool:
        """Whether the answer must hold a call (``required`` or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


@dataclass(slots=True)
class GenOutput:
    """One generation: its text and what the server reported (``finish_reason``,
    ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``); with tools, the calls
    (``text`` is then the content outside them); with reasoning, the thinking (``text`` is
    then the answer after it; None: the server split none off)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None


@dataclass(slots=True)
class SelectOutput:
    """Scores of each choice: ``normalized[i]`` is the mean logprob of choice ``i``'s tokens
    given the prompt, ``sums[i]`` their sum, ``num_tokens[i]`` how many tokens were scored."""

    index: int
    normalized: list[float]
    sums: list[float]
    num_tokens: list[int]


class BaseBackend(abc.ABC):
    """A model server the interpreter calls. Methods are called from many threads at once.

    ``continues_assistant``: a :class:`ChatPrompt` may end with an open assistant message
    (its text so far), which the server continues (Anthropic's prefill); where False, a gen on
    chat messages must open its assistant message.
    """

    continues_assistant: bool = False

    @abc.abstractmethod
    def chat_template(self) -> ChatTemplate | None:
        """The template to render role programs as text, or None: roles map to chat messages
        (:class:`ChatPrompt`)."""

    @abc.abstractmethod
    def generate(self, prompt: Prompt, sampling: SamplingArgs,
                 constraint: tuple[str, Any] | None) -> GenOutput:
        """Generate a continuation of ``prompt``.

        Args:
            constraint: ``(kind, value)`` from ``lang.constraints.constraint_of``, or None.

        Raises:
            BackendError: the server failed, or cannot enforce ``constraint``.
        """

    @abc.abstractmethod
    def stream(self, prompt: Prompt, sampling: SamplingArgs,
               constraint: tuple[str, Any] | None) -> Iterator[str | GenOutput]:
        """Like :meth:`generate`, yielding text deltas and then the final :class:`GenOutput`."""

    @abc.abstractmethod
    def select(self, prompt: Prompt, choices: list[str]) -> SelectOutput:
        """Score each choice as a continuation of ``prompt``.

        Raises:
            BackendError: the server cannot score prompt tokens (``unsupported``).
        """

    def generate_tools(self, prompt: ChatPrompt, sampling: SamplingArgs,
                       tools: ToolsArgs) -> GenOutput:
        """Generate an assistant message that may call ``tools``.

        Raises:
            BackendError: the backend has no chat endpoint with tool calling (``unsupported``;
                the default), the server failed, or a required call did not come back.
        """
        raise BackendError(f"{type(self).__name__} has no tool calling (it needs a chat "
                           "endpoint that returns tool_calls)", unsupported=True)

    def generate_message(self, prompt: ChatPrompt, sampling: SamplingArgs,
                         constraint: tuple[str, Any] | None, tools: ToolsArgs | None,
                         reasoning_effort: str | None = None) -> GenOutput:
        """Generate an assistant message whose thinking is kept apart (``GenOutput.reasoning``),
        under ``constraint`` and with ``tools`` (None: none).

        Raises:
            BackendError: the backend has no chat endpoint (``unsupported``; the default), it
                cannot enforce ``constraint``, or the server failed.
        """
        raise BackendError(f"{type(self).__name__} does not return a reasoning model's "
                           "thinking apart (it needs a chat endpoint with reasoning_content)",
                           unsupported=True)

    @abc.abstractmethod
    def prefill(self, prompt: Prompt) -> dict[str, Any]:
        """Run ``prompt`` once so the server's prefix cache holds it (forks and batches send
        their shared prefix this way). Returns the usage the server reported."""
