"""The router's inbox reader (``ZmqEngineClient._drain_inbox``): every reply reaches its request,
in order, whether replies come one at a time or in a burst longer than one wake-up handles
(``MAX_DRAIN``), and a malformed or multi-frame message is dropped without losing the rest."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from splitserve.ipc.messages import (
    GenerateTask,
    SamplingParams,
    TokenBatch,
    TokenOutput,
    WorkerReady,
    decode,
    encode,
)
from splitserve.ipc.sockets import free_tcp_addr
from splitserve.server.worker_client import MAX_DRAIN, ZmqEngineClient


async def _serve_one(worker: zmq.asyncio.Socket, reply: zmq.asyncio.Socket, num_tokens: int,
                     paced: bool) -> None:
    """Answer the one task ``worker`` receives with ``num_tokens`` tokens, one per message,
    with junk between them: an undecodable message and a two-frame one."""
    task = decode(await worker.recv())
    assert isinstance(task, GenerateTask)
    for i in range(num_tokens):
        out = TokenOutput(rid=task.rid, index=i, token_ids=[100 + i], logprobs=[-0.5],
                          finish_reason="length" if i == num_tokens - 1 else None)
        await reply.send(encode(TokenBatch([out])))
        if i == 3:
            await reply.send(b"not msgpack")
            await reply.send_multipart([encode(WorkerReady("x", "colocated", "tcp://nowhere")),
                                        b"an extra frame"])
        if paced:
            await asyncio.sleep(0.001)


def _tokens_through_client(num_tokens: int, paced: bool) -> list[int]:
    async def run() -> list[int]:
        worker_addr = free_tcp_addr()
        client = ZmqEngineClient(free_tcp_addr(), colocated=[worker_addr])
        ctx = zmq.asyncio.Context()
        worker = ctx.socket(zmq.PULL)
        worker.bind(worker_addr)
        reply = ctx.socket(zmq.PUSH)
        reply.connect(client.inbox_addr)
        await client.start()
        try:
            await reply.send(encode(WorkerReady("colocated-0", "colocated", worker_addr)))
            while not client.is_ready():
                await asyncio.sleep(0.01)
            server = asyncio.create_task(_serve_one(worker, reply, num_tokens, paced))
            tokens, finish = [], None
            async for ev in client.generate("r1", [1, 2, 3], SamplingParams()):
                assert ev.error is None
                tokens += ev.token_ids
                finish = ev.finish_reason
            await server
            assert finish == "length"
            return tokens
        finally:
            await client.close()
            ctx.destroy(linger=0)

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_paced_replies_arrive_in_order() -> None:
    assert _tokens_through_client(20, paced=True) == [100 + i for i in range(20)]


def test_a_burst_longer_than_one_drain_arrives_whole() -> None:
    n = 2 * MAX_DRAIN + 7
    assert _tokens_through_client(n, paced=False) == [100 + i for i in range(n)]
