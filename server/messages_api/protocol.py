"""The Anthropic Messages request bodies we accept (pydantic v2, strict).

Shapes follow Anthropic's API reference and its SDK's request types
(``anthropic.types.MessageCreateParams``, ``MessageCountTokensParams``). Which fields are
served, refused or ignored is ``messages_api.fields``' business, checked before these parse;
models here ignore what they do not read. A content block is one of the block models by its
``type``; any other type (images, documents, server-tool blocks) is a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.server.protocol import TOOL_NAME_PATTERN

BILLING_HEADER = "x-anthropic-billing-header:"
_BILLING_LINE = re.compile(r"\A" + re.escape(BILLING_HEADER) + r"[^\n]*(\n|\Z)")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    """An earlier assistant turn's call: ``input`` is the tool's input object."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Model):
    """The answer to the ``tool_use`` named ``tool_use_id`` (in the assistant turn before)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        """The result's text (text blocks joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Model):
    """An earlier turn's thinking (its ``signature`` is not checked here)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Model):
    """One turn; a string ``content`` is one text block."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @property
    def blocks(self) -> list[Any]:
        """The content as blocks."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(_Model):
    """A client tool: the model may call ``name`` with an input following ``input_schema``."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None


class ToolChoice(_Model):
    """``auto`` (the default with tools), ``any`` (a call is required), ``tool`` (call
    ``name``), ``none`` (no call)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("name is required when type is 'tool'")
        return self


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None


class CountTokensRequest(_Model):
    """``POST /v1/messages/count_tokens``: the prompt of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @property
    def system_text(self) -> str | None:
        """The system prompt's text (blocks joined), or None.

        Claude Code puts an ``x-anthropic-billing-header: cc_version=...;`` line first in the
        system prompt (a text block of its own), with a suffix that changes with the
        conversation's first message. It is addressed to Anthropic's API, not to the model, and
        left in, it would start every new conversation's prompt with different tokens, so that
        the rest of the system prompt and the tools (about 18,000 tokens) could never come from
        the prefix cache. Such a block (or such a first line of a string) is dropped; a system
        prompt that held nothing else is no system prompt."""
        if self.system is None:
            return None
        if isinstance(self.system, str):
            text = _BILLING_LINE.sub("", self.system, count=1)
            return text if text or not self.system else None
        blocks = [b.text for b in self.system if not b.text.startswith(BILLING_HEADER)]
        if self.system and not blocks:
            return None
        return "".join(blocks)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` is required, as Anthropic requires it."""

    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("a stop sequence must not be empty")
        return value
