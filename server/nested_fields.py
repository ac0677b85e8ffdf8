"""The sub-fields of the request's nested objects, and what we do with each: ``server.fields``'
discipline one level down (and further).

Each table is keyed by where its object sits, as a path from the body: ``messages[]`` is every
item of ``messages``, ``tools[].function`` the ``function`` of every tool. A table lists the
properties OpenAI's spec documents for that object (``tests/data/openai-openapi/openapi.json``,
the union over its ``oneOf``/``anyOf`` variants: the ``messages[]`` table holds every role's
fields), each ``implemented``, ``refused`` or ``ignored`` with the meanings of
``server.fields``; ``spec=False`` rows are extensions (vLLM's or SGLang's names). The check
(``server.field_check``) refuses a refused sub-field with ``param`` its dotted path
(``messages[2].audio``); sub-fields in neither the spec nor a table are ignored, as top-level
extras are. A table exists for each object under an implemented field whose spec lists
properties (``tests/server/test_nested_fields.py`` holds that, and each table, against the spec);
free-form objects (``json_schema.schema``, ``function.parameters``, ``logit_bias``) have none.

docs/api.md's sub-field table is generated from here: ``python -m splitserve.server.nested_fields``.
"""

from __future__ import annotations

from splitserve.server.fields import (
    Endpoint,
    FieldRule,
    extension,
    ignored,
    implemented,
    refused,
    rule_note,
)

_STREAM_OPTIONS: dict[str, FieldRule] = {
    "include_usage": implemented("a last chunk with the whole answer's `usage`; the others carry "
                                 "`usage: null`"),
    "include_obfuscation": ignored("random padding against a network side channel; it carries no "
                                   "content, and we send none"),
    "continuous_usage_stats": extension(
        "`usage` on every chunk too: the prompt and that chunk's choice's tokens so far (vLLM); "
        "turns `include_usage` on unless it is false, which is a 400"),
}

_RESPONSE_FORMAT: dict[str, FieldRule] = {
    "type": implemented("`text`, `json_object` or `json_schema`"),
    "json_schema": implemented("the schema the output is held to"),
}

_JSON_SCHEMA: dict[str, FieldRule] = {
    "name": implemented("named with the description in the system message; without a "
                        "description only an identifier"),
    "description": implemented("shown to the model as a line of the system message "
                               "(server.format_prompt) when `type` is `json_schema`; on "
                               "/v1/completions a 400"),
    "schema": implemented("a JSON Schema, enforced by the grammar (missing: any JSON object)"),
    "strict": implemented("true: a 400 for a keyword no grammar backend enforces"),
}

_TOOL: dict[str, FieldRule] = {
    "type": implemented("`function`"),
    "function": implemented("the function the model may call"),
    "custom": refused("no custom (free-form input) tools; use function tools"),
}

_FUNCTION: dict[str, FieldRule] = {
    "name": implemented("the name calls use"),
    "description": implemented("rendered into the prompt with the function"),
    "parameters": implemented("a JSON Schema of the arguments, rendered and enforced by the call "
                              "grammar (missing: any object)"),
    "strict": implemented("true: a 400 for a keyword the call grammar cannot enforce"),
}

_TOOL_CHOICE: dict[str, FieldRule] = {
    "type": implemented("`function`: call the named function"),
    "function": implemented("the function to call"),
    "allowed_tools": refused("no allowed-tools subset; send that subset as `tools`"),
    "custom": refused("no custom tools"),
}

_NAMED_FUNCTION: dict[str, FieldRule] = {
    "name": implemented("a function of `tools`"),
}

_MESSAGE: dict[str, FieldRule] = {
    "role": implemented("`system`, `developer` (as `system`), `user`, `assistant`, `tool`; "
                        "`function` (deprecated) is a 400"),
    "content": implemented("a string or text parts, joined"),
    "name": implemented("passed to the chat template as the message's `name` (as vLLM does); "
                        "the model sees it where the template writes it (SmolLM2's does not)"),
    "tool_calls": implemented("an assistant turn's calls, rendered as the model writes them"),
    "tool_call_id": implemented("the call a `tool` message answers"),
    "refusal": refused("a refusal turn; send its text as `content`"),
    "audio": refused("no audio"),
    "function_call": refused("deprecated by OpenAI; use `tool_calls`"),
}

_CONTENT_PART: dict[str, FieldRule] = {
    "type": implemented("`text`"),
    "text": implemented("joined with the message's other text parts"),
    "prompt_cache_breakpoint": ignored("a prompt-cache hint; our prefix cache reuses every shared "
                                       "prefix on its own"),
    "image_url": refused("no image input"),
    "input_audio": refused("no audio input"),
    "file": refused("no file input"),
    "refusal": refused("a refusal part; send its text as a text part"),
}

_TOOL_CALL: dict[str, FieldRule] = {
    "id": implemented("matched by a later `tool` message's `tool_call_id`"),
    "type": implemented("`function`"),
    "function": implemented("the call's name and arguments"),
    "custom": refused("no custom tools"),
}

_CALLED_FUNCTION: dict[str, FieldRule] = {
    "name": implemented("the function called"),
    "arguments": implemented("a JSON object as text"),
}

# Chat parses every object here; completions parses ``stream_options`` and, as an extension
# (docs/api.md: structured output on both endpoints), ``response_format``.
CHAT_NESTED: dict[str, dict[str, FieldRule]] = {
    "stream_options": _STREAM_OPTIONS,
    "response_format": _RESPONSE_FORMAT,
    "response_format.json_schema": _JSON_SCHEMA,
    "tools[]": _TOOL,
    "tools[].function": _FUNCTION,
    "tool_choice": _TOOL_CHOICE,
    "tool_choice.function": _NAMED_FUNCTION,
    "messages[]": _MESSAGE,
    "messages[].content[]": _CONTENT_PART,
    "messages[].tool_calls[]": _TOOL_CALL,
    "messages[].tool_calls[].function": _CALLED_FUNCTION,
}

# On /v1/completions the prompt is the client's own text: nothing shows the model a description.
_JSON_SCHEMA_COMPLETIONS: dict[str, FieldRule] = {
    **_JSON_SCHEMA,
    "description": refused("a hint for the model; a completion's prompt is the client's own "
                           "text, so put it there", noop=("",)),
}

COMPLETION_NESTED: dict[str, dict[str, FieldRule]] = {
    "stream_options": CHAT_NESTED["stream_options"],
    "response_format": CHAT_NESTED["response_format"],
    "response_format.json_schema": _JSON_SCHEMA_COMPLETIONS,
}

NESTED_FIELDS: dict[Endpoint, dict[str, dict[str, FieldRule]]] = {
    "chat": CHAT_NESTED, "completions": COMPLETION_NESTED}


def path_steps(path: str) -> list[tuple[str, bool]]:
    """``"messages[].content[]"`` -> ``[("messages", True), ("content", True)]``: each key, and
    whether its value is a list whose items go on."""
    return [(part.removesuffix("[]"), part.endswith("[]")) for part in path.split(".")]


def markdown_table() -> str:
    """docs/api.md's sub-field table: one row per sub-field, by object, spec rows first."""
    rows = ["| sub-field | status | notes |", "|---|---|---|"]
    for path, table in CHAT_NESTED.items():
        for name, rule in sorted(table.items(), key=lambda item: not item[1].spec):
            ext = "" if rule.spec else " (ext.)"
            rows.append(f"| `{path}.{name}`{ext} | {rule.status} | {rule_note(rule)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
