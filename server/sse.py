"""Server-sent events as the OpenAI API streams them: one JSON object per event, ``[DONE]`` last.

Both directions of the wire format live here: the server encodes its chunks with
:func:`encode_event`; clients (``splitserve.lang``, the tests, ``bench/``) read a stream with
:func:`iter_events` or :func:`aiter_events`. Only the standard library is imported, so a client
importing this does not pull in FastAPI. Decoding follows the WHATWG ``text/event-stream`` rules
for the ``data`` field (https://html.spec.whatwg.org/multipage/server-sent-events.html).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from json.encoder import encode_basestring
from typing import Any

DONE = "[DONE]"  # the data of the last event of an OpenAI stream (not JSON)
DONE_EVENT = f"data: {DONE}\n\n"


def encode_event(body: dict[str, Any]) -> str:
    """One event carrying ``body`` as compact JSON (non-ASCII text kept as is)."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventTemplate:
    """The events of bodies that differ in one string only (the text of streamed chunks): the
    body is encoded once with :attr:`MARK` where that string goes, and each event is the string's
    JSON put in its place, the same text :func:`encode_event` makes of the whole body.

    Raises:
        ValueError: ``body`` does not hold :attr:`MARK` exactly once.
    """

    MARK = "\x00\x00"

    def __init__(self, body: dict[str, Any]) -> None:
        # encode_basestring is the string encoder json.dumps uses with ensure_ascii=False.
        parts = encode_event(body).split(encode_basestring(self.MARK))
        if len(parts) != 2:
            raise ValueError("the body must hold EventTemplate.MARK exactly once")
        self.head, self.tail = parts

    def event(self, text: str) -> str:
        """``encode_event`` of the body with ``text`` in place of the mark."""
        return self.head + encode_basestring(text) + self.tail


class SSEDecoder:
    """Turns the lines of a stream (without their line ends) into the payloads of its events.

    A ``data:`` line adds to the current event (one space after the colon is dropped; several
    lines are joined by newlines); a blank line ends the event; comments (``:...``) and other
    fields (``event``, ``id``, ``retry``) are skipped. A payload is :data:`DONE` for the end
    marker, else the decoded JSON.

    Raises:
        json.JSONDecodeError: an event's data is neither ``[DONE]`` nor JSON.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Any | None:
        """The payload of the event that ``line`` ends, else None."""
        if not line:
            return self.end()
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def end(self) -> Any | None:
        """The payload of an event still open (a stream cut before its blank line), else None."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return DONE if data == DONE else json.loads(data)


def iter_events(lines: Iterable[str]) -> Iterator[Any]:
    """The payloads of the events in ``lines`` (e.g. ``httpx.Response.iter_lines()``), in order,
    :data:`DONE` included; see :class:`SSEDecoder`."""
    decoder = SSEDecoder()
    for line in lines:
        payload = decoder.feed(line)
        if payload is not None:
            yield payload
    payload = decoder.end()
    if payload is not None:
        yield payload


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[Any]:
    """:func:`iter_events` for an async stream of lines (``httpx.Response.aiter_lines()``)."""
    decoder = SSEDecoder()
    async for line in lines:
        payload = decoder.feed(line)
        if payload is not None:
            yield payload
    payload = decoder.end()
    if payload is not None:
        yield payload
