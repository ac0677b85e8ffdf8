"""The SSE wire format (``server.sse``): what the server encodes, the one decoder reads back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from splitserve.server.formatter import ResponseFormatter
from splitserve.server.sse import (
    DONE,
    DONE_EVENT,
    EventTemplate,
    aiter_events,
    encode_event,
    iter_events,
)


def test_encoded_events_decode_back() -> None:
    bodies = [{"text": "héllo 世界 🚀", "n": [1, 2]}, {"choices": [], "usage": None}]
    stream = "".join(encode_event(b) for b in bodies) + DONE_EVENT
    assert stream.startswith('data: {"text":"héllo 世界 🚀","n":[1,2]}\n\n')
    assert list(iter_events(stream.splitlines())) == [*bodies, DONE]


def test_decoder_follows_the_event_stream_rules() -> None:
    lines = [
        ": a comment",
        "event: chunk",
        'data: {"a":',
        "data:1}",  # no space after the colon; joined to the line above by a newline
        "",
        "id: 7",
        "",  # an event without data is no event
        "data: [DONE]",  # the stream ends without its blank line
    ]
    assert list(iter_events(lines)) == [{"a": 1}, DONE]


def test_async_decoder() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in (encode_event({"x": 1}) + DONE_EVENT).splitlines():
            yield line

    async def collect() -> list:
        return [e async for e in aiter_events(lines())]

    assert asyncio.run(collect()) == [{"x": 1}, DONE]


def test_importing_the_codec_pulls_in_no_web_framework() -> None:
    # splitserve.lang imports it: a client of the API must not need the server's dependencies.
    code = ("import sys, splitserve.server.sse, splitserve.lang; "
            "print([m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


TRICKY = ["", "plain", 'quo"te \\ back/slash', "tab\tnew\nline\r\x00\x1f\x7f", "héllo 世界 🚀",
          "\u2028\u2029", "\ud800 lone surrogate", EventTemplate.MARK]


def test_event_template_is_encode_event() -> None:
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": EventTemplate.MARK}], "usage": None}
    template = EventTemplate(body)
    for text in TRICKY:
        assert template.event(text) == encode_event(
            {**body, "choices": [{"index": 0, "text": text}]})
    for bad in ({"text": "no mark"}, {"a": EventTemplate.MARK, "b": EventTemplate.MARK}):
        with pytest.raises(ValueError):
            EventTemplate(bad)


@pytest.mark.parametrize("is_chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_text_events_are_the_encoded_chunks(is_chat: bool, include_usage: bool) -> None:
    fmt = ResponseFormatter("chatcmpl-7", 1700000000, "SmolLM2", is_chat, include_usage)
    for index in (0, 3, 0):
        for text in TRICKY:
            assert fmt.text_event(text, index) == encode_event(fmt.chunk(text, index=index))
