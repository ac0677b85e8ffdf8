"""Items as the Responses API shows them: ids, the request's input items in their stored shape,
and the output items an answer is made of.

Every item is a plain dict in OpenAI's item-resource shape (``ResponseInputMessageItem``,
``ResponseOutputMessage``, ``ResponseFunctionToolCall``, ``ResponseFunctionToolCallOutputItem``,
``ResponseReasoningItem``), with an ``id``: what ``GET .../input_items`` lists, what the store
keeps for ``previous_response_id`` and ``item_reference``, and what ``translate`` turns into
chat messages.
"""

from __future__ import annotations

import secrets
from typing import Any

from splitserve.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
)


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's look: ``resp_``, ``msg_``, ``fc_``, ``fco_`` or ``rs_`` and 48
    hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def input_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
               ) -> dict[str, Any]:
    """One request item (an :class:`ItemReference` is resolved before this) in its stored
    shape, with its own id or a new one."""
    if isinstance(item, MessageItem):
        part = "output_text" if item.role == "assistant" else "input_text"
        parts = ([{"type": part, "text": item.content}] if isinstance(item.content, str)
                 else [{"type": p.type, "text": p.text} for p in item.content])
        for p in parts:
            if p["type"] == "output_text":
                p["annotations"] = []
        return {"id": item.id or new_id("msg"), "type": "message", "role": item.role,
                "status": "completed", "content": parts}
    if isinstance(item, FunctionCallItem):
        return function_call(item.id or new_id("fc"), item.call_id, item.name, item.arguments,
                             namespace=item.namespace)
    if isinstance(item, FunctionCallOutputItem):
        out: dict[str, Any] = {
            "id": item.id or new_id("fco"), "type": "function_call_output",
            "call_id": item.call_id, "status": "completed",
            "output": item.output if isinstance(item.output, str)
            else [p.model_dump() for p in item.output]}
        if item.name is not None:
            out["name"] = item.name
        return out
    assert isinstance(item, ReasoningItem), item
    kept = item.model_dump(exclude_none=True)
    kept.setdefault("summary", [])
    return {**kept, "id": item.id or new_id("rs")}


def is_reference(item: Any) -> bool:
    return isinstance(item, ItemReference)


def message(item_id: str, text: str, status: str,
            logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message output item holding ``text`` as one ``output_text`` part."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` content part (``logprobs``: each token's, when asked for)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call(item_id: str, call_id: str, name: str, arguments: str,
                  status: str = "completed", namespace: str | None = None) -> dict[str, Any]:
    """A ``function_call`` item: ``arguments`` is the JSON text the model wrote; ``namespace``
    the namespace tool its function belongs to (None: a plain function tool)."""
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item holding the thinking as one ``reasoning_text`` part."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
