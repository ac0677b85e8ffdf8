"""The ``POST /v1/responses`` body we accept (pydantic v2, strict; unknown fields ignored, as
on chat): the fields and kinds ``server.responses_api.fields`` calls implemented or ignored.
Refused fields and kinds never reach these models (``field_check`` answers them first), so a
kind missing from a union here is one the tables refuse.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.server.protocol import MAX_TOP_LOGPROBS, TOOL_NAME_PATTERN
from splitserve.server.responses_api.fields import MAX_METADATA, MIN_OUTPUT_TOKENS

_STRICT = ConfigDict(strict=True, extra="ignore")
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512  # characters, as OpenAI


class TextPart(BaseModel):
    """``input_text`` / ``output_text``: a piece of a message's text."""

    model_config = _STRICT

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A message; ``content`` is a string or text parts. ``assistant`` messages are earlier
    answers (their parts are ``output_text``)."""

    model_config = _STRICT

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call an earlier answer made."""

    model_config = _STRICT

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None
    id: str | None = None


class OutputTextPart(BaseModel):
    model_config = _STRICT

    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the call ``call_id``."""

    model_config = _STRICT

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str | list[OutputTextPart]
    name: str | None = None
    id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(BaseModel):
    """An earlier turn's thinking (dropped from the prompt; kept in the stored input)."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["reasoning"]
    id: str | None = None


class ItemReference(BaseModel):
    """An item of a stored response, by its id (resolved from the store)."""

    model_config = _STRICT

    type: Literal["item_reference"]
    id: str = Field(min_length=1)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
    Field(discriminator="type"),
]


class FunctionTool(BaseModel):
    """``tools[]`` of type ``function``. ``strict`` null or missing is best effort (the grammar
    still enforces what it can; see docs/api.md)."""

    model_config = _STRICT

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(BaseModel):
    """``tools[]`` of type ``namespace``: function tools grouped under ``name``."""

    model_config = _STRICT

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


Tool = Annotated[FunctionTool | NamespaceTool, Field(discriminator="type")]


class NamedFunction(BaseModel):
    """``tool_choice: {"type": "function", "name": ...}``."""

    model_config = _STRICT

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields flat."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self


class TextParam(BaseModel):
    model_config = _STRICT

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. ``input`` keeps its items as given (an item without ``type`` is
    a message); ``store`` defaults to true, as OpenAI."""

    model_config = _STRICT

    model: str
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    max_output_tokens: int | None = Field(None, ge=MIN_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    # Ignored (echoed in the response object as OpenAI does).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, value: Any) -> Any:
        # OpenAI's easy input message has no ``type``: it is a message.
        if isinstance(value, list):
            return [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                    else item for item in value]
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} key-value pairs")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values "
                                 f"at most {MAX_METADATA_VALUE}: {key[:80]!r}")
        return value

    @property
    def stores(self) -> bool:
        """Whether the response is kept (``store`` defaults to true)."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None
