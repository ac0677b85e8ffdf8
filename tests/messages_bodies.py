"""Messages request bodies for fuzzing, drawn from the ``anthropic`` SDK's own request types
(``MessageCreateParams`` and every TypedDict under it): what its clients can send, as hypothesis
strategies. Anthropic publishes no OpenAPI file; the SDK's types are generated from its spec.

A TypedDict is its required keys and any of its optional ones; a ``Literal`` one of its values;
a ``Union`` one of its members; an iterable a short list. Sizes stay small, ``model`` is the
served one and ``max_tokens`` at most a few tokens, so every body is cheap to serve; a few raw
extras (unknown fields, wrong types) are mixed in. :func:`check_messages_answer` checks an
answer: no 5xx, an error in Anthropic's shape, a 200 a whole message or event stream.
"""

from __future__ import annotations

import collections.abc
import json
import typing
from typing import Any

import typing_extensions
from hypothesis import strategies as st

MAX_TOKENS = 6
_PRIMITIVES: dict[Any, st.SearchStrategy] = {
    str: st.text(max_size=12),
    int: st.integers(-3, 40),
    float: st.floats(-0.5, 2.0, allow_nan=False),
    bool: st.booleans(),
    object: st.none() | st.integers(-3, 3) | st.text(max_size=4),
    type(None): st.none(),
}
_LISTS = {list, collections.abc.Iterable, collections.abc.Sequence}


def from_type(tp: Any, depth: int = 0) -> st.SearchStrategy:
    """A strategy for values of the SDK type ``tp`` (``depth``: TypedDicts entered so far)."""
    if depth > 6:
        return st.none()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _PRIMITIVES:
        return _PRIMITIVES[tp]
    if origin is typing.Annotated:
        return from_type(args[0], depth)
    if origin in (typing_extensions.Required, typing_extensions.NotRequired):
        return from_type(args[0], depth)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is typing.Union:
        members = [a for a in args if not _is_model(a)]
        return st.one_of([from_type(a, depth) for a in members])
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return st.dictionaries(st.text(max_size=6), _PRIMITIVES[object], max_size=3)
    if origin in _LISTS or getattr(tp, "__name__", "") == "SequenceNotStr":
        item = args[0] if args else object
        return st.lists(from_type(item, depth), max_size=3)
    if typing_extensions.is_typeddict(tp):  # the SDK's are typing_extensions'
        return _typed_dict(tp, depth + 1)
    return _PRIMITIVES[object]


def _is_model(tp: Any) -> bool:
    """A response model (pydantic) inside a request union: the SDK accepts it, sent as JSON."""
    return isinstance(tp, type) and hasattr(tp, "model_fields")


def _typed_dict(tp: Any, depth: int) -> st.SearchStrategy:
    hints = typing.get_type_hints(tp, include_extras=True)
    # The SDK's annotations are strings (``from __future__ import annotations``), so the class
    # could not see ``Required`` when it was made: read it from the evaluated hints.
    required = set(getattr(tp, "__required_keys__", ())) | {
        k for k, v in hints.items() if typing.get_origin(v) is typing_extensions.Required}
    return st.fixed_dictionaries(
        {k: from_type(v, depth) for k, v in hints.items() if k in required},
        optional={k: from_type(v, depth) for k, v in hints.items() if k not in required})


def body_strategy(served_only: bool) -> st.SearchStrategy:
    """Bodies of ``POST /v1/messages``. ``served_only``: only text messages and client tools
    (bodies that reach the engine more often); else any the SDK's types allow."""
    from anthropic.types import message_create_params as m

    fields = typing.get_type_hints(m.MessageCreateParamsBase, include_extras=True)
    if served_only:
        text = st.text(max_size=40)
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                         "content": text})
        tool = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather"]),
                                      "input_schema": st.just({"type": "object"})})
        strategies = {
            "messages": st.lists(message, min_size=1, max_size=3),
            "system": st.one_of(text, st.lists(st.fixed_dictionaries(
                {"type": st.just("text"), "text": text}), max_size=2)),
            "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=5),
            "tools": st.lists(tool, max_size=2, unique_by=lambda t: t["name"]),
            "tool_choice": from_type(fields["tool_choice"]),
            "temperature": st.floats(0, 1), "top_p": st.floats(0.1, 1),
            "top_k": st.integers(0, 50), "stream": st.booleans(),
            "output_config": from_type(fields["output_config"]),
        }
    else:
        strategies = {k: from_type(v) for k, v in fields.items()
                      if k not in ("model", "max_tokens")}
        strategies |= {"stream": st.booleans(), "temperature": st.floats(-1, 2),
                       "top_k": st.integers(-2, 50), "unknown_field": st.integers()}
    base = {"model": st.just("default"), "max_tokens": st.integers(0, MAX_TOKENS),
            "messages": strategies.pop("messages")}
    return st.fixed_dictionaries(base, optional=strategies)


def check_messages_answer(status: int, text: str, content_type: str) -> None:
    """An answer to a fuzzed body: below 500; an error is Anthropic's error body; a 200 is a
    message, or an event stream that ends with ``message_stop`` or an ``error`` event."""
    assert status < 500, (status, text)
    if status != 200:
        body = json.loads(text)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, text
        return
    if content_type.startswith("text/event-stream"):
        kinds = [json.loads(line[6:])["type"] for line in text.splitlines()
                 if line.startswith("data: ")]
        assert kinds[:2] == ["message_start", "ping"], text
        assert kinds[-1] in ("message_stop", "error"), text
        return
    body = json.loads(text)
    assert body["type"] == "message" and isinstance(body["content"], list), text
    assert body["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use",
                                   "model_context_window_exceeded"), text
