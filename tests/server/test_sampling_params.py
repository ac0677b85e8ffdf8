"""Request fields that become the engine's SamplingParams: the model alias, sampling, penalties,
logit bias, stop token ids, ignore_eos, max_completion_tokens and top logprobs."""

from __future__ import annotations

import pytest

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import CH, MODEL, USER, C


def test_model_alias_and_sampling_fields(client, fake) -> None:
    body = {
        "model": "default",
        "prompt": "x",
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "user": "someone",  # unknown OpenAI fields are ignored
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 5
    s = fake.requests[-1][2]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (
        5,
        0.0,
        0.5,
        7,
        0.1,
        42,
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_penalty_fields_reach_the_engine(client, fake, path) -> None:
    body = {"model": MODEL, "max_tokens": 5, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "logit_bias": {"7": -100, "12": 3.5}, "min_tokens": 2,
            "stop_token_ids": [9, 11], "ignore_eos": True}
    body |= {"prompt": "x"} if path == C else {"messages": USER}
    assert client.post(path, json=body).status_code == 200
    s = fake.requests[-1][2]
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert s.logit_bias == {7: -100.0, 12: 3.5} and s.min_tokens == 2
    assert s.stop_token_ids == [9, 11]  # ignore_eos drops EOS, not the request's own stop ids
    assert s.top_logprobs == 0


def test_top_logprobs_reach_the_engine(client, fake) -> None:
    chat = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 4}
    assert client.post(CH, json=chat).status_code == 200
    assert fake.requests[-1][2].top_logprobs == 4
    r = client.post(CH, json={**chat, "logprobs": False, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert fake.requests[-1][2].top_logprobs == 0
    assert client.post(C, json={"model": MODEL, "prompt": "x", "logprobs": 3}).status_code == 200
    assert fake.requests[-1][2].top_logprobs == 3


def test_ignore_eos_and_max_completion_tokens(client, fake) -> None:
    body = {"model": MODEL, "messages": USER, "ignore_eos": True, "max_completion_tokens": 40}
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 40
    assert r.json()["choices"][0]["message"]["content"].startswith(DEFAULT_REPLY + "Hello")
    s = fake.requests[-1][2]
    assert s.ignore_eos and s.stop_token_ids == [] and s.max_new_tokens == 40
