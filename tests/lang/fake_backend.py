"""A deterministic in-process backend for interpreter tests that need no model."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from splitserve.lang import BackendError, BaseBackend, GenOutput, SelectOutput
from splitserve.lang.backend import Prompt, SamplingArgs, TextPrompt
from splitserve.lang.chat_template import ChatTemplate

# ChatML, as SmolLM2 uses it (without its default system prompt).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class FakeBackend(BaseBackend):
    """``generate`` answers ``reply(prompt_text)`` (default: ``"<n>"``, n = prompt length);
    ``select`` prefers the longest choice; ``fail_on``: a prompt substring that fails."""

    def __init__(self, template: bool = False, fail_on: str | None = None,
                 reply: Any = None) -> None:
        self.template = ChatTemplate(CHATML) if template else None
        self.fail_on = fail_on
        self.reply = reply or (lambda text: f"<{len(text)}>")
        self.prefills: list[str] = []
        self.prompts: list[str] = []
        self.lock = threading.RLock()

    def chat_template(self) -> ChatTemplate | None:
        return self.template

    def _text(self, prompt: Prompt) -> str:
        assert isinstance(prompt, TextPrompt)
        if self.fail_on and self.fail_on in prompt.text:
            raise BackendError(f"fake failure on {self.fail_on!r}", status_code=500)
        with self.lock:
            self.prompts.append(prompt.text)
        return prompt.text

    def generate(self, prompt: Prompt, sampling: SamplingArgs,
                 constraint: tuple[str, Any] | None) -> GenOutput:
        text = self.reply(self._text(prompt))
        if constraint and constraint[0] == "regex" and constraint[1].startswith("-?"):
            text = "42"  # dtype int/float
        return GenOutput(text, {"finish_reason": "stop", "cached_tokens": 0})

    def stream(self, prompt: Prompt, sampling: SamplingArgs,
               constraint: tuple[str, Any] | None) -> Iterator[str | GenOutput]:
        out = self.generate(prompt, sampling, constraint)
        yield from out.text  # one character at a time
        yield out

    def select(self, prompt: Prompt, choices: list[str]) -> SelectOutput:
        self._text(prompt)
        scores = [float(len(c)) for c in choices]
        return SelectOutput(scores.index(max(scores)), scores, scores, [1] * len(choices))

    def prefill(self, prompt: Prompt) -> dict[str, Any]:
        with self.lock:
            self.prefills.append(self._text(prompt))
        return {"cached_tokens": 0}
