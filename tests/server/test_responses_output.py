"""The output builder (``server.responses_api.output``) with no server: every event it makes
validates as the ``openai`` client's own event types, the items follow from the text however it
is split into deltas (a call split at every position), and thinking deltas make a ``reasoning``
item before the answer's message, as a reasoning parser will feed it."""

from __future__ import annotations

import json

import openai.types.responses as types
import pytest
from pydantic import TypeAdapter

from splitserve.server.responses_api.envelope import Envelope
from splitserve.server.responses_api.output import OutputBuilder
from splitserve.server.responses_api.protocol import ResponsesRequest
from splitserve.server.tools.formats import HERMES

EVENTS = TypeAdapter(types.ResponseStreamEvent)
TEXT = "Let me check. "
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(builder: OutputBuilder, chunks: list[tuple[str, str]], truncated: bool = False
        ) -> list[dict]:
    events = []
    for text, thought in chunks:
        events += builder.feed(text, thought)
    events += builder.finish(truncated)
    for i, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": i})
    return events


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_every_split_of_a_call_gives_the_same_items() -> None:
    whole = TEXT + CALL
    reference = OutputBuilder(HERMES)
    run(reference, [(whole, "")])
    assert [i["type"] for i in reference.items] == ["message", "function_call"]
    assert json.loads(reference.items[1]["arguments"]) == {"city": "Paris"}
    for cut in range(1, len(whole)):
        builder = OutputBuilder(HERMES)
        events = run(builder, [(whole[:cut], ""), (whole[cut:], "")])
        assert without_ids(builder.items) == without_ids(reference.items), cut
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == TEXT.strip() and "<" not in text


def test_thinking_comes_as_a_reasoning_item_before_the_answer() -> None:
    builder = OutputBuilder(None)
    events = run(builder, [("", "The user "), ("", "wants a greeting."), ("Hello", ""),
                           ("!", "")])
    reasoning, message = builder.items
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    thought = "The user wants a greeting."
    assert reasoning["content"] == [{"type": "reasoning_text", "text": thought}]
    assert message["content"][0]["text"] == "Hello!"
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds.index("response.output_text.delta") > done
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    types.ResponseReasoningItem.model_validate(reasoning)


def test_a_truncated_answer_leaves_its_last_item_incomplete() -> None:
    builder = OutputBuilder(HERMES)
    run(builder, [(TEXT + CALL[:62], "")], truncated=True)  # cut in the arguments
    message, call = builder.items
    assert message["status"] == "completed" and call["status"] == "incomplete"
    assert call["arguments"] and not call["arguments"].endswith("}")


def test_an_empty_answer_is_an_empty_message() -> None:
    builder = OutputBuilder(None)
    events = run(builder, [])
    assert [i["content"][0]["text"] for i in builder.items] == [""]
    assert events[-1]["type"] == "response.output_item.done"


@pytest.mark.parametrize("status", ["queued", "in_progress", "completed", "incomplete",
                                    "failed", "cancelled"])
def test_the_response_object_is_the_clients_response_type(status: str) -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "input": "hi", "instructions": "Be brief.", "metadata": {"a": "b"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                   "strict": False},
                  {"type": "namespace", "name": "ns", "description": "d", "tools": [
                      {"type": "function", "name": "g", "parameters": None, "strict": None}]}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    builder = OutputBuilder(HERMES)
    run(builder, [(TEXT + CALL, "")])
    error = {"code": "server_error", "message": "boom"} if status == "failed" else None
    body = Envelope.new("resp_1", req).body(status, builder.items, None, error)
    parsed = types.Response.model_validate(body)
    assert parsed.status == status and parsed.output_text == TEXT.strip()
    assert (body["incomplete_details"] is not None) == (status == "incomplete")
