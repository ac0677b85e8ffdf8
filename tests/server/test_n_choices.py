"""``n`` > 1 through the HTTP API against the fake engine: the choices' indexes (one prompt and
several), their seeds, usage (the prompt once, completions summed), the streamed interleaving
(every chunk's index, one finish per choice, one usage chunk), the lead-first order and shared
affinity that let the workers compute the prompt once, aborts of every sibling, and the 400s."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from splitserve.server.choices import choice_seed
from splitserve.server.engine_client import TokenEvent
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events

MODEL = "smol-test"
USER = [{"role": "user", "content": "Say hi"}]
CH, C = "/v1/chat/completions", "/v1/completions"
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def by_seed(sampling) -> str:
    """A reply that tells seeds apart (unseeded requests all get the same one)."""
    seed = sampling.seed
    return "no seed here" if seed is None else f"{WORDS[seed % 8]} {WORDS[(seed // 8) % 8]}"


@pytest.fixture
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply_for=by_seed)


@pytest.fixture
def client(fake, tokenizer) -> TestClient:
    return TestClient(create_app(fake, tokenizer, MODEL, 256, [tokenizer.eos_token_id]))


def _post(client: TestClient, path: str, **body) -> dict:
    base = {"model": MODEL, **({"messages": USER} if path == CH else {"prompt": "hi"})}
    r = client.post(path, json={**base, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _text(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_choice_seeds_are_derived_and_choice_0_keeps_the_seed() -> None:
    seeds = [choice_seed(42, i) for i in range(16)]
    assert seeds[0] == 42 and len(set(seeds)) == 16
    assert all(0 <= s < 2**63 for s in seeds[1:])
    assert seeds == [choice_seed(42, i) for i in range(16)]  # deterministic
    assert choice_seed(43, 1) not in seeds  # not seed + i: neighbouring seeds share nothing
    assert choice_seed(None, 3) is None
    assert choice_seed(-(2**63), 5) >= 0 and choice_seed(2**63 - 1, 0) == 2**63 - 1


@pytest.mark.parametrize("path", [CH, C])
def test_n_choices_shape_seeds_and_usage(client, fake, tokenizer, path) -> None:
    single = _post(client, path, seed=7)
    fake.requests.clear()
    fake.affinities.clear()
    body = _post(client, path, n=4, seed=7)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # Each choice is the fake's reply for its own seed; choice 0 is the n=1 sample.
    sent = {rid: s.seed for rid, _, s in fake.requests}
    assert sorted(sent.values()) == sorted(choice_seed(7, i) for i in range(4))
    assert _text(choices[0]) == _text(single["choices"][0])
    assert len({_text(c) for c in choices}) == 4
    for c in choices:
        assert c["finish_reason"] == "stop"
    # The prompt counted once, every choice's tokens summed.
    prompt_tokens = single["usage"]["prompt_tokens"]
    completion = sum(len(tokenizer.encode(_text(c), add_special_tokens=False)) + 1
                     for c in choices)  # + EOS per choice
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion
    assert body["usage"]["total_tokens"] == prompt_tokens + completion
    # The lead went first, all four share one affinity, rids are distinct.
    assert fake.requests[0][0].endswith("-0") and len(sent) == 4
    assert len({id(a) for a in fake.affinities}) == 1 and fake.affinities[0] is not None


def test_same_request_same_choices_and_unseeded_differ_in_seed(client, fake) -> None:
    a = _post(client, CH, n=3, seed=11)
    b = _post(client, CH, n=3, seed=11)
    assert [_text(c) for c in a["choices"]] == [_text(c) for c in b["choices"]]
    fake.requests.clear()
    _post(client, CH, n=3)
    assert [s.seed for _, _, s in fake.requests] == [None, None, None]


def test_several_prompts_times_n_in_openai_order(client, fake) -> None:
    body = _post(client, C, prompt=["first prompt", "second prompt"], n=2, echo=True, seed=3, ignore_eos=True,
                 max_tokens=4)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"].startswith(p) for c, p in zip(
        choices, ["first prompt", "first prompt", "second prompt", "second prompt"])] == [True] * 4
    # Each prompt counted once.
    per_prompt = [_post(client, C, prompt=p, max_tokens=4)["usage"]["prompt_tokens"]
                  for p in ("first prompt", "second prompt")]
    assert body["usage"]["prompt_tokens"] == sum(per_prompt)
    assert body["usage"]["completion_tokens"] == 4 * 4


def test_greedy_choices_are_equal_requests(client, fake) -> None:
    fake.requests.clear()
    body = _post(client, CH, n=3, temperature=0)
    assert len({_text(c) for c in body["choices"]}) == 1
    assert all(s.temperature == 0 for _, _, s in fake.requests)


def _events(r) -> list[dict]:
    return [e for e in iter_events(r.text.splitlines()) if isinstance(e, dict)]


@pytest.mark.parametrize("path", [CH, C])
def test_streamed_choices_interleave_with_their_indexes(client, fake, path) -> None:
    whole = _post(client, path, n=3, seed=5)
    base = {"model": MODEL, **({"messages": USER} if path == CH else {"prompt": "hi"})}
    r = client.post(path, json={**base, "n": 3, "seed": 5, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = _events(r)
    usage = [e for e in events if e.get("usage")]
    assert len(usage) == 1 and usage[0] is events[-1] and events[-1]["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached: 2nd time
        assert usage[0]["usage"][key] == whole["usage"][key]
    chunks = [e for e in events if e["choices"]]
    assert all(len(e["choices"]) == 1 and e["id"] == chunks[0]["id"] for e in chunks)
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for e in chunks:
        c = e["choices"][0]
        piece = (c["delta"].get("content") or "") if path == CH else c["text"]
        text[c["index"]] = text.get(c["index"], "") + piece
        if c["finish_reason"]:
            finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert sorted(text) == [0, 1, 2]
    assert [text[i] for i in range(3)] == [_text(c) for c in whole["choices"]]
    assert finishes == {i: ["stop"] for i in range(3)}
    if path == CH:  # each choice opens with its own role chunk
        roles = [e["choices"][0]["index"] for e in chunks if "role" in e["choices"][0]["delta"]]
        assert sorted(roles) == [0, 1, 2]


def test_streamed_choices_really_interleave(tokenizer) -> None:
    # Slow events: the siblings start while the lead still streams, so their chunks mix.
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply_for=by_seed,
                            tokens_per_event=1, delay_s=0.01)
    client = TestClient(create_app(fake, tokenizer, MODEL, 256, [tokenizer.eos_token_id]))
    r = client.post(C, json={"model": MODEL, "prompt": "hi", "n": 3, "seed": 1, "stream": True,
                             "ignore_eos": True, "max_tokens": 12})
    order = [e["choices"][0]["index"] for e in _events(r)]
    first_of = {i: order.index(i) for i in range(3)}
    last_of = {i: len(order) - 1 - order[::-1].index(i) for i in range(3)}
    assert first_of[1] < last_of[0] and first_of[2] < last_of[0], order


def test_tool_calls_parsed_per_choice(tokenizer) -> None:
    def reply(sampling) -> str:
        city = WORDS[sampling.seed % 8] if sampling.seed is not None else "x"
        return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'

    from splitserve.server.chat_template import ChatRenderer

    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply_for=reply)
    app = create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id],
                     ChatRenderer(tokenizer, tool_call_parser="hermes"))
    client = TestClient(app)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = _post(client, CH, n=3, seed=2, tools=[weather], tool_choice="required")
    cities = []
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        cities.append(json.loads(call["function"]["arguments"])["city"])
    assert cities == [WORDS[choice_seed(2, i) % 8] for i in range(3)]
    # Every choice carries the call grammar.
    assert all(s.constraint is not None for _, _, s in fake.requests[-3:])


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2.5}, "n"), ({"best_of": 2}, "best_of"),
])
@pytest.mark.parametrize("path", [CH, C])
def test_bad_n_and_best_of_are_400s(client, path, body, param) -> None:
    base = {"model": MODEL, **({"messages": USER} if path == CH else {"prompt": "hi"})}
    r = client.post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_n_16_is_accepted(client) -> None:
    assert len(_post(client, C, n=16, max_tokens=2)["choices"]) == 16


class _LeadFails(FakeEngineClient):
    """Every choice sends its first event; then the lead (rid ``...-0``) fails while its
    siblings wait for more (like decode steps in flight). The lead fails only once both
    siblings' first events were taken by the server (an event, not a sleep)."""

    num_siblings = 2
    _siblings_started: asyncio.Event | None = None
    _num_started = 0

    async def generate(self, rid, input_ids, sampling, cache_namespace=None, affinity=None,
                       **observed):
        inner = super().generate(rid, input_ids, sampling, cache_namespace, affinity)
        if self._siblings_started is None:  # made on the server's event loop
            self._siblings_started = asyncio.Event()
        try:
            yield await anext(inner)
            if rid.endswith("-0"):
                await asyncio.wait_for(self._siblings_started.wait(), 60)
                yield TokenEvent([], [], error="decode worker died", error_code=500)
                return
            self._num_started += 1  # the server asked for this choice's next event
            if self._num_started == self.num_siblings:
                self._siblings_started.set()
            await asyncio.Event().wait()  # until the server closes this stream
        finally:
            await inner.aclose()  # the fake records the abort of an unfinished request


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_in_one_choice_aborts_every_sibling(tokenizer, stream) -> None:
    fake = _LeadFails(tokenizer, eos_token_id=tokenizer.eos_token_id, tokens_per_event=1)
    client = TestClient(create_app(fake, tokenizer, MODEL, 256, [tokenizer.eos_token_id]))
    r = client.post(CH, json={"model": MODEL, "messages": USER, "n": 3, "seed": 1,
                              "ignore_eos": True, "max_tokens": 50, "stream": stream})
    if stream:
        events = list(iter_events(r.text.splitlines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "decode worker died"
    else:
        assert r.status_code == 500 and r.json()["error"]["message"] == "decode worker died"
    started = {rid for rid, _, _ in fake.requests}
    assert len(started) == 3
    assert fake.wait_until(lambda: started <= fake.aborted, 10), (started, fake.aborted)
    assert not started & fake.finished


def test_client_disconnect_aborts_every_choice(live_server, fake) -> None:
    fake.stall_after_events = 1  # each choice sends one event, then waits to be aborted
    req = {"model": MODEL, "prompt": "hi", "n": 3, "ignore_eos": True, "max_tokens": 200,
           "stream": True}
    with (
        httpx.Client(base_url=live_server, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=req) as r,
    ):
        assert next(r.iter_lines()).startswith("data: ")
        assert fake.wait_until(lambda: len(fake.requests) == 3, 30), "the siblings never started"
    started = {rid for rid, _, _ in fake.requests}
    assert fake.wait_until(lambda: started <= fake.aborted, 30), (started, fake.aborted)
    assert not started & fake.finished


def test_openai_client_n(live_server, fake) -> None:
    import openai

    api = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    chat = api.chat.completions.create(model=MODEL, messages=USER, n=3, seed=9, max_tokens=20)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3
    stream = api.chat.completions.create(model=MODEL, messages=USER, n=3, seed=9, max_tokens=20,
                                         stream=True, stream_options={"include_usage": True})
    text = ["", "", ""]
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert text == [c.message.content for c in chat.choices]
    assert usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=USER, n=17)
    assert info.value.body["param"] == "n"


def test_only_the_lead_scores_an_echoed_prompt(client, fake) -> None:
    fake.requests.clear()
    body = _post(client, C, prompt="Once upon a time", echo=True, logprobs=1, n=3, max_tokens=3)
    assert [s.logprob_start_len for _, _, s in fake.requests] == [0, -1, -1]
    lps = [c["logprobs"] for c in body["choices"]]
    n_prompt = len(lps[0]["tokens"]) - 3
    assert all(lp["tokens"][:n_prompt] == lps[0]["tokens"][:n_prompt] for lp in lps)
