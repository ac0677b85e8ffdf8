"""Anthropic's ``thinking`` on ``/v1/messages`` over a model served with a reasoning parser (the
test think template opens ``<think>`` in its generation prompt; the fake engine writes the
answer): ``enabled`` sends ``budget_tokens`` to the engine as the think block's budget and
answers the thinking as a ``thinking`` block before the text, whole and streamed alike;
``disabled`` asks the engine for a budget of 0; ``enabled`` without ``budget_tokens``, or on a
model without a reasoning parser, is a 400 in Anthropic's shape naming the field."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from tests.http_api import CONTEXT_LEN, MODEL
from tests.messages_api import check_anthropic_error

THINK_TEMPLATE = Path(__file__).parents[1] / "e2e" / "data" / "think_template.jinja"
REPLY = "Paris is in France.</think>Paris."
ASK = [{"role": "user", "content": "Capital of France?"}]


def _client(tokenizer, reasoning: bool = True) -> tuple[TestClient, FakeEngineClient]:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=REPLY)
    chat = (ChatRenderer(tokenizer, THINK_TEMPLATE.read_text(), "auto", None, "auto", -1)
            if reasoning else None)
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id], chat=chat)
    return TestClient(app), fake


def _post(client: TestClient, **body):
    return client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64,
                                             "messages": ASK, **body})


def test_enabled_thinking_is_a_thinking_block_with_the_budget_enforced(tokenizer) -> None:
    client, fake = _client(tokenizer)
    r = _post(client, thinking={"type": "enabled", "budget_tokens": 16})
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"], content
    assert content[0]["thinking"] == "Paris is in France." and content[1]["text"] == "Paris."
    assert fake.requests[-1][2].reasoning.budget == 16  # the engine forces the end there


def test_streamed_thinking_reassembles_to_the_whole_answer(tokenizer) -> None:
    client, _ = _client(tokenizer)
    body = {"model": MODEL, "max_tokens": 64, "messages": ASK, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 16}}
    with client.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                  if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert (thinking, text) == ("Paris is in France.", "Paris.")


def test_disabled_thinking_asks_for_a_budget_of_zero(tokenizer) -> None:
    client, fake = _client(tokenizer)
    assert _post(client, thinking={"type": "disabled"}).status_code == 200
    assert fake.requests[-1][2].reasoning.budget == 0


def test_enabled_without_budget_or_without_a_parser_is_a_400(tokenizer) -> None:
    client, fake = _client(tokenizer)
    r = _post(client, thinking={"type": "enabled"})
    assert r.status_code == 400
    assert check_anthropic_error(400, r.text)["message"].startswith("thinking.budget_tokens")
    client, fake = _client(tokenizer, reasoning=False)
    r = _post(client, thinking={"type": "enabled", "budget_tokens": 16})
    assert r.status_code == 400
    assert "no reasoning parser" in check_anthropic_error(400, r.text)["message"]
    assert _post(client, thinking={"type": "disabled"}).status_code == 200
    assert not any(s.reasoning for _, _, s in fake.requests)
