"""Cache-aware routing under a LoRA adapter by the workers' KV events (docs/lora.md).

A worker folds the digest of an adapter's files into the prefix-cache namespace of each request
under it (``worker.tasks.new_req``), hence into the block keys its KV events carry. The router
learns each adapter's digest from the workers' heartbeats (``WorkerStats.lora_digests``) and
matches a request under that adapter in the same namespace, so its KV-event index finds the
blocks; a request under another adapter, or the base model, with the same text matches none of
them. Real router parts (the ZeroMQ client's message handling, its pool, the cache-aware policy,
a request's owner) and a real worker-side prefix cache; no sockets carry anything, no model.
"""

from __future__ import annotations

from types import SimpleNamespace

from splitserve.ipc.messages import (
    GenerateTask,
    KVEvents,
    LoraRef,
    SamplingParams,
    WorkerReady,
    WorkerStats,
    encode,
)
from splitserve.radix_cache.namespace import adapter_namespace
from splitserve.server.disagg_request import DisaggRequest, RequestTable
from splitserve.server.worker_client import ZmqEngineClient
from splitserve.worker.tasks import new_req
from tests.radix_cache.tiered_fixtures import admit, compute, make_cache

DIGESTS = {"A": "a1" * 8, "B": "b2" * 8}  # each adapter's files' digest, as workers report it
PROMPT = list(range(3, 43))  # 40 tokens: 20 pages of the fixture's page size 2
WORKERS = ("inproc://a", "inproc://b")


class _Worker:
    """One colocated worker as far as routing goes: its prefix cache and what it reports."""

    def __init__(self, addr: str) -> None:
        self.addr, self.id = addr, addr.rsplit("/", 1)[-1]
        self.cache = make_cache(None, num_pages=64)
        self.lora = SimpleNamespace(get=lambda name: SimpleNamespace(name=name,
                                                                     digest=DIGESTS[name]))
        self.scheduler = SimpleNamespace(lora=self.lora, allocator=self.cache.allocator,
                                         page_size=self.cache.page_size)

    def run(self, prompt: list[int], adapter: str | None) -> None:
        """Compute ``prompt``'s prefix under ``adapter`` as the worker's scheduler would."""
        task = GenerateTask(rid=f"{adapter}-{len(prompt)}", input_ids=prompt,
                            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                            reply_addr="inproc://router",
                            lora=None if adapter is None else LoraRef(adapter, "/adapters"))
        req = new_req(task, self.scheduler)  # type: ignore[arg-type]
        admit(self.cache, req)
        compute(self.cache, req)
        self.cache.release(req)

    def messages(self) -> list[bytes]:
        """Its ready message, a heartbeat naming both adapters' digests, and a snapshot of
        its blocks, as it sends them to the router."""
        stats = WorkerStats(query_id=0, worker_id=self.id, role="colocated", pages_total=64,
                            pages_used=0, num_running=0, num_waiting=0, loras=sorted(DIGESTS),
                            loras_resident=sorted(DIGESTS), lora_digests=dict(DIGESTS))
        events = KVEvents(worker_id=self.id, addr=self.addr, identity=self.cache.identity,
                          page_size=self.cache.page_size, seq=0,
                          events=self.cache.snapshot_events(), snapshot=True)
        return [encode(WorkerReady(self.id, "colocated", self.addr)), encode(stats),
                encode(events)]


def _routed(client: ZmqEngineClient, prompt: list[int], adapter: str | None,
            namespace: str | None = None) -> str:
    """The worker a request's owner sends ``prompt`` under ``adapter`` to (not sent)."""
    lora = None if adapter is None else LoraRef(adapter, "/adapters")
    req = DisaggRequest(f"r-{adapter}", prompt, SamplingParams(max_new_tokens=1), client,
                        RequestTable(), cache_namespace=namespace, lora=lora)
    plan = req.start()
    assert isinstance(plan, list), plan
    (worker, _frame), = plan
    return worker.addr


def test_an_adapter_request_follows_the_kv_events_of_its_adapter() -> None:
    client = ZmqEngineClient("inproc://router", colocated=list(WORKERS))
    try:
        workers = {addr: _Worker(addr) for addr in WORKERS}
        # Worker a computed the prompt under adapter A (for another router, say: this one sent
        # nothing, so its own record of what it sent matches nothing anywhere).
        workers["inproc://a"].run(PROMPT + [99], "A")
        for w in workers.values():
            for frame in w.messages():
                client._on_message(frame)
        pool = client.pool
        assert [pool.adapter_key(n) for n in ("A", "B")] == [DIGESTS["A"], DIGESTS["B"]]
        index = pool.routing.index  # type: ignore[attr-defined]
        assert all(pool.routing._tree(a).total_pages == 0 for a in WORKERS)  # type: ignore[attr-defined]

        # The next request under A with that prefix goes to a, by a's KV events, though a is
        # the busier (still balanced: a match outweighs it).
        pool.by_addr["inproc://a"].in_flight = 1
        assert _routed(client, PROMPT + [100, 101], "A") == "inproc://a"

        # The same text under B, under the base model, or under A in another tenant's
        # namespace matches none of A's pages: no match, so the least loaded, b, gets it.
        for adapter, namespace in (("B", None), (None, None), ("A", "tenant-x")):
            assert _routed(client, PROMPT + [100, 101], adapter, namespace) == "inproc://b"
        for adapter in (None, "B"):
            ns = adapter_namespace(None, DIGESTS.get(adapter or ""))
            assert index.match("inproc://a", PROMPT + [100], ns).tokens == 0
        assert index.match("inproc://a", PROMPT + [100],
                           adapter_namespace(None, DIGESTS["A"])).tokens == len(PROMPT)
    finally:
        client.ctx.destroy(linger=0)  # never started: no task to cancel


def test_before_the_workers_report_a_digest_the_name_matches_only_what_was_sent() -> None:
    """Until a heartbeat names its digest (just after a run-time load), an adapter routes in a
    namespace of its name: the router's own record of what it sent still keeps its prefixes on
    one worker, and no worker's KV events are mistaken for its blocks."""
    client = ZmqEngineClient("inproc://router", colocated=list(WORKERS))
    try:
        for addr in WORKERS:
            client._on_message(encode(WorkerReady(addr.rsplit("/", 1)[-1], "colocated", addr)))
        assert client.pool.adapter_key("A") == "name:A"
        first = _routed(client, PROMPT + [1], "A")
        client.pool.by_addr[first].in_flight = 1  # without the record the other would get it
        assert _routed(client, PROMPT + [2], "A") == first
    finally:
        client.ctx.destroy(linger=0)  # never started: no task to cancel
