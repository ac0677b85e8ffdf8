"""Fake workers and a fake port for :class:`~splitserve.server.disagg_request.DisaggRequest`:
no sockets, no model. A fake worker holds a request's pages from the moment its task arrives
until it finishes its part or is aborted, and counts every abort, so a test can say that each
worker of each attempt was released exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from splitserve.ipc.messages import GenerateTask, SamplingParams, TokenOutput, decode
from splitserve.server.disagg_request import DisaggRequest, RequestTable
from splitserve.server.engine_client import PromptAffinity, TokenEvent

PROMPT = [1, 2, 3]


def token_id(attempt: int, index: int) -> int:
    """The token a fake worker samples at output ``index`` of attempt ``attempt`` (0-based): the
    attempt is in the id, so a token of an old attempt cannot pass for a new one's."""
    return 1000 * (attempt + 1) + index


@dataclass(eq=False)
class FakeWorker:
    """One worker as the router sees it (``role``, ``ready``, ``in_flight``) and what it got.

    ``attempted``: wire rids whose task was handed to the link; ``tasks``: those that arrived;
    ``held``: those whose pages it holds; ``aborts``: ``AbortTask`` s received, by wire rid."""

    role: str
    name: str
    ready: bool = True
    in_flight: int = 0
    heard: int = 0
    attempted: list[str] = field(default_factory=list)
    tasks: dict[str, GenerateTask] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    aborts: Counter = field(default_factory=Counter)
    addr: str = ""

    def __post_init__(self) -> None:
        self.addr = f"tcp://{self.name}"

    def receive(self, task: GenerateTask) -> None:
        """``task`` arrived: its pages are held from now (unless its abort came first)."""
        self.tasks[task.rid] = task
        if self.aborts[task.rid] == 0:  # an abort that came first makes it a no-op
            self.held.add(task.rid)

    def release(self, wire: str) -> None:
        """Its part of ``wire`` is done (finished, or failed here): its pages are freed."""
        self.held.discard(wire)


@dataclass
class PendingSend:
    """A task on its way to ``worker``; the test completes or fails ``sent``."""

    worker: FakeWorker
    task: GenerateTask
    sent: asyncio.Future


class FakePort:
    """The world of a request: ``workers`` to pick from (the least loaded ready one of each
    role; a colocated one first, as the client does), their counts and links.
    ``auto_send``: a task arrives as soon as it is sent; otherwise it waits in ``sends``.
    ``instant``: the same choice for the next sends, one per send, before ``auto_send``'s."""

    inbox_addr = "tcp://router"

    def __init__(self, workers: list[FakeWorker], auto_send: bool = True) -> None:
        self.workers = workers
        self.auto_send = auto_send
        self.instant: list[bool] = []
        self.sends: list[PendingSend] = []

    def pick(self, role: str) -> FakeWorker | None:
        live = [w for w in self.workers if w.role == role and w.ready]
        return min(live, key=lambda w: w.in_flight) if live else None

    def targets(
        self, input_ids: list[int], affinity: PromptAffinity | None, namespace: str | None,
    ) -> list[tuple[FakeWorker, str | None]] | TokenEvent:
        colocated = self.pick("colocated")
        if colocated is not None:
            return [(colocated, None)]
        p, d = self.pick("prefill"), self.pick("decode")
        if p is None or d is None:
            return TokenEvent([], [], error="no healthy prefill/decode worker", error_code=503)
        return [(d, p.addr), (p, None)]

    def send_task(self, worker: FakeWorker, frame: bytes) -> asyncio.Future:
        task = decode(frame)
        assert isinstance(task, GenerateTask)
        worker.attempted.append(task.rid)
        sent = asyncio.get_running_loop().create_future()
        if self.instant.pop(0) if self.instant else self.auto_send:
            worker.receive(task)
            sent.set_result(None)
        else:
            self.sends.append(PendingSend(worker, task, sent))
        return sent

    def send_abort(self, worker: FakeWorker, rid: str) -> None:
        worker.aborts[rid] += 1
        worker.release(rid)

    def count(self, worker: FakeWorker) -> None:
        worker.in_flight += 1

    def uncount(self, worker: FakeWorker) -> None:
        assert worker.in_flight > 0, f"{worker.name} uncounted below zero"
        worker.in_flight -= 1

    def heard_from(self, worker: FakeWorker) -> None:
        worker.heard += 1


def disagg_workers(num_pairs: int = 2) -> list[FakeWorker]:
    """``num_pairs`` prefill and as many decode workers."""
    return ([FakeWorker("prefill", f"p{i}") for i in range(num_pairs)]
            + [FakeWorker("decode", f"d{i}") for i in range(num_pairs)])


def make_request(
    workers: list[FakeWorker], *, auto_send: bool = True, max_retries: int = 1,
    metrics: object = None, sampling: SamplingParams | None = None,
) -> tuple[DisaggRequest, FakePort, RequestTable]:
    """Request ``r`` of :data:`PROMPT` over ``workers``: ``(request, port, table)``."""
    port = FakePort(workers, auto_send)
    table = RequestTable()
    req = DisaggRequest("r", PROMPT, sampling or SamplingParams(max_new_tokens=16), port, table,
                        metrics=metrics, max_retries=max_retries)
    return req, port, table


def output(wire: str, index: int, count: int = 1, finish: str | None = None,
           attempt: int = 0) -> TokenOutput:
    """``count`` tokens of ``wire`` from output ``index`` on."""
    ids = [token_id(attempt, i) for i in range(index, index + count)]
    return TokenOutput(rid=wire, index=index, token_ids=ids, logprobs=[-0.5] * count,
                       finish_reason=finish)


def replies(req: DisaggRequest) -> list:
    """What the request's reader would read next, taken out."""
    items = list(req.replies._items)
    req.replies._items.clear()
    return items
