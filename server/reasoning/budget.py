"""A request's thinking budget: how many tokens the think block may take before the engine forces
its end marker.

Three ways to ask, one number for the engine (``ipc.messages.ReasoningParams.budget``):

- ``reasoning_effort`` (OpenAI's field): a level, mapped by :data:`EFFORT_BUDGETS`;
- ``thinking_token_budget`` (vLLM's extension) on chat and completions, or Anthropic's
  ``thinking.budget_tokens`` (``/v1/messages``): a token count;
- ``--reasoning-budget`` (llama.cpp's flag name): the server's default, -1 for none.

The numbers follow the published budgets of models that take one (Gemini's thinking levels use
1,024 / 8,192 / 24,576; Anthropic asks at least 1,024): ``low`` is Anthropic's minimum,
``medium`` and ``high`` four times the one before, and ``none`` closes the block at once.
"""

from __future__ import annotations

NO_BUDGET = -1

EFFORT_BUDGETS: dict[str, int] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
    "max": NO_BUDGET,  # the rest of the context
}


def thinking_budget(effort: str | None, tokens: int | None, default: int = NO_BUDGET) -> int:
    """The budget of one request: ``tokens`` if given, else ``effort``'s, else ``default``.

    Args:
        effort: a key of :data:`EFFORT_BUDGETS`, or None.
        tokens: an explicit count (>= 0), or None.
        default: the server's ``--reasoning-budget``.

    Returns:
        Thinking tokens at most, or :data:`NO_BUDGET`.

    Raises:
        ValueError: both ``effort`` and ``tokens`` given, or an unknown ``effort`` (the
            protocol layer turns it into a 400 naming the field).
    """
    if effort is not None and tokens is not None:
        raise ValueError("give reasoning_effort or thinking_token_budget, not both")
    if tokens is not None:
        return tokens
    if effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise ValueError(f"unknown reasoning_effort {effort!r}: one of "
                             f"{', '.join(EFFORT_BUDGETS)}")
        return EFFORT_BUDGETS[effort]
    return default
