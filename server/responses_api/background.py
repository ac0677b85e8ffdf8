"""Background responses (``background: true``): each runs as a task of this API server, detached
from the request that started it, and ends in the store (``completed``, ``incomplete``,
``failed`` or ``cancelled``), where ``GET`` finds it. While it runs, ``GET`` reads its state
here (the items built so far); ``POST .../cancel`` cancels the task, which aborts the request
on the workers (``server.generation.stream_text``'s ``finally``) and stores what was made.

At most ``limit`` run at once (past it: 429, as a rate limit, with ``Retry-After``); a
response that is still running when its API server stops is marked ``failed`` by the next
server that opens the store on the same host (``ResponseStore.fail_orphans``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from splitserve.server.errors import APIError
from splitserve.server.generation import Piece
from splitserve.server.responses_api.run import ResponseRun
from splitserve.server.responses_api.store import AsyncResponseStore

logger = logging.getLogger(__name__)

MAX_BACKGROUND = 256  # background responses running at once per API server


class BackgroundRuns:
    """The background responses running here, by (tenant, response id).

    Args:
        store: where each ends.
        limit: how many may run at once.
    """

    def __init__(self, store: AsyncResponseStore, limit: int = MAX_BACKGROUND) -> None:
        self.store = store
        self.limit = limit
        self._runs: dict[tuple[str, str], tuple[asyncio.Task[None], ResponseRun]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def check_room(self) -> None:
        """Raises: APIError 429 when ``limit`` responses already run in the background."""
        if len(self._runs) >= self.limit:
            raise APIError(f"background: {self.limit} background responses are running on this "
                           "server; retry when one has finished", param="background",
                           status_code=429, code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    def start(self, tenant: str, run: ResponseRun, pieces: AsyncIterator[Piece],
              input_items: list[dict[str, Any]]) -> None:
        """Run ``run`` over ``pieces`` in the background; its end goes to the store (its
        ``on_done`` stores a finished response; a failure or a cancel is stored here)."""
        key = (tenant, run.response_id)
        task = asyncio.create_task(self._run(tenant, run, pieces, input_items),
                                   name=f"background {run.response_id}")
        self._runs[key] = (task, run)
        task.add_done_callback(lambda _: self._runs.pop(key, None))

    def running(self, tenant: str, response_id: str) -> ResponseRun | None:
        entry = self._runs.get((tenant, response_id))
        return None if entry is None else entry[1]

    async def cancel(self, tenant: str, response_id: str) -> bool:
        """Cancel ``tenant``'s running response and wait until it is stored as cancelled;
        False when none of that id runs here. A response whose answer is already whole
        (``completed`` or ``incomplete``: only its store write is left) is not cancelled: this
        waits for it to be stored as it is, as OpenAI answers a cancel of a finished response
        with the response. (No await between the check and ``Task.cancel``: a run still
        generating cannot finish in between.)"""
        entry = self._runs.get((tenant, response_id))
        if entry is None:
            return False
        task, run = entry
        if run.status not in ("completed", "incomplete"):
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def _run(self, tenant: str, run: ResponseRun, pieces: AsyncIterator[Piece],
                   input_items: list[dict[str, Any]]) -> None:
        try:
            await run.complete(pieces)
            return
        except asyncio.CancelledError:
            run.status = "cancelled"
            body = run.body()
        except APIError as err:
            body = run.fail(err)
        except Exception as exc:
            logger.exception("background response %s failed", run.response_id)
            body = run.fail(APIError(f"internal error: {exc}", status_code=500))
        try:
            await asyncio.shield(self.store.put(tenant, body, input_items))
        except Exception:
            logger.exception("background response %s: could not store its end",
                             run.response_id)
