"""Legacy-completions ``echo``/``logprobs`` and the ``/chat_template`` route, on the fake engine
(which sends no prompt logprobs: those are checked against transformers in tests/e2e)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app

MODEL = "smol-test"


@pytest.fixture
def client(tokenizer) -> TestClient:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    return TestClient(create_app(fake, tokenizer, MODEL, 256, [tokenizer.eos_token_id]))


def test_echo_with_zero_tokens_returns_the_prompt_only(client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "echo": True, "max_tokens": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == "Once upon a time"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0


def test_logprobs_object_covers_prompt_and_output(client, tokenizer) -> None:
    prompt = "Once upon a time"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3,
            "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    n_prompt = len(tokenizer.encode(prompt))
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_prompt + len(choice["token_ids"])
    assert lp["token_logprobs"][0] is None  # nothing predicts the first token
    assert choice["text"].startswith(prompt)
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    assert lp["text_offset"][1] == len(lp["tokens"][0])


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"stream": True, "echo": True}, "stream"), ({"max_tokens": 0}, "max_tokens"),
     ({"logprobs": 6}, "logprobs")],
)
def test_unsupported_combinations_are_400(client, extra, param) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_chat_template_route(client, tokenizer) -> None:
    out = client.get("/chat_template").json()
    assert out["chat_template"] == tokenizer.chat_template
