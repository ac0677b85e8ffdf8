"""Reasoning models: the think block's markers per family (``formats``), the streaming parser
that splits an answer into reasoning and content (``parser``), thinking budgets (``budget``), and
one request's reasoning as the endpoints and the engine need it (``request``).

The interface every endpoint uses (chat completions here; Responses and Messages alike):

- ``ChatRenderer.reasoning`` (``server.chat_template``): a :class:`ReasoningSetup`, or None
  when the server has no reasoning parser (``--reasoning-parser none``, or ``auto`` on a
  template without a think block);
- ``setup.for_prompt(prompt_text, budget, constrained)`` -> :class:`ReasoningRequest`, whose
  ``params`` go into ``SamplingParams.reasoning``;
- per choice ``request.parser()``: ``feed(text) -> (reasoning_delta, content_delta)`` and
  ``finish() -> (reasoning_delta, content_delta)``, exact at every chunk boundary;
- ``budget.thinking_budget(effort, tokens, default)`` for the request's budget.

Parsers are registered by name in ``config.registry.REASONING_PARSER`` (``--reasoning-parser``).
"""

from splitserve.server.reasoning.budget import EFFORT_BUDGETS, NO_BUDGET, thinking_budget
from splitserve.server.reasoning.formats import (
    PromptThinking,
    ReasoningFormat,
    detect_reasoning_format,
)
from splitserve.server.reasoning.parser import ReasoningParser, split_reasoning
from splitserve.server.reasoning.request import ReasoningRequest, ReasoningSetup

__all__ = [
    "EFFORT_BUDGETS",
    "NO_BUDGET",
    "PromptThinking",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningRequest",
    "ReasoningSetup",
    "detect_reasoning_format",
    "split_reasoning",
    "thinking_budget",
]
