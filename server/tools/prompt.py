"""Tools and tool history for a chat template that does not know them: the built-in tool prompt.

A template that renders ``tools`` (Qwen2.5, Llama 3.1, Mistral v0.3...) gets the request's tools
and its history as Hugging Face templates expect them (:func:`hf_messages`). A template that
ignores them (SmolLM2's) would silently drop both, so the conversation is rewritten into plain
messages first (:func:`builtin_messages`):

- a system block listing the functions (name, description, parameters as JSON, one per line)
  and showing the call envelope of the format in use (``server.tools.formats``, Hermes by
  default), appended to the first system message or put in front as a new one (after the
  template's default system prompt, which the new message would otherwise replace);
- an earlier assistant turn's calls become the text the model would have written for them;
- ``tool`` results become a user message of ``<tool_response>`` blocks (consecutive results in
  one message), the convention Hermes-style models are trained on.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.server.tools.formats import ToolCallFormat

TOOL_RESPONSE = "<tool_response>\n{}\n</tool_response>"


def builtin_tool_prompt(fmt: ToolCallFormat, tools: list[dict[str, Any]]) -> str:
    """The system text that describes ``tools`` (OpenAI ``tools[]`` entries) and how to call
    them in ``fmt``."""
    lines = [json.dumps(_function_card(t["function"]), ensure_ascii=False) for t in tools]
    example = fmt.render_calls([("FUNCTION_NAME", "ARGUMENTS")])
    return (
        "# Functions\n\n"
        "You may call the functions below when they help with the request. Each is one JSON "
        "object (its name, what it does, and the JSON Schema of its arguments):\n"
        + "\n".join(lines)
        + "\n\nTo call a function, reply with exactly\n"
        + example
        + "\nwhere FUNCTION_NAME is the function's name in double quotes and ARGUMENTS a JSON "
        "object that follows its schema; for several calls, write one after another. Results "
        "come back in <tool_response></tool_response> blocks. If no function is needed, reply "
        "in plain text."
    )


def _function_card(function: dict[str, Any]) -> dict[str, Any]:
    card = {"name": function["name"]}
    if function.get("description"):
        card["description"] = function["description"]
    card["parameters"] = function.get("parameters") or {"type": "object"}
    return card


def builtin_messages(
    messages: list[dict[str, Any]], fmt: ToolCallFormat, tools: list[dict[str, Any]] | None,
    default_system: str = "",
) -> list[dict[str, str]]:
    """``messages`` (as :func:`hf_messages` makes them) rewritten for a template with no tool
    support: plain ``role`` + ``content`` strings, and the sender's ``name`` where a message
    other than a tool result has one (see the module docstring). ``default_system``: the
    template's default system prompt (``ChatRenderer.default_system``), put before the tool
    prompt when the conversation has no system message."""
    out: list[dict[str, str]] = []
    for msg in messages:
        role, content = msg["role"], msg.get("content") or ""
        if role == "tool":
            block = TOOL_RESPONSE.format(content)
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        if msg.get("tool_calls"):
            calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"],
                                                      ensure_ascii=False))
                     for c in msg["tool_calls"]]
            content = (content + "\n" if content else "") + fmt.render_calls(calls)
        out.append({"role": role, "content": content})
        if msg.get("name"):
            out[-1]["name"] = msg["name"]
    for msg in out:
        msg.pop("_tool", None)
    if tools:
        prompt = builtin_tool_prompt(fmt, tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": join_system(out[0]["content"], prompt)}
        else:
            out.insert(0, {"role": "system", "content": join_system(default_system, prompt)})
    return out


def join_system(first: str, text: str) -> str:
    """A system message's content: ``text`` after ``first`` (the client's system text, or the
    template's default system prompt for a new message), a blank line between; ``text`` alone
    when ``first`` is empty."""
    return f"{first}\n\n{text}" if first else text


def hf_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Request messages (``server.protocol.ChatMessage``) as Hugging Face chat templates take
    them: an assistant's ``tool_calls`` with ``arguments`` parsed into a dict (templates write
    it with ``tojson``), a ``tool`` message with its ``tool_call_id`` and the ``name`` of the
    function it answers (found from the call of that id, unless the message names it), and
    any other message's ``name`` as the client sent it.

    Raises:
        ValueError: naming the message and field, for arguments that are not a JSON object.
    """
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        item = msg.as_template_dict()
        if msg.tool_calls:
            calls = []
            for j, call in enumerate(msg.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc})") from None
                if not isinstance(arguments, dict):
                    raise ValueError(f"{where}: must be a JSON object")  # noqa: TRY004 - a 400
                names[call.id] = call.function.name
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            item["tool_calls"] = calls
            item["content"] = item["content"] or ""
        if msg.role == "tool":
            item["tool_call_id"] = msg.tool_call_id
            if msg.tool_call_id in names and "name" not in item:
                item["name"] = names[msg.tool_call_id]
        out.append(item)
    return out
