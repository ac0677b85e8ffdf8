"""Renders role-structured programs through a model's Jinja chat template, client side.

The template comes from the server (``GET /chat_template``), so what ``lang`` sends to
``/v1/completions`` is exactly what ``/v1/chat/completions`` would have built. The environment
mirrors the one Hugging Face ``transformers`` uses (trim/lstrip blocks, ``raise_exception``,
``tojson``), without importing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Cuts an open message where its content so far ends; never appears in real text.
_SENTINEL = "\x00splitserve-lang-open-message\x00"


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@dataclass(slots=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _template: Any = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The prompt text of ``messages`` (what the tokenizer's ``apply_chat_template`` gives)."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def render_open(self, closed: list[dict[str, str]], role: str, content: str) -> str:
        """The prompt text with ``closed`` messages and an open ``role`` message whose content so
        far is ``content``: the text the model continues when it generates inside that role."""
        text = self.render([*closed, {"role": role, "content": content + _SENTINEL}])
        cut = text.find(_SENTINEL)
        if cut < 0:
            raise ValueError(f"the chat template dropped the content of a {role} message")
        return text[:cut]

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> ChatTemplate | None:
        """From the body of ``GET /chat_template``; None when the model has no template."""
        source = info.get("chat_template")
        if not source:
            return None
        return cls(source, info.get("bos_token") or "", info.get("eos_token") or "")
