"""The router sends the choices of one prompt (``n`` > 1) to the worker that computed it
(``PromptAffinity``), whatever the routing policy would pick, while that worker is live."""

from __future__ import annotations

import asyncio
import time

from splitserve.ipc.sockets import free_tcp_addr
from splitserve.server.engine_client import PromptAffinity
from splitserve.server.worker_client import ZmqEngineClient


def _prompt_workers(roles: dict[str, int], affinity_flow) -> list:
    async def run() -> list:
        addrs = {role: [free_tcp_addr() for _ in range(k)] for role, k in roles.items()}
        client = ZmqEngineClient(free_tcp_addr(), routing="round_robin", **addrs)
        await client.start()
        try:
            for w in client.pool.workers:
                w.ready, w.last_seen = True, time.monotonic()
            return affinity_flow(client)
        finally:
            await client.close()

    return asyncio.run(run())


def _pick(client, affinity=None):
    targets = client.targets([1, 2, 3], affinity)
    return next(w for w, _ in targets if w.role in ("prefill", "colocated"))


def test_siblings_follow_the_lead_under_round_robin() -> None:
    def flow(client) -> list:
        plain = [_pick(client) for _ in range(4)]
        affinity = PromptAffinity()
        pinned = [_pick(client, affinity) for _ in range(4)]
        return [plain, pinned, affinity.worker]

    for roles in ({"prefill": 2, "decode": 1}, {"colocated": 2}):
        plain, pinned, recorded = _prompt_workers(roles, flow)
        assert len({id(w) for w in plain}) == 2  # round robin alternates
        assert len({id(w) for w in pinned}) == 1 and pinned[0] is recorded


def test_a_lost_lead_worker_is_replaced_and_recorded() -> None:
    def flow(client) -> list:
        affinity = PromptAffinity()
        first = _pick(client, affinity)
        first.ready = False  # declared dead
        second = _pick(client, affinity)
        return [first, second, affinity.worker]

    first, second, recorded = _prompt_workers({"prefill": 2, "decode": 1}, flow)
    assert second is not first and recorded is second
