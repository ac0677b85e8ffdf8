"""A Messages request -> the one internal chat request the chat path builds its job from.

What each Anthropic field becomes (``server.protocol.ChatCompletionRequest``):

- ``system`` (and ``system``-role turns, in place) -> system messages; text blocks are joined
  with nothing between them, as the chat path joins text parts (clients put the newlines they
  want inside the blocks).
- Consecutive turns of one role are one turn (Anthropic combines them). A ``user`` turn's
  ``tool_result`` blocks -> ``tool`` messages answering the ``tool_use`` ids of the assistant
  turn before (an unknown id is a 400), ``is_error`` shown as ``Error: `` before the content;
  its text blocks -> one user message after them. An ``assistant`` turn's text -> ``content``,
  its ``tool_use`` blocks -> ``tool_calls`` (input as JSON), and its ``thinking`` /
  ``redacted_thinking`` blocks are dropped: Anthropic strips earlier turns' thinking from the
  context the model sees (and does not count it as input), and so do we.
- A final ``assistant`` turn is a prefill: its text ends the prompt, after the generation
  prompt, and the answer continues it (:attr:`Translated.prefill`).
- ``tools`` -> function tools (``input_schema`` as ``parameters``, ``strict`` kept);
  ``tool_choice`` ``auto``/``any``/``tool``/``none`` -> ``auto``/``required``/the named
  function/``none``, so an ``any`` or ``tool`` call is grammar-enforced against its schema;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``output_config.format`` -> ``response_format`` ``json_schema`` with ``strict: true``
  (Anthropic guarantees the schema, so a keyword no backend enforces is a 400).
- ``temperature``, ``top_p``, ``top_k`` as they are; ``stop_sequences`` and ``max_tokens`` are
  applied to the built job (:attr:`Translated.stop`; ``routes``), since Anthropic allows more
  than four stop strings and a ``max_tokens`` past the context window.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.messages_api.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from splitserve.server.protocol import ChatCompletionRequest

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(frozen=True, slots=True)
class Translated:
    """A Messages request as the chat path takes it.

    Attributes:
        chat: the chat request (``max_tokens`` unset: the job gets the whole room, and the
            route caps it at the request's ``max_tokens``).
        prefill: the final assistant turn's text the answer continues ("" for none).
        stop: the stop sequences.
    """

    chat: ChatCompletionRequest
    prefill: str = ""
    stop: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Turn:
    """Consecutive messages of one role: each block with its ``messages[i].content[j]``."""

    role: str
    blocks: list[tuple[str, Any]]


def translate(req: CountTokensRequest) -> Translated:
    """The chat request of ``req`` (a Messages or a count_tokens request).

    Raises:
        APIError: 400 naming the field: ``thinking`` other than ``disabled`` or
            ``adaptive``, a block in a turn
            it does not belong to, a ``tool_result`` answering no ``tool_use`` of the turn
            before, a prefill holding tool calls or combined with ``output_config.format``.
    """
    # ``adaptive`` lets the model decide whether to think; served without a reasoning parser,
    # it answers as with ``disabled`` (Claude Code sends ``adaptive`` on every request).
    if req.thinking is not None and req.thinking.type not in ("disabled", "adaptive"):
        raise APIError(f"thinking: type {req.thinking.type!r} needs a reasoning parser, which "
                       "this server does not run yet; send {\"type\": \"disabled\"} or "
                       "{\"type\": \"adaptive\"}, or leave thinking out", param="thinking",
                       code="unsupported_parameter")
    messages, prefill = chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            k: v for k, v in (("name", t.name), ("description", t.description),
                              ("parameters", t.input_schema), ("strict", t.strict))
            if v is not None}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (_TOOL_CHOICE[choice.type] if choice.type != "tool" else
                               {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        if prefill:
            raise APIError("output_config.format: the answer is held to the schema from its "
                           "first token, so it cannot continue a prefilled assistant turn",
                           param="output_config.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_, "strict": True}}
    stop: list[str] = []
    if isinstance(req, MessagesRequest):
        body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                       ("top_k", req.top_k)) if v is not None})
        stop = list(req.stop_sequences or [])
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), body) from None
    return Translated(chat, prefill, stop)


def chat_messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], str]:
    """``(chat messages, prefill text)`` of ``req``'s ``system`` and ``messages``.

    Raises:
        APIError: as :func:`translate`.
    """
    out: list[dict[str, Any]] = []
    system = req.system_text
    if system is not None:
        out.append({"role": "system", "content": system})
    turns = _merged(req.messages)
    prefill = ""
    if turns and turns[-1].role == "assistant":
        prefill = _prefill(turns.pop())
    calls: set[str] = set()  # the tool_use ids of the assistant turn before
    for turn in turns:
        if turn.role == "assistant":
            message, calls = _assistant(turn)
            out.append(message)
        elif turn.role == "system":
            out.append({"role": "system", "content": _texts(turn, "system")})
        else:
            out += _user(turn, calls)
            calls = set()
    return out, prefill


def _merged(messages: list[Message]) -> list[_Turn]:
    turns: list[_Turn] = []
    for i, msg in enumerate(messages):
        blocks = [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(msg.blocks)]
        if isinstance(msg.content, str):
            blocks = [(f"messages[{i}].content", msg.blocks[0])]
        if turns and turns[-1].role == msg.role:
            turns[-1].blocks += blocks
        else:
            turns.append(_Turn(msg.role, blocks))
    return turns


def _texts(turn: _Turn, role: str) -> str:
    """The text blocks of a turn that may hold only text (and thinking, which is dropped)."""
    parts = []
    for where, block in turn.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif not isinstance(block, ThinkingBlock) and block.type != "redacted_thinking":
            raise _misplaced(where, block.type, role)
    return "".join(parts)


def _prefill(turn: _Turn) -> str:
    if any(isinstance(block, ToolUseBlock) for _, block in turn.blocks):
        where = next(w for w, b in turn.blocks if isinstance(b, ToolUseBlock))
        raise APIError(f"{where}: the final assistant turn is continued (prefill) and may hold "
                       "only text; a tool_use there needs its tool_result in a user turn after "
                       "it", param=where)
    return _texts(turn, "a final assistant")


def _assistant(turn: _Turn) -> tuple[dict[str, Any], set[str]]:
    texts, calls = [], []
    for where, block in turn.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            raise _misplaced(where, block.type, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return message, {c["id"] for c in calls}


def _user(turn: _Turn, calls: set[str]) -> list[dict[str, Any]]:
    """Tool results first (they answer the turn before, wherever the client put them in the
    turn), then the text as one user message."""
    results, texts, has_text = [], [], False
    for where, block in turn.blocks:
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise APIError(f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use "
                               "block of the assistant turn just before", param=f"{where}.tool_use_id")
            text = ("Error: " if block.is_error else "") + block.text
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
            has_text = True
        else:
            raise _misplaced(where, block.type, "user")
    if has_text or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results


def _misplaced(where: str, kind: str, role: str) -> APIError:
    return APIError(f"{where}.type: a {kind!r} block cannot be in {role} turn"
                    f"{'s' if not role.startswith('a ') else ''}", param=f"{where}.type")


# Chat field names in the job builder's errors -> the Messages field a client wrote.
_PARAM_NAMES = [
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
    (re.compile(r"^response_format"), "output_config.format"),
    (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
]


# The strict json_schema refusal's words that name chat fields (server.constraints).
_STRICT_SCHEMA = [
    ("response_format.json_schema.strict is true, but no grammar backend",
     "output_config.format: no grammar backend"),
    ((" or set strict to false (then the response carries an x-splitserve-constraint: partial "
      "header naming them)"), " (the answer is held to the whole schema, as Anthropic holds it)"),
]


def as_messages_error(err: APIError) -> APIError:
    """``err`` (from the chat path) with its ``param``, and the message's leading field name,
    renamed to the Messages field it came from."""
    param = err.param
    if param is None:
        return err
    for pattern, name in _PARAM_NAMES:
        if pattern.match(param):
            renamed = pattern.sub(name, param)
            message = err.message
            for old, new in _STRICT_SCHEMA:
                message = message.replace(old, new)
            if message.startswith(param):
                message = renamed + message[len(param):]
            return APIError(message, param=renamed, status_code=err.status_code, type=err.type,
                            code=err.code, headers=err.headers)
    return err
