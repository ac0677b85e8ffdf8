"""The reasoning fields' 400s on the fake engine: a thinking budget asked of a server without a
reasoning parser (the default model's template has no think block), both ways of asking at once,
an unknown effort, and a ``chat_template_kwargs`` key the template does not read."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.routes import create_app
from tests.http_api import CONTEXT_LEN, MODEL

THINK_TEMPLATE = Path(__file__).parents[1] / "e2e" / "data" / "think_template.jinja"
ASK = [{"role": "user", "content": "Hi"}]


def _think_client(fake, tokenizer) -> TestClient:
    chat = ChatRenderer(tokenizer, THINK_TEMPLATE.read_text(), "auto", None, "auto", -1)
    return TestClient(create_app(fake, tokenizer, MODEL, CONTEXT_LEN,
                                 [tokenizer.eos_token_id], chat=chat))


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"thinking_token_budget": 5}, "thinking_token_budget"),
    ("/v1/completions", {"thinking_token_budget": 5}, "thinking_token_budget"),
])
def test_no_reasoning_parser_refuses_a_budget(client, path: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "no reasoning parser" in r.json()["error"]["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning_effort": "low", "thinking_token_budget": 5}, "thinking_token_budget"),
    ({"reasoning_effort": "enormous"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_reasoning": True}}, "chat_template_kwargs.enable_reasoning"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_reasoning_fields_refused_by_name(fake, tokenizer, extra: dict, param: str) -> None:
    client = _think_client(fake, tokenizer)
    r = client.post("/v1/chat/completions",
                    json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_think_template_gives_reasoning_content(fake, tokenizer) -> None:
    client = _think_client(fake, tokenizer)
    r = client.post("/v1/chat/completions",
                    json={"model": MODEL, "messages": ASK, "max_tokens": 8,
                          "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    # The fake engine's answer lands inside the opened block: all of it is thinking.
    assert message["reasoning_content"] and message["content"] in (None, "")
