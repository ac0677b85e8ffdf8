"""OpenAI-style HTTP calls shared by both backends: JSON and SSE posts with errors that name the
server and what it said."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from splitserve.lang.backend import GenOutput, SamplingArgs
from splitserve.lang.errors import BackendError
from splitserve.server.sse import DONE, iter_events


class OpenAIHTTP:
    """A thread-safe connection pool to one OpenAI-compatible base URL (``.../v1``).
    ``headers``: sent with every request instead of ``Authorization: Bearer <api_key>`` (an
    Anthropic-compatible server's ``x-api-key`` and ``anthropic-version``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 256, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if headers is None:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
        )

    def _url(self, path: str) -> str:
        return self.base_url + path

    def get_url(self, url: str) -> httpx.Response:
        """GET an absolute URL (e.g. a server route outside ``/v1``)."""
        try:
            return self.client.get(url)
        except httpx.HTTPError as exc:
            raise BackendError(f"server at {self.base_url} is unreachable: {exc}") from exc

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON and return the JSON answer.

        Raises:
            BackendError: no connection, or a non-200 answer (its error message included).
        """
        try:
            r = self.client.post(self._url(path), json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"server at {self.base_url} is unreachable: {exc}") from exc
        if r.status_code != 200:
            raise BackendError(f"POST {path} -> HTTP {r.status_code}: {_error_message(r.text)}",
                               status_code=r.status_code)
        return r.json()

    def post_sse(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with ``stream: true`` and yield each SSE ``data`` object until ``[DONE]``."""
        try:
            with self.client.stream("POST", self._url(path), json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    text = r.read().decode(errors="replace")
                    raise BackendError(f"POST {path} -> HTTP {r.status_code}: "
                                       f"{_error_message(text)}", status_code=r.status_code)
                for event in iter_events(r.iter_lines()):
                    if event == DONE:
                        return
                    if "error" in event:  # an error after the stream started
                        raise BackendError(f"POST {path} stream: {_error_message(event)}")
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"server at {self.base_url} failed mid-stream: {exc}") from exc

    def close(self) -> None:
        self.client.close()


def _error_message(body: str | dict[str, Any]) -> str:
    """The message of an OpenAI error body (JSON text or decoded), else the text's start."""
    try:
        err = (json.loads(body) if isinstance(body, str) else body)["error"]
        return err["message"] if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return str(body)[:500]


def sampling_fields(sampling: SamplingArgs) -> dict[str, Any]:
    """The OpenAI body fields of ``sampling`` (unset ones left to the server)."""
    body: dict[str, Any] = {"max_tokens": sampling.max_tokens}
    for key in ("stop", "temperature", "top_p", "seed"):
        value = getattr(sampling, key)
        if value is not None:
            body[key] = value
    return body


def usage_meta(body: dict[str, Any]) -> dict[str, Any]:
    """``prompt_tokens``, ``completion_tokens`` and ``cached_tokens`` of a response body."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0) or 0,
    }


def completion_output(body: dict[str, Any], is_chat: bool) -> GenOutput:
    choice = body["choices"][0]
    text = choice["message"]["content"] if is_chat else choice["text"]
    return GenOutput(text or "", {"finish_reason": choice.get("finish_reason"),
                                  **usage_meta(body)})


def stream_deltas(events: Iterator[dict[str, Any]], is_chat: bool) -> Iterator[str | GenOutput]:
    """Text deltas of a streamed completion, then the :class:`GenOutput` of all of it."""
    parts: list[str] = []
    meta: dict[str, Any] = {}
    for ev in events:
        if ev.get("usage"):
            meta.update(usage_meta(ev))
        for choice in ev.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
            if delta:
                parts.append(delta)
                yield delta
            if choice.get("finish_reason"):
                meta["finish_reason"] = choice["finish_reason"]
    yield GenOutput("".join(parts), meta)
