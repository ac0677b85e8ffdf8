"""The OpenAI request bodies we accept (pydantic v2); the bodies we send are in
``server.formatter``.

Models are strict (a string where a number belongs is an error, not coerced) and ignore fields
they do not know, so clients that send extra OpenAI fields (``user``, ``frequency_penalty``...)
still work. Checks that need the tokenizer or the context length live in ``server.job_builder``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. A missing ``schema`` means any JSON object (OpenAI leaves
    it optional). ``strict: true`` refuses (400) schemas with keywords the grammar cannot enforce
    (:mod:`splitserve.engine.grammar.schema_limits`); otherwise those keywords are best effort."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class BaseGenerateRequest(BaseModel):
    """Fields shared by completions and chat completions. ``None`` means "use the default"
    because some clients send explicit nulls."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    n: int | None = Field(None, ge=1)
    ignore_eos: bool = False  # extension (vLLM, SGLang): keep generating past EOS
    return_token_ids: bool = False  # extension (vLLM): the generated ids in each choice
    response_format: ResponseFormat | None = None
    # Extensions (vLLM/SGLang names) for the other constraint kinds; one constraint per request.
    regex: str | None = None  # the whole output matches this regular expression
    ebnf: str | None = None  # a GBNF grammar with a ``root`` rule (e.g. a SQL subset)
    choice: list[str] | None = Field(None, min_length=1)  # the output is exactly one of these
    # Extension (llguidance's term): free whitespace between JSON tokens; default compact JSON.
    whitespace_flexible: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(BaseGenerateRequest):
    """``POST /v1/completions``. ``prompt`` becomes a string or a list of token ids.

    Legacy-completions logprobs: ``logprobs`` (0-5) returns the generated tokens' logprobs;
    with ``echo`` the prompt is prepended to the text and its tokens are scored too, and
    ``max_tokens: 0`` then scores the prompt without generating. ``logprob_start_len``
    (extension, SGLang's name) scores only prompt tokens from that index on (the rest are
    null), so a shared prefix before it can be served from the prefix cache.
    """

    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    logprob_start_len: int | None = Field(None, ge=0)
    # Extension (vLLM's name): False for a prompt that already holds its special tokens, e.g. one
    # rendered through the chat template by a client (``splitserve.lang``).
    add_special_tokens: bool = True

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # OpenAI allows a batch of prompts; we serve one per request (like n == 1).
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ValueError("must be a string, a list of one string, or a list of token ids")
        return value


class ChatMessage(BaseModel):
    """One message; ``content`` is flattened to a string (text parts joined) for the template."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            if not isinstance(part.get("text"), str) or "text" not in part:
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)

    def as_template_dict(self) -> dict[str, str]:
        # Chat templates of open models know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class ChatCompletionRequest(BaseGenerateRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
