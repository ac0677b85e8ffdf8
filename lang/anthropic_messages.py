"""A program's chat prompt and step as an Anthropic Messages request, and the answer back.

The interpreter keeps its history in OpenAI's form (``lang.backend.ChatPrompt``); here it becomes
Anthropic's: ``system`` messages -> the ``system`` field; an assistant message's ``tool_calls``
-> ``tool_use`` blocks (input parsed from the arguments' JSON); ``tool`` messages ->
``tool_result`` blocks of one user turn; a last, open assistant message -> a final assistant
turn, which the server continues (prefill). Tools go the other way: OpenAI function specs ->
``{name, description, input_schema}``, ``tool_choice`` ``auto``/``required``/``none``/named ->
``auto``/``any``/``none``/``tool``, ``parallel_tool_calls: false`` ->
``disable_parallel_tool_use``.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.lang.backend import ChatPrompt, GenOutput, SamplingArgs, ToolsArgs
from splitserve.lang.errors import BackendError
from splitserve.lang.tool_calls import ToolCall

# Anthropic's stop_reason -> the finish_reason a program's meta reports (OpenAI's words, as for
# the other backends).
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
           "max_tokens": "length", "model_context_window_exceeded": "length"}


def messages_body(model: str, prompt: ChatPrompt, sampling: SamplingArgs) -> dict[str, Any]:
    """The request body for continuing ``prompt`` with ``sampling``.

    Raises:
        BackendError: ``seed`` is set (the Messages API has none), or a tool call's arguments
            are not a JSON object.
    """
    if sampling.seed is not None:
        raise BackendError("seed: the Messages API has no seed; leave it out for this backend",
                           unsupported=True)
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in prompt.messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system":
            system.append(content)
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"],
                     "content": content}
            _append(turns, "user", [block])
        elif role == "assistant":
            blocks = [{"type": "text", "text": content}] if content else []
            blocks += [_tool_use(c) for c in message.get("tool_calls") or []]
            _append(turns, "assistant", blocks)
        else:
            _append(turns, "user", [{"type": "text", "text": content}])
    body: dict[str, Any] = {"model": model, "max_tokens": sampling.max_tokens, "messages": turns}
    if system:
        body["system"] = "\n\n".join(system)
    if sampling.stop:
        body["stop_sequences"] = list(sampling.stop)
    for key in ("temperature", "top_p"):
        value = getattr(sampling, key)
        if value is not None:
            body[key] = value
    return body


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Blocks into the last turn when it has this role (tool results after each other, a user
    text after them), else a new turn."""
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"] += blocks
    else:
        turns.append({"role": role, "content": blocks})


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise BackendError(f"tool call {call.get('id')!r} ({fn['name']}): its arguments are "
                           "not a JSON object, which a tool_use block's input must be")
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments}


def tools_fields(tools: ToolsArgs) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` of a step with tools."""
    specs = [t["function"] for t in tools.tools]
    out: dict[str, Any] = {"tools": [
        {"name": f["name"], **({"description": f["description"]} if f.get("description") else {}),
         "input_schema": f.get("parameters") or {"type": "object"}} for f in specs]}
    choice = tools.tool_choice
    kind: dict[str, Any] | None = None
    if isinstance(choice, dict):
        kind = {"type": "tool", "name": choice["function"]["name"]}
    elif choice is not None:
        kind = {"type": {"auto": "auto", "required": "any", "none": "none"}[choice]}
    if tools.parallel_tool_calls is False:
        kind = {**(kind or {"type": "auto"}), "disable_parallel_tool_use": True}
    if kind is not None:
        out["tool_choice"] = kind
    return out


def message_output(body: dict[str, Any]) -> GenOutput:
    """A ``message`` answer as the program's output: its text blocks joined, its ``tool_use``
    blocks as calls, and its usage and stop reason as meta."""
    blocks = body.get("content") or []
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    calls = [ToolCall(b["id"], b["name"], b.get("input") or {},
                      json.dumps(b.get("input") or {}, ensure_ascii=False))
             for b in blocks if b.get("type") == "tool_use"]
    return GenOutput(text, usage_meta(body.get("stop_reason"), body.get("usage") or {}), calls)


def usage_meta(stop_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    """The meta the other backends report, from Anthropic's ``stop_reason`` and ``usage``
    (whose ``input_tokens`` exclude the ones read from the cache)."""
    cached = usage.get("cache_read_input_tokens") or 0
    return {"finish_reason": _FINISH.get(stop_reason or "", stop_reason),
            "stop_reason": stop_reason,
            "prompt_tokens": (usage.get("input_tokens") or 0) + cached,
            "completion_tokens": usage.get("output_tokens") or 0,
            "cached_tokens": cached}
