"""Noticing a client that left, before its response starts and while it streams, so that its
request is aborted on the workers at once instead of running to the end for nobody.

Both paths end the same way: the work is cancelled or the SSE body closed, and the generator's
``finally`` (``server.generation.stream_text``) aborts the request, freeing its KV pages.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from splitserve.server.generation import aclose

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that closed the connection first


def client_gone() -> Response:
    """The answer to a client that already left. Nobody reads it; its status, 499 as nginx
    logs it, marks the request in access logs."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> Any | None:
    """``work()``'s result, or None when the client disconnects first.

    Until a response starts, Starlette does not watch the connection: a non-streaming request,
    or a streaming one still waiting for its first token (a long prefill, a queue), would run to
    the end for nobody. Here the disconnect cancels ``work``. The body has been read by now, so
    the next ASGI message is ``http.disconnect``.

    Raises:
        Exception: whatever ``work`` raised, as raised (not wrapped in an exception group).
    """
    outcome: dict[str, Any] = {}

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome["result"] = await work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            outcome["error"] = exc
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that notices a client going away and then closes its body.

    Starlette listens for ``http.disconnect`` only under ASGI spec < 2.4 (uvicorn's HTTP is 2.3
    today); under 2.4 it would notice only at the next failing send, i.e. not while the engine
    is between tokens. And when the disconnect lands while the body waits at a ``yield``,
    Starlette leaves the body suspended until garbage collection; here it is closed at once.
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await aclose(self.body_iterator)  # type: ignore[arg-type]
