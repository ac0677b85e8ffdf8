"""How a reasoning model marks its thinking: the think block's markers, and where an answer starts.

A :class:`ReasoningFormat` is one family of chat templates (``--reasoning-parser``), read by the
streaming parser (``server.reasoning.parser``), the engine's think-first grammar and thinking
budget (``ipc.messages.ReasoningParams``, built in ``server.reasoning.request``) and the
endpoints' answer shapes alike.

- ``qwen3``: ``<think>…</think>`` (Qwen3, QwQ, and the ``<think>`` families in general). The
  answer starts inside the block when the generation prompt opens it (a template that writes
  ``<think>\\n`` after the assistant's header); otherwise the model may open it itself as the
  first thing it writes. A prompt whose generation prompt already closes an empty block
  (Qwen3's ``enable_thinking: false``) turns thinking off for that answer.
- ``deepseek_r1``: the same markers, but the answer always starts inside the block unless the
  prompt closed it (DeepSeek-R1's templates open it; its older ones left that to the model, and
  vLLM's parser reads a missing ``<think>`` the same way).

Reference: vLLM ``vllm/reasoning/qwen3_reasoning_parser.py`` and
``deepseek_r1_reasoning_parser.py`` (the field names ``reasoning_content``), llama.cpp's
``--reasoning-format``; the markers are the models' own chat templates'.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PromptThinking(enum.Enum):
    """Where a rendered prompt leaves the answer's think block."""

    OPEN = "open"  # the generation prompt opened it: the answer starts inside it
    CLOSED = "closed"  # the prompt ends with a closed (empty) block: no thinking this answer
    NONE = "none"  # neither: the model may open it as the first thing it writes


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One family of think-block markers.

    Attributes:
        name: the ``--reasoning-parser`` name.
        start: the marker that opens the block (text, as the template writes it).
        end: the marker that closes it.
        always_open: the answer starts inside the block unless the prompt closed it
            (DeepSeek-R1); otherwise only when the prompt opened it.
        template_markers: text whose presence in a chat template identifies the family.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_open: bool = False
    template_markers: tuple[str, ...] = ("</think>",)

    def prompt_thinking(self, prompt: str) -> PromptThinking:
        """Where ``prompt`` (the rendered text the answer continues) leaves the think block:
        CLOSED when it ends (whitespace aside) with the end marker, OPEN when its last start
        marker comes after its last end marker (or, for ``always_open``, whenever it is not
        CLOSED), else NONE."""
        if prompt.rstrip().endswith(self.end):
            return PromptThinking.CLOSED
        if self.always_open or prompt.rfind(self.start) > prompt.rfind(self.end):
            return PromptThinking.OPEN
        return PromptThinking.NONE


QWEN3 = ReasoningFormat("qwen3")
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", always_open=True,
                              template_markers=("<｜Assistant｜><think>",))
# Detection order: the more specific markers first (an R1 template names </think> too).
DETECTION_ORDER = (DEEPSEEK_R1, QWEN3)


def detect_reasoning_format(template: str | None) -> ReasoningFormat | None:
    """The family a chat template's text names, or None for a template with no think block."""
    if not template:
        return None
    for fmt in DETECTION_ORDER:
        if any(marker in template for marker in fmt.template_markers):
            return fmt
    return None
