"""The ``openai`` client against launched clusters: chat and completion, streaming and not, stop
strings, usage; bad input gets a 400 and the server keeps serving; no page leaks afterwards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import flush_cache, worker_pages_used


@pytest.fixture
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.config.url + "/v1", api_key="none", max_retries=0)


def test_models(client) -> None:
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"


def test_chat_non_streaming(client, tokenizer) -> None:
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in text
    assert r.usage.completion_tokens == len(tokenizer.encode(text, add_special_tokens=False)) or (
        r.usage.completion_tokens > 0
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client) -> None:
    kw = {"model": "default", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_chat_streaming(client) -> None:
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
        temperature=0, stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas)


def test_stop_string(client) -> None:
    kw = {"model": "default", "prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 20, "temperature": 0}
    free = client.completions.create(**kw).choices[0].text
    assert " 7," in free, free  # the model continues the count; the stop below must cut it
    r = client.completions.create(stop=[" 7"], **kw)
    assert r.choices[0].text == free[: free.index(" 7")]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=" 7", **kw))
    assert streamed == r.choices[0].text


def test_seeded_sampling_is_reproducible(client) -> None:
    kw = {"model": "default", "prompt": "My favourite food is", "max_tokens": 16, "temperature": 0.9, "seed": 7}
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi"}, "model"),
        ({"model": "default"}, "prompt"),
        ({"model": "default", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": "default", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"model": "default", "prompt": "hi " * 9000}, "prompt"),
        ({"model": "default", "prompt": "hi", "temperature": 5}, "temperature"),
    ],
)
def test_bad_input_is_400_and_server_keeps_serving(cluster, body, param) -> None:
    r = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert param in err["message"] or err.get("param") == param
    ok = httpx.post(cluster.config.url + "/v1/completions",
                    json={"model": "default", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_abandoned_stream_frees_pages(cluster) -> None:
    with httpx.stream("POST", cluster.config.url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": "Tell me a long story.", "max_tokens": 400,
        "ignore_eos": True, "stream": True,
    }) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # hang up mid-stream
    wait_for_no_pages(cluster)


def test_no_pages_in_use_after_requests(cluster) -> None:
    wait_for_no_pages(cluster)
    assert all(row["pages_used"] == 0 for row in flush_cache(cluster))


def wait_for_no_pages(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        used = worker_pages_used(cluster)
        if all(v == 0 for v in used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(v == 0 for v in used.values()), used
