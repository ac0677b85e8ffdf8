"""``n`` > 1 on launched clusters of the default model: seeded samples equal colocated and
disaggregated (and not all equal), choice 0 equal to the ``n: 1`` sample, greedy choices equal
to the ``n: 1`` greedy output, a stream reassembled per index equal to the full answer, the
``openai`` client's own ``n``, constrained choices (``response_format``, tools) each valid under
``jsonschema``, the prompt computed once (the prompt worker's cache counters), and every page
back on every worker after the requests and after a client leaves mid-stream."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import flush_cache
from tests.e2e.test_openai_api import wait_for_no_pages

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Write one short sentence about the sea."}]
# Long enough that the shared part of the prompt (its full pages) is most of it.
LONG_ASK = [{"role": "user", "content": "Here is a list of colours: " + ", ".join(
    ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"] * 8)
    + ". Name your favourite one."}]
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": 10, "return_token_ids": True}


def _chat(cluster, **body) -> dict:
    r = httpx.post(cluster.config.url + "/v1/chat/completions",
                   json={"model": "default", "messages": ASK, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(body: dict) -> list[list[int]]:
    return [c["token_ids"] for c in body["choices"]]


def test_seeded_n4_equal_colocated_and_disaggregated(disagg_cluster, colocated_cluster) -> None:
    got = [_chat(c, n=4, **SEEDED) for c in (disagg_cluster, colocated_cluster)]
    for body in got:
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"]["completion_tokens"] == sum(len(i) for i in _ids(body))
    assert _ids(got[0]) == _ids(got[1])
    assert len({tuple(i) for i in _ids(got[0])}) > 1, "4 seeded samples all equal"
    # Choice 0 is the n=1 sample with the same seed (server.choices.choice_seed).
    single = _chat(disagg_cluster, **SEEDED)
    assert _ids(single)[0] == _ids(got[0])[0]
    assert got[0]["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    for c in (disagg_cluster, colocated_cluster):
        wait_for_no_pages(c)


def test_greedy_n3_equals_n1(cluster) -> None:
    greedy = {"temperature": 0, "max_tokens": 10, "return_token_ids": True}
    one = _ids(_chat(cluster, **greedy))[0]
    assert _ids(_chat(cluster, n=3, **greedy)) == [one] * 3
    wait_for_no_pages(cluster)


def _prompt_worker(rows: list[dict]) -> dict:
    (row,) = [r for r in rows if r["role"] in ("prefill", "colocated")]
    return row


def test_prompt_computed_once(cluster) -> None:
    page_size = cluster.config.engine.page_size
    # A request decoding meanwhile keeps the worker stepping (colocated), so the n tasks all
    # arrive during one step and would all be admitted, uncached, in the next, were the
    # siblings not held back until the lead's prompt is in the cache (server.choices).
    background = {"model": "default", "prompt": "Count from one to a thousand:", "stream": True,
                  "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", cluster.config.url + "/v1/completions", json=background,
                      timeout=300) as bg:
        lines = bg.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        before = _prompt_worker(flush_cache(cluster))
        body = _chat(cluster, messages=LONG_ASK, n=4, **SEEDED)
        rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
        # Still decoding: the n tasks met a busy worker.
        assert next(line for line in lines if line.startswith("data: {"))
    after = _prompt_worker(rows)
    prompt_len = body["usage"]["prompt_tokens"]
    assert prompt_len > 4 * page_size
    admitted = after["cache_prompt_tokens"] - before["cache_prompt_tokens"]
    hit = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    assert admitted == 4 * prompt_len
    # The lead computes the prompt; each sibling is served every full page of it but the one
    # holding the last token (whose logits it samples from), and computes the rest.
    shared = (prompt_len - 1) // page_size * page_size
    assert hit == 3 * shared, (hit, shared, prompt_len)
    computed = admitted - hit
    assert computed < prompt_len + 3 * page_size  # vs 4 * prompt_len with no sharing
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the lead's, after flush
    wait_for_no_pages(cluster)


def test_streamed_n3_equals_full(disagg_cluster) -> None:
    body = {"model": "default", "messages": ASK, "n": 3, "temperature": 1.0, "seed": 99,
            "max_tokens": 10}
    full = _chat(disagg_cluster, **{k: v for k, v in body.items() if k not in ("model",
                                                                                 "messages")})
    text, finishes, usage = ["", "", ""], [[], [], []], []
    with httpx.stream("POST", disagg_cluster.config.url + "/v1/chat/completions", timeout=300,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}
                      ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage.append(chunk["usage"])
            for c in chunk["choices"]:
                text[c["index"]] += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    finishes[c["index"]].append(c["finish_reason"])
    assert text == [c["message"]["content"] for c in full["choices"]]
    assert finishes == [[c["finish_reason"]] for c in full["choices"]]
    assert len(usage) == 1
    assert usage[0]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert usage[0]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    wait_for_no_pages(disagg_cluster)


def test_openai_client_n(disagg_cluster) -> None:
    client = openai.OpenAI(base_url=disagg_cluster.config.url + "/v1", api_key="none",
                           max_retries=0, timeout=300)
    r = client.chat.completions.create(model="default", messages=ASK, n=3, seed=5,
                                       temperature=1.0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content for c in r.choices)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=ASK, n=17)
    assert info.value.body["param"] == "n"


SCHEMA = {"type": "object", "properties": {
    "colour": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "count"], "additionalProperties": False}
PICK = {"type": "function", "function": {
    "name": "pick_colour", "description": "Pick a colour and a count.", "parameters": SCHEMA}}


def test_constrained_choices_each_validate(cluster) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA,
                                                  "strict": True}}
    body = _chat(cluster, messages=LONG_ASK, n=3, temperature=1.0, seed=3, max_tokens=40,
                 response_format=fmt)
    for c in body["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    body = _chat(cluster, messages=LONG_ASK, n=3, temperature=1.0, seed=3, max_tokens=60,
                 tools=[PICK], tool_choice="required", parallel_tool_calls=False)
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "pick_colour"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    wait_for_no_pages(cluster)


def test_echoed_prompt_logprobs_shared_by_every_choice(cluster) -> None:
    body = {"model": "default", "prompt": "The capital of France is", "echo": True, "logprobs": 2,
            "max_tokens": 3, "temperature": 1.0, "seed": 8}
    one = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=300).json()
    r = httpx.post(cluster.config.url + "/v1/completions", json={**body, "n": 3}, timeout=300)
    assert r.status_code == 200, r.text
    n_prompt = one["usage"]["prompt_tokens"]
    want = one["choices"][0]["logprobs"]
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        assert lp["tokens"][:n_prompt] == want["tokens"][:n_prompt]
        assert lp["token_logprobs"][0] is None  # nothing predicts the first token
        assert lp["token_logprobs"][1:n_prompt] == pytest.approx(
            want["token_logprobs"][1:n_prompt], abs=1e-4)
        assert lp["top_logprobs"][1:n_prompt] and len(lp["top_logprobs"]) == len(lp["tokens"])
    assert r.json()["choices"][0]["text"] == one["choices"][0]["text"]  # the n=1 sample
    wait_for_no_pages(cluster)


def test_client_leaving_mid_stream_frees_every_choice(cluster) -> None:
    body = {"model": "default", "messages": LONG_ASK, "n": 3, "seed": 1, "temperature": 1.0,
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    seen: set[int] = set()
    with httpx.stream("POST", cluster.config.url + "/v1/chat/completions", json=body,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):  # a choice with content has started on the engine
                seen.update(c["index"] for c in json.loads(line[6:])["choices"]
                            if c["delta"].get("content"))
            if len(seen) == 3:
                break  # every choice is decoding: leave now
    assert seen == {0, 1, 2}
    wait_for_no_pages(cluster, timeout_s=30)
