"""A small real HTTP server speaking a scripted slice of the OpenAI API, for testing what the
DSL's backends send and how they read the answers, whatever the state of the model server."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A JSON body (HTTP 200), or (status, JSON body).
Responder = Callable[[str, dict[str, Any]], dict[str, Any] | tuple[int, dict[str, Any]]]


class FakeOpenAIServer:
    """Answers ``POST`` with ``respond(path, body)`` (a JSON body, HTTP 200, as one SSE delta
    when the request streams; or ``(status, body)``, sent as it is) and ``GET
    /chat_template`` with ``template``; records every request as ``(path, body)``."""

    def __init__(self, respond: Responder, template: str | None = None) -> None:
        self.respond, self.template = respond, template
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def bodies(self, path: str) -> list[dict[str, Any]]:
        """The bodies posted to ``path``, in order."""
        with self.lock:
            return [b for p, b in self.requests if p == path]


def _handler(server: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/chat_template" and server.template is not None:
                self._send(200, {"chat_template": server.template})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with server.lock:
                server.requests.append((self.path, body))
            answer = server.respond(self.path, body)
            if isinstance(answer, tuple):
                self._send(*answer)
            elif body.get("stream"):
                self._send_events(_as_events(answer))
            else:
                self._send(200, answer)

        def _send_events(self, events: list[dict[str, Any]]) -> None:
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data.encode())))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *_: Any) -> None:
            pass

    return Handler


def _as_events(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed answer as OpenAI's stream: one delta, then the usage."""
    choice = answer["choices"][0]
    if "message" in choice:
        delta = {"index": 0, "delta": {"content": choice["message"]["content"] or ""},
                 "finish_reason": choice["finish_reason"]}
    else:
        delta = {"index": 0, "text": choice["text"], "finish_reason": choice["finish_reason"]}
    return [{"choices": [delta]}, {"choices": [], "usage": answer["usage"]}]


@contextmanager
def fake_openai_server(respond: Responder, template: str | None = None
                       ) -> Iterator[FakeOpenAIServer]:
    """Serve on a free loopback port for the ``with`` block."""
    server = FakeOpenAIServer(respond, template)
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def chat_answer(content: str | None, tool_calls: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """A ``/v1/chat/completions`` answer."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def completion_answer(text: str) -> dict[str, Any]:
    """A ``/v1/completions`` answer."""
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
