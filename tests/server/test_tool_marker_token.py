"""A tool-call marker that is a special token (Mistral's ``[TOOL_CALLS]``) reaches the tool
parser: the detokenizer skips special tokens, so the marker would vanish and the call come back
as plain content. Tested on a Mistral-style tokenizer: the default model's, with
``[TOOL_CALLS]`` added as a special token, and a template that renders tools and names it."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.detokenizer import IncrementalDetokenizer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events
from splitserve.server.tools.formats import MISTRAL

MODEL = "smol-test"
MARKER = "[TOOL_CALLS]"
TEMPLATE = ("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
            "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
            "{# calls are written as [TOOL_CALLS][...] #}")
REPLY = MARKER + '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def mistral_style(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.add_special_tokens({"additional_special_tokens": [MARKER]})
    return tok


def test_the_marker_is_one_special_token_the_plain_decode_drops(mistral_style) -> None:
    ids = mistral_style.encode(REPLY, add_special_tokens=False)
    marker_id = mistral_style.convert_tokens_to_ids(MARKER)
    assert ids[0] == marker_id and marker_id in mistral_style.all_special_ids
    assert not mistral_style.decode(ids, skip_special_tokens=True).startswith(MARKER)  # the bug

    kept = IncrementalDetokenizer(mistral_style, keep_tokens={marker_id: MARKER})
    text = "".join(kept.push([t]) for t in ids) + kept.flush()
    assert text == REPLY
    eos = mistral_style.eos_token_id  # other special tokens are still skipped
    assert kept.push([eos]) + kept.flush() == ""


def _app(tokenizer) -> TestClient:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=REPLY)
    renderer = ChatRenderer(tokenizer, TEMPLATE)
    assert renderer.tool_format is MISTRAL and renderer.begin_token is not None
    return TestClient(create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id],
                                 renderer))


def test_call_parsed_through_the_special_marker(mistral_style) -> None:
    client = _app(mistral_style)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                  "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and len(call["id"]) == 9
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}


def test_streamed_call_through_the_special_marker(mistral_style) -> None:
    client = _app(mistral_style)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                  "tools": [WEATHER], "stream": True})
    events = [e for e in iter_events(r.text.splitlines()) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == ""  # no markup as content
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Rome"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_the_marker_stays_skipped(mistral_style) -> None:
    client = _app(mistral_style)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.json()["choices"][0]["message"]["content"] == REPLY.removeprefix(MARKER)


def test_the_call_grammar_writes_the_special_marker(mistral_style) -> None:
    # The marker is a special token, which the xgrammar backend's vocabulary keeps out of text:
    # the call grammar names it by id, and the backend gives it its text for that grammar only.
    from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend
    from splitserve.server.tools.grammar import FunctionSpec, tool_call_constraint

    backend = XGrammarBackend(mistral_style)
    marker = mistral_style.convert_tokens_to_ids(MARKER)
    schema = WEATHER["function"]["parameters"]
    constraint = tool_call_constraint(MISTRAL, [FunctionSpec("get_weather", schema)],
                                      "required", True, marker)
    matcher = backend.compile(constraint.kind, constraint.text).create_matcher()
    ids = mistral_style.encode(REPLY, add_special_tokens=False)
    assert ids[0] == marker
    assert all(matcher.accept_token(t) for t in ids) and matcher.can_end()
    plain = backend.compile("json_object", "").create_matcher()
    assert not plain.accept_token(marker)  # other grammars still never write it
