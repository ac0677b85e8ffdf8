"""A cancel that arrives while a background response's answer is whole and only its store write
is left (the race a poll-then-cancel client hits) leaves it completed, as OpenAI answers a
cancel of a finished response; a cancel while it still generates cancels it."""

from __future__ import annotations

import asyncio
from typing import Any

from splitserve.server.responses_api.background import BackgroundRuns


class FakeStore:
    def __init__(self) -> None:
        self.puts: list[dict[str, Any]] = []

    async def put(self, tenant: str, body: dict[str, Any], input_items: list) -> None:
        self.puts.append(body)


class FakeRun:
    """A run whose answer ends at once (``status`` completed) and whose own store write (its
    ``on_done``) waits for ``release``; or, with ``generating``, one still producing tokens."""

    response_id = "resp_1"

    def __init__(self, generating: bool = False) -> None:
        self.status = "in_progress"
        self.generating = generating
        self.release = asyncio.Event()
        self.in_store_write = asyncio.Event()

    async def complete(self, pieces: Any) -> dict[str, Any]:
        if not self.generating:
            self.status = "completed"
        self.in_store_write.set()
        await self.release.wait()
        return self.body()

    def body(self) -> dict[str, Any]:
        return {"id": self.response_id, "status": self.status}


async def _cancel_during(run: FakeRun) -> FakeStore:
    store = FakeStore()
    runs = BackgroundRuns(store)  # type: ignore[arg-type]
    runs.start("t", run, None, [])  # type: ignore[arg-type]
    await run.in_store_write.wait()
    cancel = asyncio.create_task(runs.cancel("t", run.response_id))
    await asyncio.sleep(0)  # let the cancel act before the write ends
    run.release.set()
    assert await cancel
    assert len(runs) == 0
    return store


def test_a_cancel_during_the_store_write_leaves_it_completed() -> None:
    run = FakeRun()
    store = asyncio.run(_cancel_during(run))
    assert run.status == "completed" and store.puts == []  # its own write stored it


def test_a_cancel_while_generating_cancels() -> None:
    run = FakeRun(generating=True)
    store = asyncio.run(_cancel_during(run))
    assert run.status == "cancelled" and [b["status"] for b in store.puts] == ["cancelled"]
