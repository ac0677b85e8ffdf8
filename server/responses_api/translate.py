"""A Responses request as the chat request the chat path serves: the one internal request.

- ``instructions`` -> a ``system`` message first;
- items (the stored conversation before this request, then this request's input) -> messages:
  a ``message`` item keeps its role and text; ``function_call`` items join the assistant turn
  before them (or start one) as its ``tool_calls``; a ``function_call_output`` is a ``tool``
  message; ``reasoning`` items are dropped (earlier turns' thinking: chat templates that think,
  Qwen3's and DeepSeek-R1's, drop it from earlier turns too);
- function ``tools`` -> chat ``tools`` (``strict`` kept); a ``namespace`` tool's functions
  are offered as ``<namespace>__<function>`` (its description before theirs), and their calls
  come back split (:class:`FunctionNames`); ``tool_choice`` and
  ``parallel_tool_calls`` as they are, a named function as chat's named choice;
- ``text.format`` -> ``response_format``; ``max_output_tokens`` -> ``max_completion_tokens``;
  ``include: ["message.output_text.logprobs"]`` -> ``logprobs`` with ``top_logprobs``.

The chat path's refusals name chat's fields; :func:`as_responses_error` renames them
(``max_completion_tokens`` -> ``max_output_tokens``, ``messages`` -> ``input``,
``response_format`` -> ``text.format``, ``tools[0].function.parameters`` ->
``tools[0].parameters``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.protocol import ChatCompletionRequest
from splitserve.server.responses_api.protocol import FunctionTool, ResponsesRequest

NAMESPACE_JOIN = "__"


def chat_name(name: str, namespace: str | None) -> str:
    """The name the model sees for function ``name`` of ``namespace`` (None: a plain tool)."""
    return name if namespace is None else f"{namespace}{NAMESPACE_JOIN}{name}"


@dataclass(frozen=True, slots=True)
class FunctionNames:
    """The request's namespaced functions: the name the model calls -> (namespace, name)."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, req: ResponsesRequest) -> FunctionNames:
        return cls({chat_name(fn.name, tool.name): (tool.name, fn.name)
                    for tool in req.tools or () if not isinstance(tool, FunctionTool)
                    for fn in tool.tools})

    def split(self, called: str) -> tuple[str | None, str]:
        """``(namespace, name)`` of a call the model made to ``called``."""
        return self.namespaced.get(called, (None, called))


def chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``req`` whose conversation is ``items`` (stored shape, in order).

    Raises:
        APIError: a conversation chat cannot take (a ``function_call_output`` whose call is
            not in it, arguments that are not a JSON object...), named in Responses' terms.
    """
    messages = ([{"role": "system", "content": req.instructions}]
                if req.instructions is not None else [])
    messages += chat_messages(items)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = chat_tools(req)
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice if isinstance(choice, str)
                               else {"type": "function", "function": {"name": choice.name}})
    fmt = req.format
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in (
                ("name", fmt.name), ("schema", fmt.schema_), ("description", fmt.description),
                ("strict", fmt.strict)) if v is not None}})
    for ours, theirs in (("parallel_tool_calls", "parallel_tool_calls"),
                         ("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p")):
        value = getattr(req, ours)
        if value is not None:
            body[theirs] = value
    if req.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise as_responses_error(from_validation_errors(exc.errors(), body)) from None


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's function tools as chat's, namespaces flattened (module docstring)."""
    out = []
    for tool in req.tools or ():
        if isinstance(tool, FunctionTool):
            out.append(_chat_function(tool, tool.name, tool.description))
            continue
        for fn in tool.tools:
            about = " ".join(d for d in (tool.description, fn.description) if d) or None
            out.append(_chat_function(fn, chat_name(fn.name, tool.name), about))
    return out


def _chat_function(tool: FunctionTool, name: str, description: str | None) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items (see the module docstring)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            name = chat_name(item["name"], item.get("namespace"))
            names[item["call_id"]] = name
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p["text"] for p in output)
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": text}
            called = names.get(item["call_id"]) or item.get("name")
            if called is not None:
                message["name"] = called
            out.append(message)
        # reasoning: dropped (module docstring)
    return out


_RENAMES = (
    # A chat message's index is no input item's (instructions, stored items come first).
    (re.compile(r"^messages\S*?(?=:|$)"), "input"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"),
)


def responses_param(param: str | None) -> str | None:
    """A chat field's name as the Responses field it came from."""
    if param is None:
        return None
    for pattern, repl in _RENAMES:
        if pattern.match(param):
            return pattern.sub(repl, param, count=1)
    return param


def as_responses_error(err: APIError) -> APIError:
    """``err`` (raised by the chat path) naming the Responses field instead of chat's: its
    ``param``, and the message that starts with it."""
    param = responses_param(err.param)
    if param == err.param:
        return err
    message = err.message
    if err.param and message.startswith(err.param):
        message = param + message[len(err.param):]
    renamed = APIError(message, param=param, status_code=err.status_code, type=err.type,
                       code=err.code, headers=err.headers)
    return renamed
