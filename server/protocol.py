"""The OpenAI request bodies we accept (pydantic v2); the bodies we send are in
``server.formatter``.

Models are strict (a string where a number belongs is an error, not coerced) and ignore fields
they do not know, so clients that send their own extras still work. Which OpenAI fields and
sub-fields are refused before parsing is the tables' business (``server.fields``,
``server.nested_fields``, checked by ``server.field_check``); an OpenAI field dropped here is
one those tables call ignored. Checks that need the tokenizer or the context length live in
``server.job_builder``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOP_STRINGS = 4
# Bounds on the fields whose size the client chooses, so no request can make every step (or
# the grammar compiler) do unbounded work: OpenAI's own where it has one (logit_bias 300
# entries, tools 128), ours otherwise. A value past one is a 400 naming the field.
MAX_LOGIT_BIAS = 300
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_CHOICES = 1024  # strings of ``choice``
MAX_CHOICE_CHARS = 4096  # characters in one of them
MAX_TOOLS = 128
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # ``priority``: any int32 (vLLM: any int)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is a choice of the answer)


class StreamOptions(BaseModel):
    """``stream_options`` (read when ``stream`` is true). ``continuous_usage_stats`` (vLLM's
    extension) puts each choice's usage so far on every chunk; as in vLLM it turns
    ``include_usage`` on when that is not sent, and ``include_usage: false`` with it is a 400
    (vLLM would send no usage at all, dropping the request's ask)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    @field_validator("continuous_usage_stats")
    @classmethod
    def _usage_on(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("include_usage") is False:
            raise ValueError("usage on every chunk needs include_usage: set it to true or "
                             "leave it out")
        return value


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. A missing ``schema`` means any JSON object (OpenAI leaves
    it optional). ``strict: true`` refuses (400) schemas with keywords the grammar cannot enforce
    (:mod:`splitserve.constraints.schema_limits`); otherwise those keywords are best effort."""

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
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    # Extension (vLLM's semantics): lower values are admitted first and keep their KV pages
    # when a worker runs out (higher values are preempted and recomputed); ties by arrival.
    priority: int | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    n: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1)  # legacy completions; only 1 (vLLM removed it too)
    ignore_eos: bool = False  # extension (vLLM, SGLang): keep generating past EOS
    return_token_ids: bool = False  # extension (vLLM): the generated ids in each choice
    response_format: ResponseFormat | None = None
    # Extensions (vLLM/SGLang names) for the other constraint kinds; one constraint per request.
    regex: str | None = None  # the whole output matches this regular expression
    ebnf: str | None = None  # a GBNF grammar with a ``root`` rule (e.g. a SQL subset)
    # The output is exactly one of these.
    choice: list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES)
    # Extension (llguidance's term): free whitespace between JSON tokens; default compact JSON.
    whitespace_flexible: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extension (vLLM's name): requests with different salts never share prefix-cache entries,
    # so a salted prompt's ``cached_tokens`` counts only what the same salt (and key) cached.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Logits processing (engine.runner.penalties). OpenAI's ranges for the two penalties;
    # repetition_penalty (vLLM's extension) must be > 0, 1 is off.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[int, float] | None = None  # JSON keys are token ids as strings
    min_tokens: int | None = Field(None, ge=0)  # extension (vLLM): EOS/stop ids masked till then
    # Extension (vLLM): ids that end the output too.
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # Extension (vLLM's name): a reasoning model thinks at most this many tokens, then its end
    # marker is forced (server.reasoning.budget).
    thinking_token_budget: int | None = Field(None, ge=0)

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        # OpenAI: "only set this when you set stream: true"; vLLM refuses it too. Accepting it
        # would be a 200 in which the asked-for usage chunks never come. A null sub-field asks
        # for nothing and is accepted, as everywhere.
        asks = value is not None and any(
            getattr(value, name) is not None for name in value.model_fields_set)
        if asks and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_ids(cls, value: Any) -> Any:
        # OpenAI: a map from token ids (JSON object keys, so strings) to a bias in [-100, 100].
        if not isinstance(value, dict):
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries (as OpenAI), got {len(value)}")
        out = {}
        for key, bias in value.items():
            if not isinstance(key, str) or not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"the bias of token {key} must be a number")  # noqa: TRY004
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
            out[int(key)] = float(bias)
        return out

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk (``stream_options``)."""
        opts = self.stream_options
        if opts is None:
            return False
        return bool(opts.include_usage or (opts.include_usage is None
                                           and opts.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries its choice's usage so far (vLLM's
        ``stream_options.continuous_usage_stats``)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(BaseGenerateRequest):
    """``POST /v1/completions``. ``prompt`` becomes a string or a list of token ids.

    Legacy-completions logprobs: ``logprobs`` (0-5) returns the generated tokens' logprobs;
    with ``echo`` the prompt is prepended to the text and its tokens are scored too, and
    ``max_tokens: 0`` then scores the prompt without generating. ``logprob_start_len``
    (extension, SGLang's name) scores only prompt tokens from that index on (the rest are
    null), so a shared prefix before it can be served from the prefix cache.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
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
    def _prompt_shape(cls, value: Any) -> Any:
        # OpenAI allows a batch of prompts (strings or token-id lists): choice i answers prompt
        # i. A batch of one is that prompt.
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            for p in value:
                if not isinstance(p, str) and not (
                    isinstance(p, list) and all(type(v) is int for v in p)
                ):
                    raise ValueError("a list of prompts holds strings or lists of token ids")
            return value[0] if len(value) == 1 else value
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ValueError("must be a string, a list of token ids, or a list of those")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch it sent."""
        p = self.prompt
        if isinstance(p, str) or not p or type(p[0]) is int:
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


def _text_of_parts(value: Any) -> Any:
    """OpenAI content parts (``[{"type": "text", "text": ...}]``) joined into one string."""
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


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    """``tools[].function``: ``parameters`` is a JSON Schema of the arguments object (missing:
    any object); ``strict: true`` refuses (400) a schema with keywords the grammar cannot
    enforce, as ``response_format``'s ``strict`` does."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``; only ``type: "function"`` exists in Chat Completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    """``tool_calls[].function`` of an assistant message: ``arguments`` is JSON text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    """One call of an earlier assistant turn (the history of a tool loop)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; ``content`` is flattened to a string (text parts joined) for the template.

    An assistant message may have ``content: null`` when it carries ``tool_calls``; a ``tool``
    message answers the call named by ``tool_call_id``. ``name`` (the participant's name) goes
    to the chat template as it is, as vLLM passes it; the template decides whether the model
    sees it.
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Before ``content``, whose check reads them (pydantic validates fields in this order).
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    content: str | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _text_of_parts(value)

    @field_validator("content")
    @classmethod
    def _content_needed(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and not (info.data.get("role") == "assistant"
                                  and info.data.get("tool_calls")):
            raise ValueError("content is required (null only on an assistant message with "
                             "tool_calls)")
        return value

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: role, content, and ``name`` when given."""
        # Chat templates of open models know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        item: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            item["name"] = self.name
        return item


class ChatCompletionRequest(BaseGenerateRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Tool calling (``server.tools``): the functions the model may call, whether it must, and
    # whether it may call several in one turn. Checked against each other in
    # ``server.tools.request``.
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False  # each output token's logprob in choices[].logprobs.content
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs: true
    # Reasoning models (server.reasoning): OpenAI's effort level, mapped to a thinking budget;
    # and (vLLM's extension) more variables for the chat template, e.g. enable_thinking.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
