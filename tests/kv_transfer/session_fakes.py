"""Fakes for the KV transfer sessions' tests: a clock, an allocator that fails on a double free,
the two ports and a KV sender. No model, no sockets."""

from __future__ import annotations

from collections import Counter

from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import (
    FailureKind,
    KVBootstrap,
    KVLayoutMsg,
    KVPages,
    Message,
    SamplingParams,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.recv_session import RecvSessions
from splitserve.kv_transfer.send_session import SendSessions

TIMEOUT_S = 3.0  # a multiple of 3 and steps of 0.5 s keep every deadline exact in binary
PAGE_SIZE = 16
PREFILL, DECODE = "tcp://prefill", "tcp://decode"
LAYOUT = KVLayoutMsg(2, 1, 8, PAGE_SIZE, "float32")


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeAllocator:
    """Pages ``1 .. num_pages - 1``. :meth:`free` raises on a page that is not handed out (a
    double free) and counts every free."""

    def __init__(self, num_pages: int = 64) -> None:
        self.num_pages = num_pages
        self.free_set = set(range(1, num_pages))
        self.frees: Counter[int] = Counter()

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self.free_set)

    def alloc(self, n: int) -> list[int]:
        pages = sorted(self.free_set)[:n]
        assert len(pages) == n, "pool exhausted"
        self.free_set -= set(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert p not in self.free_set, f"double free of page {p}"
            self.free_set.add(p)
            self.frees[p] += 1


class FakePort:
    """Both sides' port: records messages and failures; frees a request's pages, once."""

    def __init__(self, alloc: FakeAllocator) -> None:
        self.alloc = alloc
        self.sent: list[tuple[str, Message]] = []
        self.failures: list[tuple[str, str, int]] = []  # (rid, message, code)
        self.kinds: list[FailureKind] = []  # the kind of each of ``failures``
        self.released: Counter[int] = Counter()  # Req.uid -> releases
        self.drops: Counter[str] = Counter()
        self.unreachable = False
        self.install_error: str | None = None
        self.installed: list[KVPages] = []

    def send(self, addr: str, msg: Message) -> None:
        if self.unreachable:
            raise PeerUnreachable(f"peer {addr} is not reading")
        self.sent.append((addr, msg))

    def release(self, req: Req) -> None:
        self.released[req.uid] += 1
        assert self.released[req.uid] == 1, f"{req.rid} released twice"
        self.alloc.free(req.page_ids)
        req.page_ids = []

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind = FailureKind.TRANSFER) -> None:
        self.failures.append((rid, message, code))
        self.kinds.append(kind)

    def install(self, header: KVPages, frames: list) -> None:
        if self.install_error:
            raise ValueError(self.install_error)
        self.installed.append(header)

    def link_drops(self, addr: str) -> int:
        return self.drops[addr]

    def take(self, kind: type) -> list:
        """The messages of type ``kind`` sent since the last call (and forget them)."""
        got = [m for _, m in self.sent if isinstance(m, kind)]
        self.sent = [(a, m) for a, m in self.sent if not isinstance(m, kind)]
        return got


class FakeSender:
    """A KV sender whose sends succeed (or raise ``error``) and which reads the pages of the
    rids in ``busy`` until they leave it."""

    def __init__(self) -> None:
        self.sends: list[tuple[str, list[int], list[int], bool, bool]] = []
        self.busy: set[str] = set()
        self.cancelled: list[str] = []
        self.cancelled_peers: list[str] = []
        self.error: Exception | None = None

    def send(self, boot: KVBootstrap, src_page_ids: list[int], dst_page_ids: list[int], *,
             last: bool, first_token: int = -1, first_logprob: float = 0.0,
             finished: bool = False) -> None:
        if self.error is not None:
            raise self.error
        self.sends.append((boot.rid, list(src_page_ids), list(dst_page_ids), last, finished))

    def is_done(self, rid: str) -> bool:
        return rid not in self.busy

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)

    def cancel_peer(self, dst_addr: str) -> None:
        self.cancelled_peers.append(dst_addr)
        self.busy.clear()


def make_req(rid: str = "r1", prompt_len: int = 40) -> Req:
    return Req(rid=rid, input_ids=list(range(prompt_len)), sampling=SamplingParams(),
               reply_addr="tcp://server")


def recv_table(one_sided: bool = False, num_pages: int = 64):
    """``(sessions, port, clock)`` for the decode side."""
    clock = FakeClock()
    port = FakePort(FakeAllocator(num_pages))
    return RecvSessions(port, one_sided, DECODE, TIMEOUT_S, clock=clock), port, clock


def send_table(num_pages: int = 64):
    """``(sessions, port, sender, clock)`` for the prefill side."""
    clock = FakeClock()
    port = FakePort(FakeAllocator(num_pages))
    sender = FakeSender()
    return SendSessions(sender, port, PAGE_SIZE, TIMEOUT_S, clock=clock), port, sender, clock


def bootstrap(rid: str = "r1", page_ids: list[int] | None = None) -> KVBootstrap:
    return KVBootstrap(rid=rid, dst_addr=DECODE, page_ids=page_ids or [11, 12, 13],
                       layout=LAYOUT, kv_transfer="zmq")


def pages(rid: str, page_ids: list[int], last: bool = False, finished: bool = False) -> KVPages:
    return KVPages(rid=rid, page_ids=page_ids, num_frames=0, last=last, first_token=7,
                   first_logprob=-0.5, finished=finished)
