"""The router's in-flight count per worker (``WorkerHandle.in_flight``, shown in ``GET /workers``)
stays balanced whichever way a request fails before its workers heard of it: an unencodable value
(a seed past 64 bits was a 500 and left the prefill worker at -1 per request), or a send that
fails."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from splitserve.ipc.messages import SamplingParams
from splitserve.ipc.sockets import free_tcp_addr
from splitserve.server.worker_client import ZmqEngineClient


class FailingSocket:
    """A worker link whose task sends fail (aborts, sent NOBLOCK, are refused as a full link)."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, frame: bytes, flags: int = 0) -> None:
        if flags & zmq.NOBLOCK:
            raise zmq.Again()
        self.sent += 1
        raise ConnectionError("link broke")


async def _run(sampling: SamplingParams, failing_role: str | None) -> tuple[list, dict[str, int]]:
    client = ZmqEngineClient(free_tcp_addr(), prefill=[free_tcp_addr()], decode=[free_tcp_addr()])
    await client.start()
    try:
        for w in client.pool.workers:
            w.ready, w.last_seen = True, time.monotonic()
            if w.role == failing_role:
                w.sock = FailingSocket()
        events, error = [], None
        try:
            async for ev in client.generate("r1", [1, 2, 3], sampling):
                events.append(ev)
        except ConnectionError as exc:
            error = exc
        assert (error is not None) == (failing_role is not None)
        return events, {w.role: w.in_flight for w in client.pool.workers}
    finally:
        await client.close()


@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**64)])
def test_unencodable_value_is_a_400_and_counts_nothing(seed: int) -> None:
    for _ in range(6):  # the bug compounded: -6 after six requests
        events, in_flight = asyncio.run(_run(SamplingParams(seed=seed), None))
        assert [(e.error_code, "out of range" in (e.error or "")) for e in events] == [(400, True)]
        assert in_flight == {"prefill": 0, "decode": 0}


@pytest.mark.parametrize("failing_role", ["decode", "prefill"])  # decode is sent to first
def test_failed_send_leaves_counts_balanced(failing_role: str) -> None:
    events, in_flight = asyncio.run(_run(SamplingParams(seed=1), failing_role))
    assert events == []
    assert in_flight == {"prefill": 0, "decode": 0}
