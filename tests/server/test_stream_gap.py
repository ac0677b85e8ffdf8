"""A running stream keeps flowing while 4 MB request bodies arrive back to back, on each endpoint
that builds a chat job (chat completions, Responses, Anthropic's Messages): their parsing,
translation, chat template and length check run off the event loop (``server.offload``) and a
prompt far over the context is refused from its byte length before it is tokenized
(``server.prompt_bound``).

The served app is the real one (guard included, 4 MiB body limit) on a live uvicorn server; the
engine is the fake one, paced at one token per 20 ms. The bound on the largest gap is generous
for a busy 2-core machine (the issue's goal is 250 ms; ``bench/stream_gap.py`` measures the
precise figure against its baseline); the figure is printed (``pytest -s``)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.routes import create_app
from tests.http_api import CH, MODEL, USER, WAIT_S, served
from tests.messages_api import check_anthropic_error

NUM_BODIES = 4
GENEROUS_GAP_S = 1.0
CONTEXT_LEN = 4096  # room for a stream of ~80 s at most (it is ended once the bodies are in)


@pytest.fixture
def paced_server(tokenizer):
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id, reply="tick " * 50,
                            tokens_per_event=1, delay_s=0.02)
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])
    install_guard(app, None, 4 * 2**20)
    with served(app) as url:
        yield url


TEXT = "The quick brown fox jumps over the lazy dog. " * 88_000  # 3.96 MB


def test_a_stream_flows_while_4mb_chat_bodies_arrive(paced_server) -> None:
    big = (CH, {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]})
    codes = _largest_gap_while_posting(paced_server, [big] * NUM_BODIES)
    assert all(code == 400 for code, _ in codes), codes  # refused by length, nothing else


def test_a_stream_flows_while_4mb_responses_and_messages_bodies_arrive(paced_server) -> None:
    responses = ("/v1/responses", {"model": MODEL, "input": TEXT})
    messages = ("/v1/messages", {"model": MODEL, "max_tokens": 16,
                                 "messages": [{"role": "user", "content": TEXT}]})
    bodies = [responses, messages] * (NUM_BODIES // 2)
    codes = _largest_gap_while_posting(paced_server, bodies)
    # Refused by length, nothing else, each in its API's error shape.
    assert all(code == 400 for code, _ in codes), codes
    for (_, body), (_, text) in zip(bodies, codes, strict=True):
        if "max_tokens" in body:
            assert "context" in check_anthropic_error(400, text)["message"], text
        else:
            assert json.loads(text)["error"]["param"] == "input", text


def _largest_gap_while_posting(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, str]]:
    """Post ``bodies`` (path, JSON) one after the other while a chat stream runs, and check
    the stream's largest gap between chunks meanwhile; returns each post's status and body."""
    arrivals: list[float] = []
    first_chunk, bodies_done = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "messages": USER, "stream": True, "ignore_eos": True,
                "max_tokens": CONTEXT_LEN - 64}
        with httpx.stream("POST", url + CH, json=body, timeout=WAIT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    first_chunk.set()
                if bodies_done.is_set():
                    return  # closing the connection aborts the request

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert first_chunk.wait(WAIT_S), "the stream never started"
    codes = []
    with httpx.Client(timeout=WAIT_S) as client:
        started = time.monotonic()
        for path, big in bodies:
            r = client.post(url + path, json=big)
            codes.append((r.status_code, r.text))
        ended = time.monotonic()
    bodies_done.set()
    streamer.join(WAIT_S)
    assert not streamer.is_alive()
    during = [t for t in arrivals if started <= t <= ended]
    window = [arrivals[arrivals.index(during[0]) - 1], *during] if during else []
    gaps = [b - a for a, b in itertools.pairwise(window)]
    # The stream ran all along: chunks arrived throughout the bodies' upload and refusal.
    assert len(gaps) >= 3 and arrivals[-1] >= ended - GENEROUS_GAP_S, (len(gaps), codes)
    largest = max(gaps + [ended - during[-1]])
    print(f"\n{len(bodies)} bodies of {len(TEXT) / 1e6:.2f} MB ({sorted({p for p, _ in bodies})}) "
          f"in {ended - started:.2f}s; {len(during)} chunks meanwhile, largest gap "
          f"{largest * 1000:.0f} ms")
    assert largest < GENEROUS_GAP_S
    return codes
