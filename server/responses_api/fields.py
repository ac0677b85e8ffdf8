"""Every request field of ``POST /v1/responses``, and what we do with it: ``server.fields``'
discipline (implemented, refused with a 400 naming it, or ignored with a reason) for OpenAI's
``CreateResponse`` (``tests/data/openai-openapi/openapi.json``).

Three kinds of table, all checked by ``server.responses_api.field_check`` before the body is
parsed:

- :data:`RESPONSES_FIELDS`: the body's own fields (``server.fields.FieldRule`` s).
- :data:`RESPONSES_NESTED`: the sub-fields of plain nested objects, keyed by their path as in
  ``server.nested_fields`` (``stream_options``, ``text``).
- :data:`RESPONSES_TYPED`: objects that are one of several kinds told apart by their ``type``
  (input items, content parts, tools, ``tool_choice``, ``text.format``): each kind is a
  :class:`KindRule`, implemented with a table of its sub-fields, or refused (a 400 naming the
  kind: ``input[2].type: web_search_call items are not supported``). Built-in tools
  (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use_preview``, ``mcp``...)
  are refused kinds of ``tools[]``.

And :data:`INCLUDE_VALUES`, the values of the ``include`` list, each one a rule too.

docs/api.md's Responses tables are generated from here (``python -m
splitserve.server.responses_api.fields``) and a test keeps the two equal; another holds every
table against the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.server.fields import FieldRule, ignored, implemented, refused, rule_note

MIN_OUTPUT_TOKENS = 16  # OpenAI's minimum of max_output_tokens
MAX_METADATA = 16  # key-value pairs, as OpenAI
_NO_OUTPUT_EFFECT = "an end-user id for OpenAI's abuse monitoring; echoed, changes no output"
_CACHE_HINT = "a prompt-cache hint; our prefix cache reuses every shared prefix on its own"
_DROPPED = "reasoning items are dropped from the prompt (chat templates drop earlier turns' " \
           "thinking too)"
_EARLIER_OUTPUT = "a field of an earlier output item sent back; the prompt does not show it"


@dataclass(frozen=True, slots=True)
class KindRule:
    """One kind of a typed object (its ``type`` value). ``fields``: its sub-fields' table when
    implemented (None for a refused kind); ``note``: what it does, or why it is refused."""

    status: str
    note: str
    fields: dict[str, FieldRule] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TypedTable:
    """The kinds of the objects at one path. ``default``: the kind of an object that has no
    ``type`` (OpenAI's easy input message), or None where ``type`` is required."""

    kinds: dict[str, KindRule]
    default: str | None = None


def kind(note: str, **fields: FieldRule) -> KindRule:
    """An implemented kind with its sub-fields."""
    return KindRule("implemented", note, fields)


def refused_kind(note: str) -> KindRule:
    """A kind that is a 400 naming it."""
    return KindRule("refused", note)


def _refused_kinds(note: str, *names: str) -> dict[str, KindRule]:
    return {name: refused_kind(note) for name in names}


_TYPE = implemented("the kind")

RESPONSES_FIELDS: dict[str, FieldRule] = {
    "model": implemented("the served model's name or `default`"),
    "input": implemented("a string (one user message) or a list of items: see the item table"),
    "instructions": implemented("a system message before the input; not carried over by "
                                "`previous_response_id`, as OpenAI"),
    "previous_response_id": implemented("continue a stored response: its input and output items "
                                        "(tool calls included) come before this input"),
    "store": implemented("default true: the response and its items are kept in the SQLite "
                         "store (`--responses-store`) for `previous_response_id`, GET, "
                         "`input_items` and DELETE"),
    "background": implemented("run detached: the answer is `queued`, poll GET, cancel with "
                              "POST .../cancel; needs `store`, not with `stream`"),
    "stream": implemented("server-sent events, OpenAI's sequence with `sequence_number`s"),
    "stream_options": implemented("see the sub-fields"),
    "tools": implemented("function tools (grammar-enforced calls); built-in tools are a 400 "
                         "naming their type"),
    "tool_choice": implemented("`none`, `auto`, `required` or a named function"),
    "parallel_tool_calls": implemented("false: at most one call"),
    "text": implemented("`format` (`text`, `json_object`, `json_schema` grammar-enforced)"),
    "max_output_tokens": implemented("new tokens at most", minimum=MIN_OUTPUT_TOKENS),
    "temperature": implemented("0 is greedy", minimum=0, maximum=2),
    "top_p": implemented("nucleus sampling; must be above 0", minimum=0, maximum=1),
    "top_logprobs": implemented("alternatives per token, shown with `include: "
                                "[\"message.output_text.logprobs\"]`", minimum=0, maximum=20),
    "include": implemented("`message.output_text.logprobs`; `reasoning.encrypted_content` "
                           "accepted (nothing is encrypted here); the others are a 400"),
    "metadata": implemented(f"up to {MAX_METADATA} string pairs, stored and echoed"),
    "user": ignored(_NO_OUTPUT_EFFECT),
    "safety_identifier": ignored(_NO_OUTPUT_EFFECT),
    "prompt_cache_key": ignored(_CACHE_HINT),
    "prompt_cache_retention": ignored(_CACHE_HINT),
    "prompt_cache_options": ignored(_CACHE_HINT),
    "max_tool_calls": ignored("a limit on calls to built-in tools, of which there are none here"),
    "truncation": refused("a prompt over the context is a 400, never cut", noop=("disabled",)),
    "service_tier": refused("one processing tier here", noop=("auto", "default")),
    "reasoning": implemented("only what asks for no reasoning control: see the sub-fields "
                             "(the served model's thinking is not configurable yet)"),
    "prompt": refused("no stored prompt templates; send the prompt as `input`"),
    "conversation": refused("no Conversations API; continue with `previous_response_id`"),
    "context_management": refused("no context compaction"),
    "moderation": refused("no moderation model here"),
}

_STREAM_OPTIONS: dict[str, FieldRule] = {
    "include_obfuscation": ignored("random padding against a network side channel; it carries "
                                   "no content, and we send none"),
}

_TEXT: dict[str, FieldRule] = {
    "format": implemented("the output's format: see its kinds"),
    "verbosity": refused("a reasoning-model control the served model lacks", noop=("medium",)),
}

_NO_REASONING_CONTROL = "the served model's thinking is not configurable yet"
_REASONING: dict[str, FieldRule] = {
    "effort": refused(f"no thinking budgets: {_NO_REASONING_CONTROL}", noop=("none",)),
    "summary": refused("no reasoning summaries; `auto` asks for the best the model has, here "
                       "none", noop=("auto",)),
    "generate_summary": refused("deprecated `summary`", noop=("auto",)),
    "context": refused("earlier turns' reasoning items are never rendered back here",
                       noop=("auto", "current_turn")),
    "mode": refused(f"one reasoning mode: {_NO_REASONING_CONTROL}", noop=("standard",)),
}

RESPONSES_NESTED: dict[str, dict[str, FieldRule]] = {
    "stream_options": _STREAM_OPTIONS,
    "text": _TEXT,
    "reasoning": _REASONING,
}

_TEXT_PART = {"type": _TYPE, "text": implemented("joined with the message's other text parts"),
              "prompt_cache_breakpoint": ignored(_CACHE_HINT)}

_INPUT_ITEMS = TypedTable({
    "message": kind(
        "a message (no `type`: this kind)",
        type=_TYPE,
        role=implemented("`user`, `system`, `developer` (as `system`), `assistant`"),
        content=implemented("a string or text parts"),
        id=ignored(_EARLIER_OUTPUT),
        status=ignored(_EARLIER_OUTPUT),
        phase=ignored("OpenAI's label of an assistant message (commentary or final answer); "
                      "the prompt does not show it"),
    ),
    "function_call": kind(
        "an earlier call, rendered into the assistant turn as the model writes calls",
        type=_TYPE,
        call_id=implemented("matched by a later `function_call_output`'s `call_id`"),
        name=implemented("the function called"),
        arguments=implemented("a JSON object as text"),
        id=ignored(_EARLIER_OUTPUT),
        status=ignored(_EARLIER_OUTPUT),
        caller=refused("programmatic tool calling; only direct calls here",
                       noop=({"type": "direct"},)),
        namespace=implemented("the namespace of the function called"),
    ),
    "function_call_output": kind(
        "a call's result, rendered as the template writes tool results",
        type=_TYPE,
        call_id=implemented("the call it answers"),
        output=implemented("a string or `input_text` parts"),
        name=implemented("the function's name (default: found from its call)"),
        id=ignored(_EARLIER_OUTPUT),
        status=ignored(_EARLIER_OUTPUT),
        caller=refused("programmatic tool calling; only direct calls here",
                       noop=({"type": "direct"},)),
        namespace=ignored("the call it answers names the function"),
    ),
    "reasoning": kind(
        "an earlier turn's thinking: accepted and " + _DROPPED,
        type=_TYPE,
        id=ignored(_DROPPED),
        summary=ignored(_DROPPED),
        content=ignored(_DROPPED),
        encrypted_content=ignored(_DROPPED),
        status=ignored(_DROPPED),
    ),
    "item_reference": kind(
        "an item of a stored response of the same API key, by its `id`",
        type=_TYPE,
        id=implemented("the item's id"),
    ),
    **_refused_kinds("a built-in tool's item; no built-in tools here",
                     "file_search_call", "computer_call", "computer_call_output",
                     "web_search_call", "image_generation_call", "code_interpreter_call",
                     "local_shell_call", "local_shell_call_output", "shell_call",
                     "shell_call_output", "apply_patch_call", "apply_patch_call_output",
                     "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                     "mcp_call", "tool_search_call", "tool_search_output", "additional_tools",
                     "program", "program_output"),
    **_refused_kinds("no custom (free-form input) tools; use function tools",
                     "custom_tool_call", "custom_tool_call_output"),
    **_refused_kinds("no context compaction", "compaction", "compaction_trigger"),
}, default="message")

_CONTENT_PARTS = TypedTable({
    "input_text": kind("text", **_TEXT_PART),
    "output_text": kind(
        "an earlier answer's text", type=_TYPE, text=_TEXT_PART["text"],
        annotations=ignored("citations of an earlier answer; the prompt does not show them"),
        logprobs=ignored("an earlier answer's logprobs; the prompt does not show them"),
    ),
    "refusal": refused_kind("a refusal part; send its text as a text part"),
    "input_image": refused_kind("no image input"),
    "input_file": refused_kind("no file input"),
    "reasoning_text": kind("a `reasoning` item's thinking, dropped with it", type=_TYPE,
                           text=ignored(_DROPPED)),
})

_OUTPUT_PARTS = TypedTable({
    "input_text": kind("text", **_TEXT_PART),
    "input_image": refused_kind("no image input"),
    "input_file": refused_kind("no file input"),
})

_FUNCTION_TOOL = kind(
    "a function the model may call",
    type=_TYPE,
    name=implemented("the name calls use"),
    description=implemented("rendered into the prompt with the function"),
    parameters=implemented("a JSON Schema of the arguments, rendered and enforced by the "
                           "call grammar (null: any object)"),
    strict=implemented("true: a 400 for a keyword the call grammar cannot enforce; null "
                       "or false: best effort"),
    defer_loading=refused("no tool search", noop=(False,)),
    allowed_callers=refused("programmatic tool calling; only direct calls here",
                            noop=(["direct"],)),
    output_schema=ignored("describes the function's result to OpenAI's programmatic "
                          "callers; the prompt does not show it"),
)

_TOOLS = TypedTable({
    "function": _FUNCTION_TOOL,
    "namespace": kind(
        "functions grouped under a name: each is offered to the model as "
        "`<namespace>__<function>`, and its calls come back with `namespace` set",
        type=_TYPE,
        name=implemented("the namespace's name"),
        description=implemented("put before each of its functions' descriptions"),
        tools=implemented("its function tools"),
    ),
    **_refused_kinds("a built-in tool; none here: define a function tool instead",
                     "file_search", "computer", "computer_use_preview", "web_search",
                     "web_search_2025_08_26", "web_search_preview",
                     "web_search_preview_2025_03_11", "mcp", "code_interpreter",
                     "image_generation", "local_shell", "shell", "apply_patch", "tool_search",
                     "programmatic_tool_calling"),
    "custom": refused_kind("no custom (free-form input) tools; use function tools"),
})

_NAMESPACE_TOOLS = TypedTable({
    "function": _FUNCTION_TOOL,
    "custom": refused_kind("no custom (free-form input) tools; use function tools"),
})

_TOOL_CHOICE = TypedTable({
    "function": kind("call this function", type=_TYPE, name=implemented("a function of `tools`")),
    "allowed_tools": refused_kind("no allowed-tools subset; send that subset as `tools`"),
    "custom": refused_kind("no custom tools"),
    "mcp": refused_kind("no MCP tools"),
    **_refused_kinds("a built-in tool; none here",
                     "file_search", "web_search_preview", "computer", "computer_use_preview",
                     "computer_use", "web_search_preview_2025_03_11", "image_generation",
                     "code_interpreter", "programmatic_tool_calling", "apply_patch", "shell"),
})

_TEXT_FORMAT = TypedTable({
    "text": kind("free text", type=_TYPE),
    "json_object": kind("any JSON object (grammar-enforced)", type=_TYPE),
    "json_schema": kind(
        "JSON that follows the schema (grammar-enforced)",
        type=_TYPE,
        name=implemented("named with the description in the system message"),
        schema=implemented("a JSON Schema, enforced by the grammar"),
        description=implemented("shown to the model as a line of the system message"),
        strict=implemented("true: a 400 for a keyword no grammar backend enforces"),
    ),
})

RESPONSES_TYPED: dict[str, TypedTable] = {
    "input[]": _INPUT_ITEMS,
    "input[].content[]": _CONTENT_PARTS,
    "input[].output[]": _OUTPUT_PARTS,
    "tools[]": _TOOLS,
    "tools[].tools[]": _NAMESPACE_TOOLS,
    "tool_choice": _TOOL_CHOICE,
    "text.format": _TEXT_FORMAT,
}

INCLUDE_VALUES: dict[str, FieldRule] = {
    "message.output_text.logprobs": implemented("each `output_text` part carries its tokens' "
                                                "logprobs (`top_logprobs` alternatives)"),
    "reasoning.encrypted_content": ignored("nothing is encrypted here: reasoning items carry "
                                           "their text, and are dropped when sent back"),
    "file_search_call.results": refused("no built-in tools"),
    "web_search_call.results": refused("no built-in tools"),
    "web_search_call.action.sources": refused("no built-in tools"),
    "message.input_image.image_url": refused("no image input"),
    "computer_call_output.output.image_url": refused("no built-in tools"),
    "code_interpreter_call.outputs": refused("no built-in tools"),
}


def markdown_table() -> str:
    """docs/api.md's Responses field table: the body's fields, then each plain nested object's
    sub-fields, each typed object's kinds with their sub-fields, and the ``include`` values."""
    rows = ["| field | status | notes |", "|---|---|---|"]
    for name, rule in RESPONSES_FIELDS.items():
        rows.append(f"| `{name}` | {rule.status} | {rule_note(rule)} |")
    for path, table in RESPONSES_NESTED.items():
        for name, rule in table.items():
            rows.append(f"| `{path}.{name}` | {rule.status} | {rule_note(rule)} |")
    for path, typed in RESPONSES_TYPED.items():
        for kind_name, rule in typed.kinds.items():
            rows.append(f"| `{path}` `{kind_name}` | {rule.status} | {rule.note} |")
            for name, sub in rule.fields.items():
                if name != "type":
                    rows.append(f"| `{path}.{name}` (`{kind_name}`) | {sub.status} | "
                                f"{rule_note(sub)} |")
    for value, rule in INCLUDE_VALUES.items():
        rows.append(f"| `include[]` `{value}` | {rule.status} | {rule_note(rule)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
