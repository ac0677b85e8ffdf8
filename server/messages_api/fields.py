"""Every request field of ``POST /v1/messages`` (and its nested objects), and what we do with it:
``server.fields``' discipline for Anthropic's Messages API.

A field is ``implemented`` (as Anthropic documents it; ``minimum``/``maximum``/``enum`` its
range), ``refused`` (a 400 naming it unless null or a ``noop`` value) or ``ignored`` (accepted
and dropped: it cannot change the output). Unlike the OpenAI tables, a field in no table is a
400 too, as Anthropic's own API answers an unknown field: clients of this API send only its
documented fields, so an unknown one is a mistake or a feature we lack, never a client's
private extra. Free-form objects (``input_schema``, ``input``, ``output_config.format.schema``)
have no table and are not checked here.

The tables are held against the ``anthropic`` SDK's request types (``MessageCreateParams`` and
the block, tool and config types under it) by ``tests/server/test_messages_fields.py``, and
docs/api.md's copy against :func:`markdown_table` (``python -m
splitserve.server.messages_api.fields``).
"""

from __future__ import annotations

from typing import Any

from splitserve.server.errors import APIError
from splitserve.server.field_check import check_value, objects_at
from splitserve.server.fields import FieldRule, ignored, implemented, refused, rule_note
from splitserve.server.nested_fields import path_steps

_NO_OUTPUT_EFFECT = "account or routing information; changes no output"
_CACHE_HINT = ("a prompt-cache breakpoint; our prefix cache reuses every shared prefix on its "
               "own (`usage.cache_read_input_tokens`)")

MESSAGES_FIELDS: dict[str, FieldRule] = {
    "model": implemented("the served model's name or `default`; another is a 404"),
    "max_tokens": implemented(
        "required; new tokens at most. 0 computes the prompt into the prefix cache and answers "
        "no content. Past the context window the answer stops with `stop_reason: "
        "model_context_window_exceeded`", minimum=0),
    "messages": implemented("`user`, `assistant` and `system` turns of content blocks; a final "
                            "`assistant` turn is continued (prefill); see the sub-fields"),
    "system": implemented("a string or text blocks (joined), the first system message; Claude "
                          "Code's `x-anthropic-billing-header: ...` block is dropped"),
    "stop_sequences": implemented("strings that end the answer; `stop_reason: stop_sequence` "
                                  "and `stop_sequence` name the one matched"),
    "stream": implemented("server-sent events in Anthropic's order, with `ping`"),
    "temperature": implemented("0 is greedy", minimum=0, maximum=1),
    "top_p": implemented("nucleus sampling; must be above 0", minimum=0, maximum=1),
    "top_k": implemented("sample from the k most likely tokens; 0: off", minimum=0,
                         maximum=2**31 - 1),
    "tools": implemented("client tools (`custom`, or no `type`) with `input_schema`, rendered "
                         "into the prompt; server tools (`web_search_*`, `bash_*`, ...) are a "
                         "400"),
    "tool_choice": implemented("`auto`, `any` and `tool` (the call is grammar-enforced against "
                               "`input_schema`), `none`"),
    "thinking": implemented("`enabled` (with a reasoning parser: the thinking comes as a "
                            "`thinking` block, at most `budget_tokens` tokens, then the end "
                            "marker is forced; without one a 400), `disabled` (the think block "
                            "ends at once: no `thinking` block), `adaptive` (the model decides); "
                            "`between_tools` is a 400"),
    "context_management": implemented("`edits` (beta; Claude Code sends it): see the "
                                      "sub-fields"),
    "output_config": implemented("`format` (a JSON Schema the answer is held to); see the "
                                 "sub-fields"),
    "metadata": ignored("`user_id`, for Anthropic's abuse detection; changes no output"),
    "cache_control": ignored(_CACHE_HINT),
    "service_tier": refused("one capacity tier here", noop=("auto", "standard_only")),
    "speed": ignored("one speed here; it changes no output"),
    "container": refused("no code-execution container"),
    "diagnostics": refused("no prompt-cache diagnostics"),
    "inference_geo": ignored("inference runs on this server; changes no output"),
    "user_profile_id": ignored(_NO_OUTPUT_EFFECT),
    "workspace_id": ignored(_NO_OUTPUT_EFFECT),
}

_TEXT_BLOCK: dict[str, FieldRule] = {
    "type": implemented("`text`", enum=("text",)),
    "text": implemented("joined with the message's other text blocks"),
    "cache_control": ignored(_CACHE_HINT),
    "citations": refused("no citations", noop=([],)),
}

_MESSAGE: dict[str, FieldRule] = {
    "role": implemented("`user`, `assistant`, `system` (in place); consecutive turns of one "
                        "role are one turn, as Anthropic combines them"),
    "content": implemented("a string or content blocks"),
}

_CONTENT_BLOCK: dict[str, FieldRule] = {
    "type": implemented("`text`, `tool_use` (assistant), `tool_result` (user), `thinking` and "
                        "`redacted_thinking` (assistant; not shown to the model, as Anthropic "
                        "strips earlier turns' thinking)"),
    "text": implemented("a text block's text"),
    "id": implemented("a `tool_use` block's id, answered by a `tool_result`'s `tool_use_id`"),
    "name": implemented("the tool a `tool_use` block called"),
    "input": implemented("a `tool_use` block's input object, rendered as the model writes calls"),
    "tool_use_id": implemented("the `tool_use` a `tool_result` answers (in the turn before)"),
    "content": implemented("a `tool_result`'s content: a string or text blocks"),
    "is_error": implemented("true: the result is shown to the model as `Error: ` + content"),
    "thinking": implemented("an earlier turn's thinking: accepted, not shown to the model"),
    "signature": ignored("a thinking block's signature; nothing here checks one"),
    "data": implemented("a `redacted_thinking` block's data: accepted, not shown to the model"),
    "cache_control": ignored(_CACHE_HINT),
    "citations": refused("no citations", noop=([],)),
    "caller": refused("only direct tool calls here (no code-execution callers)",
                      noop=({"type": "direct"},)),
    "toolset_name": refused("no server toolsets"),
    "source": refused("no image or document input"),
    "transformations": refused("no image input"),
    "title": refused("no document input"),
    "context": refused("no document input"),
}

_RESULT_BLOCK: dict[str, FieldRule] = {
    **_TEXT_BLOCK,
    "source": refused("no image input"),
    "transformations": refused("no image input"),
}

_TOOL: dict[str, FieldRule] = {
    "name": implemented("the name `tool_use` blocks carry"),
    "description": implemented("rendered into the prompt with the tool"),
    "input_schema": implemented("the JSON Schema of the input: rendered, and enforced by the "
                                "call grammar"),
    "type": implemented("`custom` (or absent): a client tool", enum=("custom",)),
    "strict": implemented("true: a 400 for a keyword the call grammar cannot enforce"),
    "cache_control": ignored(_CACHE_HINT),
    "eager_input_streaming": ignored("tool input always streams as it is generated"),
    "defer_loading": refused("no tool search: every tool is in the prompt", noop=(False,)),
    "allowed_callers": refused("only direct calls (no code execution)", noop=(["direct"],)),
    "input_examples": refused("no input examples in the prompt; put them in `description`",
                              noop=([],)),
}

_TOOL_CHOICE: dict[str, FieldRule] = {
    "type": implemented("`auto`, `any`, `tool` or `none`", enum=("auto", "any", "tool", "none")),
    "name": implemented("the tool to call (`type: tool`)"),
    "disable_parallel_tool_use": implemented("true: at most one call (`any`/`tool`: exactly "
                                             "one)"),
}

_THINKING: dict[str, FieldRule] = {
    "type": implemented("`enabled`, `disabled`, `adaptive` (see `thinking`)"),
    "budget_tokens": implemented("with `enabled`, required: the most tokens the thinking may "
                                 "take (they count toward `max_tokens`)"),
    "display": refused("every thinking block shows its text", noop=("summarized",)),
}

_CONTEXT_MANAGEMENT: dict[str, FieldRule] = {
    "edits": implemented("context edits, each applied before the prompt is rendered"),
}

_CONTEXT_EDIT: dict[str, FieldRule] = {
    "type": implemented("`clear_thinking_20251015`; `clear_tool_uses_20250919` and "
                        "`compact_20260112` are a 400 (tool results and turns are always "
                        "kept)", enum=("clear_thinking_20251015",)),
    "keep": ignored("earlier turns' thinking is never shown to the model here (see "
                    "`messages[].content[].thinking`), so there is none to keep or clear"),
}

_OUTPUT_CONFIG: dict[str, FieldRule] = {
    "format": implemented("`json_schema`: the answer's text is held to the schema by the "
                          "grammar (a 400 for a keyword no backend enforces)"),
    "effort": refused("a reasoning-effort control the served model lacks", noop=("high",)),
}

_OUTPUT_FORMAT: dict[str, FieldRule] = {
    "type": implemented("`json_schema`", enum=("json_schema",)),
    "schema": implemented("a JSON Schema"),
}

_METADATA: dict[str, FieldRule] = {"user_id": ignored(_NO_OUTPUT_EFFECT)}

_CACHE_CONTROL: dict[str, FieldRule] = {
    "type": ignored(_CACHE_HINT),
    "ttl": ignored(_CACHE_HINT),
}

MESSAGES_NESTED: dict[str, dict[str, FieldRule]] = {
    "system[]": _TEXT_BLOCK,
    "messages[]": _MESSAGE,
    "messages[].content[]": _CONTENT_BLOCK,
    "messages[].content[].content[]": _RESULT_BLOCK,
    "tools[]": _TOOL,
    "tool_choice": _TOOL_CHOICE,
    "thinking": _THINKING,
    "output_config": _OUTPUT_CONFIG,
    "output_config.format": _OUTPUT_FORMAT,
    "metadata": _METADATA,
    "cache_control": _CACHE_CONTROL,
    "context_management": _CONTEXT_MANAGEMENT,
    "context_management.edits[]": _CONTEXT_EDIT,
}

# count_tokens takes the prompt's fields of a Messages request (Anthropic's
# MessageCountTokensParams): everything but the answer's.
COUNT_TOKENS_FIELDS: dict[str, FieldRule] = {
    name: rule for name, rule in MESSAGES_FIELDS.items()
    if name not in ("max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
                    "metadata", "service_tier", "container", "diagnostics", "inference_geo")
}


def check_messages_fields(body: Any, fields: dict[str, FieldRule] = MESSAGES_FIELDS) -> None:
    """Refuse what the tables refuse in ``body`` (a decoded JSON value; anything but an object
    is left to the parser), and every field they do not list.

    Raises:
        APIError: 400 naming the field by its dotted path (``messages[1].content[0].source``):
            ``code`` ``unsupported_parameter`` for a refused or unknown field, null for a value
            out of range.
    """
    if not isinstance(body, dict):
        return
    for where, tool in objects_at(body, path_steps("tools[]")):
        _check_tool_type(where, tool.get("type"))
    _check_object("", body, fields)
    for path, table in MESSAGES_NESTED.items():
        if path_steps(path)[0][0] not in fields:
            continue
        for where, obj in objects_at(body, path_steps(path)):
            _check_object(where, obj, table)


def _check_object(where: str, obj: dict[str, Any], table: dict[str, FieldRule]) -> None:
    """The known fields first (a server tool is named by its ``type`` before its own
    fields are), then the unknown ones."""
    for key, value in obj.items():
        if key in table:
            check_value(f"{where}.{key}" if where else key, value, table[key])
    for key in obj:
        if key not in table:
            name = f"{where}.{key}" if where else key
            raise APIError(f"{name}: unknown field (not a field of this Anthropic Messages "
                           "request that this server knows)", param=name,
                           code="unsupported_parameter")


def _check_tool_type(where: str, kind: Any) -> None:
    """A server tool (any ``type`` but ``custom``) is refused by name, before its own fields
    are looked at."""
    if kind is None or kind == "custom" or not isinstance(kind, str):
        return
    raise APIError(f"{where}.type: {kind!r} is a server tool, which Anthropic's platform runs; "
                   "this server serves client tools only (`custom`, or no `type`)",
                   param=f"{where}.type", code="unsupported_parameter")


def markdown_table() -> str:
    """docs/api.md's Messages field table: the top-level fields, then each nested object's."""
    rows = ["| field | status | notes |", "|---|---|---|"]
    rows += [f"| `{name}` | {rule.status} | {rule_note(rule)} |"
             for name, rule in MESSAGES_FIELDS.items()]
    for path, table in MESSAGES_NESTED.items():
        rows += [f"| `{path}.{name}` | {rule.status} | {rule_note(rule)} |"
                 for name, rule in table.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
