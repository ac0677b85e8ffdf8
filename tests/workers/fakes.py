"""A worker with no model and no sockets: the real loop (``worker.loop.Worker``), scheduler,
KV pool allocator, KV transfer sessions and role policy, over a fake runner, a fake inbox and
outbox that record what is sent, fake grammar compiles that finish when a test says, a fake KV
sender or receiver, and a fake clock. Runs in milliseconds."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from splitserve.config import EngineConfig, WorkerConfig
from splitserve.config.registry import WORKER_ROLE
from splitserve.engine.core import EngineCore
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.engine.sched.batch import ModelOutput, ScheduledBatch
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.engine.step_interrupt import StepInterrupted
from splitserve.ipc.messages import (
    Constraint,
    GenerateTask,
    KVPages,
    Message,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenOutput,
    WeightsMsg,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.metrics import TransferMetrics
from splitserve.radix_cache.prefix_cache import create_prefix_cache
from splitserve.worker.build import create_sessions
from splitserve.worker.grammars import CompileDone
from splitserve.worker.links import Links
from splitserve.worker.loop import Worker
from splitserve.worker.parts import WorkerParts
from splitserve.worker.port import OutboxPort
from tests.kv_transfer.session_fakes import FakeClock, FakeSender

PAGE = 4  # tokens per page
EOS = 2
TIMEOUT_S = 3.0  # transfer_timeout_s: multiples of its thirds stay exact in binary
ROUTER = "tcp://router"
PREFILL, DECODE = "tcp://prefill", "tcp://decode"
CONTEXT_LEN = 512
WEIGHTS = WeightsMsg("LlamaForCausalLM", "f00d", "none", "beef")


def next_token(seq: list[int]) -> int:
    """The fake model: the token after ``seq`` (never EOS)."""
    return 10 + (sum(seq) * 31 + len(seq)) % 50


class FakeRunner:
    """Samples :func:`next_token` for each sampled row; checks the pages are allocated.

    Like ``ModelRunner``, it calls ``interrupt`` (set by the worker) once "between layers" of
    a step that may be given up, after ``during_step`` (a test's hook: a message arriving
    mid-step), and raises ``StepInterrupted`` when it answers True. ``batches``: each step's
    rids, given-up ones included."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.interrupt: Callable[[int], bool] | None = None
        self.during_step: Callable[[ScheduledBatch], None] | None = None
        self.batches: list[list[str]] = []

    def run(self, batch: ScheduledBatch) -> ModelOutput:
        self.batches.append([r.rid for r in batch.reqs])
        if self.during_step is not None:
            self.during_step(batch)
        if (self.interrupt is not None and batch.interrupt_floor is not None
                and self.interrupt(batch.interrupt_floor)):
            raise StepInterrupted(1)
        self.num_steps += 1
        for r, n in zip(batch.reqs, batch.chunk_lens):
            assert n >= 1 and r.kv_len + n <= r.seq_len
            assert len(r.page_ids) * PAGE >= r.kv_len + n, "pages not allocated"
        picked = [batch.reqs[i] for i in batch.sample_rows]
        tokens = [next_token(r.tokens(0, r.seq_len)) for r in picked]
        return ModelOutput(tokens, [-0.5] * len(tokens))

    def close(self) -> None:
        pass


class FakeInbox:
    """Messages the test queued (``put``), handed out by the loop's drain."""

    def __init__(self) -> None:
        self.queue: deque[tuple[Message, list]] = deque()

    def put(self, msg: Message) -> None:
        self.queue.append((msg, []))

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.queue)

    def recv(self) -> tuple[Message, list] | None:
        return self.queue.popleft() if self.queue else None

    def close(self) -> None:
        pass


class FakeOutbox:
    """Records every send as ``(addr, msg)``; an address in ``unreachable`` raises
    ``PeerUnreachable``; ``drops[addr]`` is that link's drop count."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.drops: Counter[str] = Counter()
        self.watched: list[str] = []
        self.unreachable: set[str] = set()

    def send(self, addr: str, msg: Message, frames: list | tuple = ()) -> None:
        if addr in self.unreachable:
            raise PeerUnreachable(f"peer {addr} is not reading")
        self.sent.append((addr, msg))

    def link_drops(self, addr: str) -> int:
        return self.drops[addr]

    def watch(self, addr: str) -> None:
        self.watched.append(addr)

    def close(self) -> None:
        pass

    def take(self, kind: type, addr: str | None = None) -> list:
        """The messages of type ``kind`` (to ``addr``, if given) sent since the last call."""
        got = [m for a, m in self.sent if isinstance(m, kind) and addr in (None, a)]
        self.sent = [(a, m) for a, m in self.sent
                     if not (isinstance(m, kind) and addr in (None, a))]
        return got


class FakeGrammar:
    """A request's grammar: accepts every token but those in ``refuse``; forces ``forced``
    (once) after the first token it accepts."""

    def __init__(self, refuse: frozenset[int] = frozenset(), forced: list[int] | None = None):
        self.refuse = refuse
        self.forced = list(forced or [])
        self.accepted: list[int] = []

    def accept(self, token: int) -> bool:
        if token in self.refuse:
            return False
        self.accepted.append(token)
        return True

    def must_end(self) -> bool:
        return False

    def forced_tokens(self, limit: int) -> list[int]:
        forced, self.forced = self.forced[:limit], []
        return forced

    def accepted_prefix(self, draft: list[int]) -> int:
        return len(draft)


class FakeGrammars:
    """Compiles that finish when the test calls :meth:`finish` (``worker.grammars``' interface)."""

    def __init__(self) -> None:
        self._pending: dict[str, Req] = {}
        self._done: list[CompileDone] = []

    def submit(self, req: Req) -> None:
        self._pending[req.rid] = req

    def finish(self, rid: str, error: str | None = None, code: int = 400,
               grammar: FakeGrammar | None = None) -> None:
        req = self._pending[rid]
        if error is None:
            req.grammar = grammar or FakeGrammar()
        self._done.append(CompileDone(req, error, code))

    def poll(self) -> list[CompileDone]:
        done = [d for d in self._done if self._pending.get(d.req.rid) is d.req]
        for d in done:
            del self._pending[d.req.rid]
        self._done = []
        return done

    def is_pending(self, rid: str) -> bool:
        return rid in self._pending

    def discard(self, rid: str) -> None:
        self._pending.pop(rid, None)

    def pending(self) -> list[Req]:
        return list(self._pending.values())

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        pass


class FakeReceiver:
    """A KV receiver that records installs (``one_sided``: failed requests are fenced)."""

    name = "zmq"

    def __init__(self, one_sided: bool = False) -> None:
        self.one_sided = one_sided
        self.installed: list[KVPages] = []
        self.metrics = TransferMetrics(self.name)

    def endpoint(self) -> dict[str, str]:
        return {}

    def install(self, header: KVPages, frames: list) -> None:
        self.installed.append(header)

    def close(self) -> None:
        pass


class PollingSender(FakeSender):
    """The session tests' fake sender, with what the worker loop also calls on it."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = TransferMetrics("zmq")

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Rig:
    """A fake-backed worker and its fakes."""

    worker: Worker
    inbox: FakeInbox
    outbox: FakeOutbox
    grammars: FakeGrammars
    runner: FakeRunner
    clock: FakeClock
    sender: PollingSender | None
    receiver: FakeReceiver | None

    @property
    def scheduler(self) -> Scheduler:
        return self.worker.scheduler

    def run(self, loops: int = 1) -> None:
        for _ in range(loops):
            self.worker.run_once()

    def run_until_idle(self, limit: int = 200) -> None:
        """Loop until nothing is left to schedule (or ``limit`` iterations)."""
        for _ in range(limit):
            self.worker.run_once()
            if not self.scheduler.has_work:
                return
        raise AssertionError("the worker did not go idle")

    def pages_used(self) -> int:
        """Pages held by requests: used minus the prefix cache's."""
        sched = self.scheduler
        return sched.allocator.num_used - sched.cache.stats().cached_pages

    def assert_no_pages_held(self) -> None:
        """Every page accounted for, none held by a request, and no request left in any of
        the scheduler's states."""
        sched = self.scheduler
        sched.check_pages()
        assert self.pages_used() == 0
        assert not sched.has_work
        assert not (sched.waiting_for_kv or sched.receiving_kv or sched.sending_kv)

    def errors(self) -> list[RequestError]:
        return self.outbox.take(RequestError)

    def tokens(self) -> dict[str, list[TokenOutput]]:
        """Token outputs sent since the last call, by rid, in send order."""
        out: dict[str, list[TokenOutput]] = {}
        for batch in self.outbox.take(TokenBatch):
            for o in batch.outputs:
                out.setdefault(o.rid, []).append(o)
        return out


def make_rig(role: str, *, num_pages: int = 64, one_sided: bool = False,
             prefix_cache: str = "none", **engine) -> Rig:
    """A ``role`` worker (prefill, decode, colocated) over fakes. ``engine``: more
    :class:`EngineConfig` fields (``max_batch_tokens``, ``max_running``...)."""
    worker_role = WORKER_ROLE.load(role)
    addr = {"prefill": PREFILL, "decode": DECODE}.get(role, "tcp://colocated")
    config = WorkerConfig(role=role, worker_id=f"{role}-0", addr=addr, server_addr=ROUTER,
                          engine=EngineConfig(page_size=PAGE, transfer_timeout_s=TIMEOUT_S,
                                              prefix_cache=prefix_cache, **engine))
    pool = KVPool(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=PAGE,
                           dtype="float32"), num_pages)
    cache = create_prefix_cache(prefix_cache if worker_role.computes_prompts else "none",
                                pool.allocator, PAGE)
    scheduler = Scheduler(cache, config.engine, [EOS], prefill_only=not worker_role.decodes)
    runner, grammars, clock = FakeRunner(), FakeGrammars(), FakeClock()
    inbox, outbox = FakeInbox(), FakeOutbox()
    port = OutboxPort(outbox, clock=clock)
    sender = PollingSender() if worker_role.sends_kv else None
    receiver = FakeReceiver(one_sided) if worker_role.receives_kv else None
    sessions = create_sessions(config, scheduler, grammars, port, sender, receiver)
    model_config = SimpleNamespace(context_len=CONTEXT_LEN, eos_token_ids=[EOS])
    parts = WorkerParts(config, "float32", model_config, WEIGHTS, pool, scheduler,
                        EngineCore(scheduler, runner), grammars,
                        Links(ctx=None, inbox=inbox, outbox=outbox), port, sender, receiver,
                        sessions)
    return Rig(Worker(parts, worker_role), inbox, outbox, grammars, runner, clock, sender,
               receiver)


def task(rid: str = "r1", prompt_len: int = 10, max_new: int = 4, *, start: int = 100,
         prefill_addr: str | None = None, constrained: bool = False,
         reply_addr: str = ROUTER) -> GenerateTask:
    """A greedy task for ``prompt_len`` tokens ``start, start + 1, ...``."""
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0,
                              constraint=Constraint("regex", "[a-z]+") if constrained else None)
    return GenerateTask(rid=rid, input_ids=list(range(start, start + prompt_len)),
                        reply_addr=reply_addr, sampling=sampling, prefill_addr=prefill_addr)


def expected_output(prompt: list[int], n: int) -> list[int]:
    """What the fake model generates after ``prompt``, ``n`` tokens."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def joined(outputs: list[TokenOutput], start: int = 0) -> list[int]:
    """The token ids of ``outputs`` in index order, checking they tile the output from index
    ``start`` (1 on a decode worker: the prefill worker sent the first token)."""
    ids: list[int] = []
    for o in sorted(outputs, key=lambda o: o.index):
        assert o.index == start + len(ids), (o.index, start + len(ids))
        ids += o.token_ids
    return ids
