"""One request's reasoning: where its prompt leaves the think block, what the engine enforces, and
the parser each of its choices splits its answer with.

:class:`ReasoningSetup` is made once per server from the chosen format and the tokenizer (the
markers' token ids); every endpoint asks it for a :class:`ReasoningRequest` with the rendered
prompt, the request's budget and whether the request is constrained. The engine gets
``ReasoningParams`` only where it has something to do (a constraint to start after the block,
or a budget to force its end); free thinking without a budget is the parser's business alone,
so such a request's tokens are exactly those of a server without reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.ipc.messages import ReasoningParams
from splitserve.server.reasoning.budget import NO_BUDGET
from splitserve.server.reasoning.formats import PromptThinking, ReasoningFormat
from splitserve.server.reasoning.parser import ReasoningParser, split_reasoning


@dataclass(frozen=True, slots=True)
class ReasoningRequest:
    """What reasoning changes for one request (the same for all its choices).

    Attributes:
        fmt: the markers.
        thinking: where the rendered prompt leaves the block.
        params: what the engine enforces (``SamplingParams.reasoning``), or None.
    """

    fmt: ReasoningFormat
    thinking: PromptThinking
    params: ReasoningParams | None

    @property
    def thinks(self) -> bool:
        """Whether the answer may think (the prompt did not close the block)."""
        return self.thinking is not PromptThinking.CLOSED

    def parser(self) -> ReasoningParser:
        """A fresh streaming parser, for one choice."""
        return ReasoningParser(self.fmt, self.thinking)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's ``(reasoning, content)``."""
        return split_reasoning(text, self.fmt, self.thinking)


class ReasoningSetup:
    """A server's reasoning format over its tokenizer.

    Args:
        fmt: the chosen format (``--reasoning-parser``).
        tokenizer: the model's Hugging Face tokenizer: the markers are encoded with it on their
            own, as the model writes them.
        default_budget: ``--reasoning-budget`` (-1: none).
    """

    def __init__(self, fmt: ReasoningFormat, tokenizer: Any, default_budget: int = NO_BUDGET):
        self.fmt = fmt
        self.default_budget = default_budget
        self.start_ids = tokenizer.encode(fmt.start, add_special_tokens=False)
        self.end_ids = tokenizer.encode(fmt.end, add_special_tokens=False)

    def for_prompt(self, prompt: str, budget: int = NO_BUDGET,
                   constrained: bool = False) -> ReasoningRequest:
        """The reasoning of a request whose rendered prompt text is ``prompt``.

        Args:
            prompt: what the answer continues (chat: the template's output).
            budget: thinking tokens at most (``budget.thinking_budget``), -1 for none.
            constrained: the request carries a constraint (which must start after the block).
        """
        thinking = self.fmt.prompt_thinking(prompt)
        params = None
        if thinking is not PromptThinking.CLOSED and (constrained or budget >= 0):
            params = ReasoningParams(
                start_ids=list(self.start_ids), end_ids=list(self.end_ids),
                end_text=self.fmt.end, opened=thinking is PromptThinking.OPEN, budget=budget)
        return ReasoningRequest(self.fmt, thinking, params)
