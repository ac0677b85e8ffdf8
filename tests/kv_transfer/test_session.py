"""The KV handoff sessions against naive reference models (hypothesis state machines), with a
fake clock, a fake allocator that fails on a double free, and no model or sockets.

The decode side runs as the decode worker drives it: tasks open sessions, admission reserves
pages in arrival order while they last, the prefill worker's messages (pages, keepalives,
``KVFailed``, ``KVReleased``) arrive in any order for any rid, the server aborts, grammars fail,
links drop, peers stop reading, time passes and each loop checks fences, keepalives and
deadlines. The prefill side likewise. After every step: the same states, deadlines, messages and
failure reports as the reference, every used page held by exactly one live session, and no page
freed twice (the allocator raises)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.kv_pool import pages_for
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.session import TransferState
from tests.kv_transfer.session_fakes import (
    DECODE,
    PAGE_SIZE,
    TIMEOUT_S,
    bootstrap,
    make_req,
    pages,
    recv_table,
    send_table,
)

T = TransferState
RIDS = st.sampled_from(["a", "b", "c"])  # few: each gets many events
PREFILLS = ("tcp://p0", "tcp://p1")
STEPS = st.sampled_from([0.5, 1.0, 1.5, 3.0, 3.5])  # seconds; exact in binary, as TIMEOUT_S
NUM_PAGES = 8  # 7 usable: two prompts of up to 5 pages do not fit together


@dataclass
class RecvRef:
    """What the reference expects of one decode-side request."""

    state: TransferState
    deadline: float | None
    prefill: str
    num_pages: int  # the prompt's
    held: int = 0  # pages held now
    last_keepalive: float = 0.0
    drops_at: int = 0


class RecvMachine(RuleBasedStateMachine):
    one_sided = False

    def __init__(self) -> None:
        super().__init__()
        self.sessions, self.port, self.clock = recv_table(self.one_sided, NUM_PAGES)
        self.ref: dict[str, RecvRef] = {}
        self.sent: Counter[tuple[str, str]] = Counter()  # (message type, rid) expected
        self.reports: Counter[str] = Counter()  # failures reported per rid
        self.handed_over = 0

    # ---- the reference ------------------------------------------------------------------------

    def _send(self, kind: str, rid: str) -> bool:
        if self.port.unreachable:
            return False
        self.sent[kind, rid] += 1
        return True

    def _end(self, rid: str) -> None:
        del self.ref[rid]

    def _ref_fail(self, rid: str, notify: bool, report: bool) -> None:
        r = self.ref[rid]
        if r.state is T.FENCED:
            return
        if r.state is T.WAITING_FOR_PAGES and self.one_sided:
            self._send("KVFailed", rid)
            r.state, r.deadline = T.FENCED, self.clock() + TIMEOUT_S
        else:
            if r.state is T.WAITING_FOR_PAGES and notify:
                self._send("KVFailed", rid)
            self._end(rid)
        if report:
            self.reports[rid] += 1

    def _admit(self) -> None:
        """The decode worker's admission: in arrival order, while the pages last."""
        for rid in [rid for rid, r in self.ref.items() if r.state is T.QUEUED]:
            r = self.ref[rid]
            if len(self.port.alloc.free_set) < r.num_pages:
                return
            page_ids = self.port.alloc.alloc(r.num_pages)
            self.sessions.get(rid).reserve(page_ids, bootstrap(rid, page_ids))
            r.state, r.deadline, r.held = T.WAITING_FOR_PAGES, self.clock() + TIMEOUT_S, r.num_pages
            r.drops_at = self.port.drops[r.prefill]
            self._send("KVBootstrap", rid)

    # ---- rules --------------------------------------------------------------------------------

    @rule(rid=RIDS, prompt_len=st.integers(1, 80), prefill=st.sampled_from(PREFILLS))
    def task(self, rid: str, prompt_len: int, prefill: str) -> None:
        if rid in self.ref:
            return  # the worker refuses a rid in use (400)
        self.sessions.open(make_req(rid, prompt_len), prefill)
        self.ref[rid] = RecvRef(T.QUEUED, self.clock() + TIMEOUT_S, prefill,
                                pages_for(prompt_len, PAGE_SIZE), last_keepalive=self.clock(),
                                drops_at=self.port.drops[prefill])
        self._admit()

    @rule(rid=RIDS, kind=st.sampled_from(["chunk", "last", "last", "finished", "outside", "bad",
                                          "keepalive", "keepalive", "kv_failed", "released"]))
    def from_prefill(self, rid: str, kind: str) -> None:
        """A message of the prefill worker's, for any rid, in any state."""
        s = self.sessions.get(rid)
        if s is None:
            return  # the worker drops messages of requests it no longer has
        r = self.ref[rid]
        if kind == "keepalive":
            s.on_keepalive()
            if r.state is T.WAITING_FOR_PAGES:
                r.deadline = self.clock() + TIMEOUT_S
        elif kind == "kv_failed":
            s.on_kv_failed("prefill gave up")
            if r.state is T.WAITING_FOR_PAGES:
                self._ref_fail(rid, notify=False, report=True)
        elif kind == "released":
            s.on_released()
            if r.state is T.FENCED:
                self._end(rid)
        else:
            self._kv_pages(s, r, kind)
        self._admit()

    def _kv_pages(self, s, r: RecvRef, kind: str) -> None:
        reserved = sorted(s.reserved)
        header = pages(s.rid, [NUM_PAGES + 5] if kind == "outside" else reserved[:1],
                       last=kind in ("last", "finished"), finished=kind == "finished")
        self.port.install_error = "short frame" if kind == "bad" else None
        s.on_pages(header, [])
        if r.state is not T.WAITING_FOR_PAGES:
            return
        r.deadline = self.clock() + TIMEOUT_S
        if kind in ("outside", "bad"):
            self._ref_fail(s.rid, notify=True, report=True)
        elif kind == "last":
            r.state, r.deadline = T.KV_READY, None
        elif kind == "finished":
            self._end(s.rid)

    @rule(rid=RIDS, how=st.sampled_from(["abort", "grammar_failed"]))
    def ends_here(self, rid: str, how: str) -> None:
        """The server aborts it, or its grammar fails to compile."""
        s = self.sessions.get(rid)
        if s is None:
            return
        if how == "abort":
            self.sessions.abort(rid)
        else:
            s.fail("grammar failed", notify=True, error="grammar failed", code=400)
        self._ref_fail(rid, notify=how != "abort", report=how != "abort")
        self._admit()

    @precondition(lambda self: any(r.state is T.KV_READY for r in self.ref.values()))
    @rule(data=st.data())
    def start(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.ref.items()
                                               if v.state is T.KV_READY)))
        req = self.sessions.get(rid).start()
        assert len(req.page_ids) == self.ref[rid].num_pages
        self.port.alloc.free(req.page_ids)  # the scheduler runs it and frees it
        self._end(rid)
        self.handed_over += 1
        self._admit()

    @rule(prefill=st.sampled_from(PREFILLS))
    def link_drops(self, prefill: str) -> None:
        self.port.drops[prefill] += 1

    @rule(unreachable=st.booleans())
    def peer_reading(self, unreachable: bool) -> None:
        self.port.unreachable = unreachable

    @rule(seconds=STEPS)
    def loop(self, seconds: float) -> None:
        """Time passes; the worker's tick (its policy's on_tick) runs."""
        self.clock.advance(seconds)
        now = self.clock()
        for s in self.sessions.by_state(T.FENCED):
            s.check_link()
        for s in self.sessions.by_state(T.QUEUED):
            s.keep_alive(now)
        for s in self.sessions.expire(now):
            s.time_out()
        for rid, r in list(self.ref.items()):
            if r.state is T.FENCED and self.port.drops[r.prefill] > r.drops_at:
                self._end(rid)
        for rid, r in self.ref.items():
            if (r.state is T.QUEUED and now - r.last_keepalive >= TIMEOUT_S / 3
                    and self.port.drops[r.prefill] <= r.drops_at):
                r.last_keepalive = now
                if self._send("KVQueued", rid):
                    r.deadline = now + TIMEOUT_S
        for rid in [rid for rid, r in self.ref.items() if r.deadline is not None
                    and r.deadline < now]:
            if self.ref[rid].state is T.FENCED:
                self._end(rid)
            else:
                self._ref_fail(rid, notify=True, report=True)
        self._admit()

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def same_states_and_deadlines(self) -> None:
        assert sorted(s.rid for s in self.sessions) == sorted(self.ref)
        for rid, r in self.ref.items():
            s = self.sessions.get(rid)
            assert (s.state, s.deadline) == (r.state, r.deadline), rid

    @invariant()
    def every_used_page_is_held_by_one_live_session(self) -> None:
        held = [p for s in self.sessions if s.req is not None for p in s.req.page_ids]
        assert len(held) == len(set(held)) == self.port.alloc.num_used
        assert self.port.alloc.num_used == sum(r.held for r in self.ref.values())

    @invariant()
    def same_messages_and_reports(self) -> None:
        sent = Counter((type(m).__name__, m.rid) for _, m in self.port.sent)
        assert sent == +self.sent
        assert Counter(rid for rid, _, _ in self.port.failures) == +self.reports


class RecvMachineOneSided(RecvMachine):
    one_sided = True


@dataclass
class SendRef:
    """What the reference expects of one prefill-side request."""

    state: TransferState
    deadline: float | None
    has_req: bool  # the session holds the request (and its 3 pages)
    last_progress: float = 0.0
    bootstrapped: bool = False
    pages_sent: int = 0


class SendMachine(RuleBasedStateMachine):
    """Every request has a 40-token prompt (3 pages of 16), computed at once with its first
    token: a step sends its 2 complete pages, the first token the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions, self.port, self.sender, self.clock = send_table(num_pages=4096)
        self.ref: dict[str, SendRef] = {}
        self.sent: Counter[tuple[str, str]] = Counter()
        self.reports: Counter[str] = Counter()

    # ---- the reference ------------------------------------------------------------------------

    def _send(self, kind: str, rid: str) -> None:
        if not self.port.unreachable:
            self.sent[kind, rid] += 1

    def _fail(self, rid: str) -> None:
        """It failed here: reported once the task came, the decode worker told once bootstrapped."""
        r = self.ref.pop(rid)
        if r.state is not T.WAITING_FOR_TASK:
            self.reports[rid] += 1
        if r.bootstrapped:
            self._send("KVFailed", rid)

    def _poll(self, rid: str, busy: set[str]) -> None:
        r = self.ref[rid]
        if rid not in busy:
            if r.state is T.RELEASING:
                self._send("KVReleased", rid)
            del self.ref[rid]

    def _sent_pages(self, rid: str, end: int, last: bool) -> None:
        """A send of pages up to ``end``: it fails (both sides), or the request makes progress
        (and drains after the last one)."""
        r = self.ref[rid]
        if self.sender.error is not None:
            self._fail(rid)
            return
        r.pages_sent, r.last_progress = end, self.clock()
        if last:
            r.state, r.deadline = T.DRAINING, self.clock() + TIMEOUT_S
            self._poll(rid, self.sender.busy)

    # ---- rules --------------------------------------------------------------------------------

    @rule(rid=RIDS, reading=st.booleans())
    def task(self, rid: str, reading: bool) -> None:
        """``reading``: the backend will still read its pages after the last send."""
        if reading:
            self.sender.busy.add(rid)
        req = make_req(rid, 40)
        req.page_ids = self.port.alloc.alloc(3)
        req.kv_len, req.output_ids, req.output_logprobs = 40, [5], [-0.1]
        s = self.sessions.get(rid)
        if s is None:
            self.sessions.open_task(req)
            self.ref[rid] = SendRef(T.BOOTSTRAPPING, self.clock() + TIMEOUT_S, True)
            return
        r = self.ref[rid]
        if r.state is T.WAITING_FOR_TASK:
            s.on_task(req)
            r.state, r.deadline, r.has_req = T.TRANSFERRING, None, True
            return
        if r.state is T.RELEASING:
            s.on_task(req)  # failed wins: the worker drops the late task
        self.port.alloc.free(req.page_ids)  # (other states: a duplicate, logged and dropped)

    @rule(rid=RIDS)
    def bootstrap(self, rid: str) -> None:
        s = self.sessions.get(rid)
        now = self.clock()
        if s is None:
            self.sessions.open_bootstrap(bootstrap(rid))
            self.ref[rid] = SendRef(T.WAITING_FOR_TASK, now + TIMEOUT_S, False, now, True)
            self._send("KVKeepalive", rid)
            return
        r = self.ref[rid]
        if r.state not in (T.BOOTSTRAPPING, T.PREFILLED, T.RELEASING):
            return  # a duplicate bootstrap: the worker logs and drops it
        s.on_bootstrap(bootstrap(rid))
        if r.state is T.RELEASING:
            return
        self._send("KVKeepalive", rid)
        r.last_progress, r.bootstrapped = now, True
        if r.state is T.PREFILLED:
            self._sent_pages(rid, 3, last=True)
        else:
            r.state, r.deadline = T.TRANSFERRING, None
            self._sent_pages(rid, 2, last=False)

    @rule()
    def step(self) -> None:
        """After a scheduler step: bootstrapped requests send their complete pages."""
        for s in self.sessions.by_state(T.TRANSFERRING):
            s.send_computed_pages()
        for rid in [rid for rid, r in self.ref.items() if r.state is T.TRANSFERRING]:
            if self.ref[rid].pages_sent < 2:
                self._sent_pages(rid, 2, last=False)

    @rule(rid=RIDS)
    def first_token(self, rid: str) -> None:
        s = self.sessions.get(rid)
        if s is None or self.ref[rid].state not in (T.BOOTSTRAPPING, T.TRANSFERRING):
            return  # the scheduler samples a first token only for a request it runs
        s.on_prefilled()
        r = self.ref[rid]
        if r.state is T.BOOTSTRAPPING:
            r.state = T.PREFILLED
        else:
            self._sent_pages(rid, 3, last=True)

    @rule(rid=RIDS, kind=st.sampled_from(["queued", "queued", "kv_failed", "kv_failed_ack"]))
    def from_decode(self, rid: str, kind: str) -> None:
        """A message of the decode worker's (besides the bootstrap), for any rid."""
        s = self.sessions.get(rid)
        ack = kind == "kv_failed_ack"
        if s is None:
            if ack:
                self.sessions.open_release(rid, DECODE)
                self.ref[rid] = SendRef(T.RELEASING, self.clock() + TIMEOUT_S, False)
                self._poll(rid, self.sender.busy)
            return
        r = self.ref[rid]
        if kind == "queued":
            s.on_queued()
            if r.state in (T.BOOTSTRAPPING, T.PREFILLED):
                r.deadline = self.clock() + TIMEOUT_S
            return
        s.on_kv_failed(DECODE if ack else "")
        if r.state is T.RELEASING:
            return
        if r.state is not T.DRAINING:
            r.has_req = False  # early pages are freed at once
        if ack:
            r.state, r.deadline = T.RELEASING, self.clock() + TIMEOUT_S
            self._poll(rid, self.sender.busy)
        elif r.state is not T.DRAINING:
            del self.ref[rid]

    @rule(rid=RIDS, how=st.sampled_from(["abort", "grammar_failed"]))
    def ends_here(self, rid: str, how: str) -> None:
        """The server aborts it, or its grammar fails to compile."""
        s = self.sessions.get(rid)
        if s is None:
            return
        if how == "abort":
            self.sessions.abort(rid)
        else:
            s.fail("grammar failed", 400, notify="grammar failed")
        if self.ref[rid].state in (T.DRAINING, T.RELEASING):
            return  # everything is sent: the pages stay until the backend is done
        if how == "abort":
            del self.ref[rid]
        else:
            self._fail(rid)

    @rule(rid=RIDS, busy=st.booleans())
    def backend_reading(self, rid: str, busy: bool) -> None:
        if busy:
            self.sender.busy.add(rid)
        else:
            self.sender.busy.discard(rid)

    @rule(send_fails=st.sampled_from([False, False, True]), unreachable=st.booleans())
    def peer(self, send_fails: bool, unreachable: bool) -> None:
        self.sender.error = PeerUnreachable("queue full") if send_fails else None
        self.port.unreachable = unreachable

    @rule(seconds=STEPS)
    def loop(self, seconds: float) -> None:
        """Time passes; the worker's tick (its policy's ``on_tick``) runs (the reference
        first: the real one's ``cancel_peer`` changes what the backend reads)."""
        self.clock.advance(seconds)
        now = self.clock()
        busy = set(self.sender.busy)
        for rid in [rid for rid, r in self.ref.items() if r.state in (T.DRAINING, T.RELEASING)]:
            self._poll(rid, busy)
        for rid in [rid for rid, r in self.ref.items()
                    if r.deadline is not None and r.deadline < now]:
            r = self.ref[rid]
            if r.state in (T.BOOTSTRAPPING, T.PREFILLED):
                self._fail(rid)
            else:  # waiting for the task, draining, releasing: ends without a word
                del self.ref[rid]
        for rid, r in self.ref.items():
            if (r.state in (T.WAITING_FOR_TASK, T.TRANSFERRING)
                    and now - r.last_progress > TIMEOUT_S / 3):
                self._send("KVKeepalive", rid)
                r.last_progress = now
        for s in self.sessions.by_state(T.DRAINING, T.RELEASING):
            s.poll()
        for s in self.sessions.expire(now):
            s.time_out()
        for s in self.sessions.by_state(T.WAITING_FOR_TASK, T.TRANSFERRING):
            s.keep_alive(now)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def same_states_and_deadlines(self) -> None:
        assert sorted(s.rid for s in self.sessions) == sorted(self.ref)
        for rid, r in self.ref.items():
            s = self.sessions.get(rid)
            assert (s.state, s.deadline, s.req is not None) == (r.state, r.deadline, r.has_req)

    @invariant()
    def every_used_page_is_held_by_one_live_session(self) -> None:
        assert self.port.alloc.num_used == 3 * sum(r.has_req for r in self.ref.values())

    @invariant()
    def same_messages_and_reports(self) -> None:
        sent = Counter((type(m).__name__, m.rid) for _, m in self.port.sent)
        assert sent == +self.sent
        assert Counter(rid for rid, _, _ in self.port.failures) == +self.reports


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRecvSessions = RecvMachine.TestCase
TestRecvSessions.settings = MACHINE_SETTINGS
TestRecvSessionsOneSided = RecvMachineOneSided.TestCase
TestRecvSessionsOneSided.settings = MACHINE_SETTINGS
TestSendSessions = SendMachine.TestCase
TestSendSessions.settings = MACHINE_SETTINGS
