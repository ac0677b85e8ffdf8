"""The router's owner of a request (``server.disagg_request``) against fake workers, as a
hypothesis state machine: no sockets, no model, one event loop stepped by hand.

The request runs as ``BaseEngineClient.generate`` runs it (``DisaggRequest.events``, read by a
reader task as ``server.generation.stream_text`` reads it). Meanwhile, in any order: its task
sends complete or fail; the worker that computes the prompt sends the first token, the decoding
worker the rest (one or several per message) once the first exists; those messages reach the
router in any order, late ones of an ended attempt included; a worker fails the request
(``RequestError``); a worker is declared dead (before or after the first token) and may come
back; the client disconnects, stops reading after its next event (a stop string), or the
request is aborted.

After every step: the reader got tokens in output order with no gap or duplicate, all from one
attempt (so a retry came before any token was delivered); no event after the terminal one and
nothing queued after the request ended; no worker counted below zero and none aborted twice for
one attempt; at most ``1 + MAX_RETRIES`` attempts. Once the reader is done: every worker's
in-flight count back to zero, and every worker that received a task of an attempt finished it
or was aborted for it exactly once; at the end, no worker holds any page of the request.
"""

from __future__ import annotations

import asyncio

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from splitserve.ipc.messages import RequestError, TokenOutput
from splitserve.server.disagg_request import MAX_RETRIES
from splitserve.server.disagg_transitions import DisaggState
from tests.server.disagg_fakes import (
    FakeWorker,
    PendingSend,
    disagg_workers,
    make_request,
    output,
    token_id,
)

S = DisaggState
LOOP_TURNS = 12  # event loop iterations per step: more than any chain of wake-ups here needs


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True one draw in ``n``; False is the simplest (what hypothesis tries first and shrinks
    to), so runs stream before they are cut short."""
    return st.sampled_from([False] * (n - 1) + [True])


def attempt_of(wire: str) -> int:
    """``r`` -> 0, ``r.retry1`` -> 1."""
    return int(wire.rsplit(".retry", 1)[1]) if ".retry" in wire else 0


class DisaggMachine(RuleBasedStateMachine):
    """One request on 2 prefill + 2 decode fake workers (``colocated``: on 2 colocated ones)."""

    colocated = False

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        if self.colocated:
            self.workers = [FakeWorker("colocated", "c0"), FakeWorker("colocated", "c1")]
        else:
            self.workers = disagg_workers()
        self.req, self.port, self.table = make_request(self.workers, auto_send=False)
        self.length = 1  # output tokens the workers produce (drawn in ``init``)
        self.produced: dict[str, int] = {}  # wire -> next output index the workers produce
        self.outbox: list[TokenOutput | RequestError] = []  # sent, not yet read by the router
        self.got: list = []  # the reader's events
        self.reader_error: BaseException | None = None
        self.stop_after_next = False
        self.disconnected = False
        self.queued_at_end: int | None = None
        self.reader = self.loop.create_task(self._read())  # runs from ``init`` on

    async def _read(self) -> None:
        events = self.req.events()
        try:
            async for ev in events:
                self.got.append(ev)
                if self.stop_after_next:
                    break
        except ConnectionError as exc:
            self.reader_error = exc
        finally:
            await events.aclose()

    def _settle(self) -> None:
        for _ in range(LOOP_TURNS):
            self.loop.run_until_complete(asyncio.sleep(0))

    @initialize(length=st.integers(1, 5),
                instant=st.lists(st.sampled_from([True, True, False]), min_size=4, max_size=4))
    def init(self, length: int, instant: list[bool]) -> None:
        """``length`` output tokens; ``instant``: whether each task arrives as it is sent (else
        it waits for a move of ``advance``, or ``send_fails``)."""
        self.length = length
        self.port.instant = instant
        self._settle()

    # ---- the world moves on ------------------------------------------------------------------

    def _open_sends(self) -> list[PendingSend]:
        return [s for s in self.port.sends if not s.sent.done()]

    def _can_produce(self) -> list[tuple[FakeWorker, str]]:
        """``(worker, wire)``: who can send its next tokens. The worker that computes the
        prompt (prefill or colocated) sends index 0; the decoding worker (decode or colocated)
        the rest, once index 0 exists (the KV went with it). A worker sends while it is up
        and holds the request's pages."""
        out = []
        for w in self.workers:
            if not w.ready:
                continue
            for wire in sorted(w.held):
                index = self.produced.get(wire, 0)
                computes_prompt = w.tasks[wire].prefill_addr is None
                decodes = w.role in ("decode", "colocated")
                if index < self.length and (computes_prompt if index == 0 else decodes):
                    out.append((w, wire))
        return out

    def _moves(self) -> list[tuple]:
        return ([("arrive", s) for s in self._open_sends()]
                + [("produce", w, wire) for w, wire in self._can_produce()]
                + [("read", i) for i in range(len(self.outbox))])

    @precondition(lambda self: self._moves())
    @rule(data=st.data(), count=st.integers(1, 3))
    def advance(self, data, count: int) -> None:
        """One step of the request's normal life, any of those possible now: a task reaches
        its worker; a worker sends its next tokens (``count`` of them when decoding); the
        router reads any message sent (so in any order, late ones of an ended attempt
        included) and routes it by rid, as its inbox reader does."""
        move = data.draw(st.sampled_from(self._moves()))
        if move[0] == "arrive":
            move[1].worker.receive(move[1].task)
            move[1].sent.set_result(None)
        elif move[0] == "produce":
            self._produce(move[1], move[2], count)
        else:
            msg = self.outbox.pop(move[1])
            req = self.table.by_wire.get(msg.rid)
            if req is not None:
                if isinstance(msg, TokenOutput):
                    req.on_tokens(msg)
                else:
                    req.on_error(msg)
        self._settle()

    def _produce(self, w: FakeWorker, wire: str, count: int) -> None:
        index = self.produced.get(wire, 0)
        count = 1 if index == 0 else min(count, self.length - index)
        finish = "length" if index + count == self.length else None
        self.outbox.append(output(wire, index, count, finish, attempt=attempt_of(wire)))
        self.produced[wire] = index + count
        if finish is not None:  # every worker of the attempt is done: its pages freed
            for other in self.workers:
                other.release(wire)
        elif w.role == "prefill":  # its part is done once the first token (and the KV) left
            w.release(wire)

    # ---- faults -------------------------------------------------------------------------------
    # Each acts one draw in ``n`` (and hypothesis turns whole rules off in some runs), so most
    # runs stream a while before they are cut short.

    @precondition(lambda self: self._open_sends())
    @rule(data=st.data(), act=one_in(4))
    def send_fails(self, data, act: bool) -> None:
        """A task's link raises instead of taking it."""
        if act:
            send = data.draw(st.sampled_from(self._open_sends()))
            send.sent.set_exception(ConnectionError("link broke"))
            self._settle()

    @precondition(lambda self: any(w.held for w in self.workers))
    @rule(data=st.data(), act=one_in(4))
    def worker_fails_it(self, data, act: bool) -> None:
        """A worker fails the request (``RequestError``) and frees its pages."""
        if act:
            held = [(w, r) for w in self.workers for r in sorted(w.held)]
            w, wire = data.draw(st.sampled_from(held))
            w.release(wire)
            self.outbox.append(RequestError(wire, f"{w.name} failed it", 500))

    @precondition(lambda self: any(w.ready for w in self.workers))
    @rule(data=st.data(), act=one_in(4))
    def worker_declared_dead(self, data, act: bool) -> None:
        """The pool declares a worker dead; a hung one keeps its pages until aborted."""
        if act:
            w = data.draw(st.sampled_from([w for w in self.workers if w.ready]))
            w.ready = False
            self.table.worker_lost(w, f"{w.role} worker {w.name} lost its connection")
            self._settle()

    @precondition(lambda self: not all(w.ready for w in self.workers))
    @rule(data=st.data())
    def worker_comes_back(self, data) -> None:
        """A worker declared dead answers again (it was hung): it may send late messages."""
        data.draw(st.sampled_from([w for w in self.workers if not w.ready])).ready = True

    @rule(action=st.sampled_from(["disconnect", "stop_after_next", "abort"]), act=one_in(6))
    def client(self, action: str, act: bool) -> None:
        """The client leaves (its task cancelled), stops reading after its next event (a stop
        string), or the request is aborted."""
        if not act:
            return
        if action == "disconnect" and not self.reader.done():
            self.disconnected = True
            self.reader.cancel()
        elif action == "stop_after_next":
            self.stop_after_next = True
        elif action == "abort":
            self.table.abort("r")
        self._settle()

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def note_coverage(self) -> None:
        """What the run reached (``pytest --hypothesis-show-statistics`` shows how often)."""
        event(f"request {self.req.state.name.lower()}")
        if self.req.num_attempts > 1:
            event("retried" + (", then streamed" if self.got else ""))
        if any(ev.token_ids for ev in self.got):
            event("tokens reached the reader")

    @invariant()
    def tokens_in_order_from_one_attempt(self) -> None:
        ids = [t for ev in self.got for t in ev.token_ids]
        if ids:
            attempt = ids[0] // 1000 - 1
            assert ids == [token_id(attempt, i) for i in range(len(ids))], ids
            # A retry after a token would have left the reader tokens of an older attempt.
            assert attempt == self.req.num_attempts - 1, (attempt, self.req.num_attempts)

    @invariant()
    def nothing_after_the_end(self) -> None:
        for ev in self.got[:-1]:
            assert ev.error is None and ev.finish_reason is None, self.got
        if self.req.state.is_terminal:
            queued = len(self.req.replies)
            assert self.queued_at_end is None or queued <= self.queued_at_end
            self.queued_at_end = queued
            assert self.req.wire not in self.table.by_wire

    @invariant()
    def counts_and_aborts_stay_sane(self) -> None:
        for w in self.workers:
            assert w.in_flight >= 0
            assert all(n <= 1 for n in w.aborts.values()), (w.name, w.aborts)
            assert set(w.aborts) <= set(w.attempted), (w.name, w.aborts, w.attempted)
            assert len(w.attempted) == len(set(w.attempted))  # one task per attempt
        assert self.req.num_attempts <= 1 + MAX_RETRIES

    @invariant()
    def in_flight_as_counted_on_send(self) -> None:
        """A worker counts the request from its task's send to the attempt's end; the prefill
        worker only until the first token is delivered."""
        req = self.req
        live = req.state in (S.SENDING, S.WAITING, S.STREAMING)
        for w in self.workers:
            counted = live and req.wire in w.attempted
            if w.role == "prefill" and req.next_index > 0:
                counted = False
            assert w.in_flight == int(counted), (w.name, w.in_flight, req.state, req.wire)

    @invariant()
    def an_ended_request_ends_its_reader(self) -> None:
        """Unless it waits for a send to return, the reader is done once the request is."""
        if self.req.state.is_terminal and not self._open_sends():
            assert self.reader.done(), self.req.state

    @invariant()
    def each_worker_released_once_when_done(self) -> None:
        if self.reader.done():
            self._check_released()

    def _check_released(self) -> None:
        req = self.req
        if not self.reader.cancelled():
            assert self.reader.exception() is None, self.reader.exception()
        assert req.state.is_terminal, req.state
        assert [w.in_flight for w in self.workers] == [0] * len(self.workers)
        finished = req.wire if req.state is S.FINISHED else None
        for w in self.workers:
            for wire in w.attempted:
                assert w.aborts[wire] == (0 if wire == finished else 1), (w.name, wire, req.state)
        if self.reader_error is not None:  # a task's send raised: no token can have come
            assert req.state in (S.CLOSED, S.FAILED) and not self.got
        left = self.stop_after_next or self.disconnected or self.reader_error is not None
        if req.state is not S.CLOSED and not left:
            last = self.got[-1]  # the reader read to the end: the end is its last event
            assert (last.finish_reason is not None) == (req.state is S.FINISHED)
            assert (last.error is not None) == (req.state is not S.FINISHED)

    def teardown(self) -> None:
        try:
            if not self.reader.done():
                self.disconnected = True
                self.reader.cancel()
            self._settle()
            self._check_released()
            for w in self.workers:
                assert not w.held, (w.name, w.held)  # every page freed
        finally:
            self.loop.close()


class ColocatedMachine(DisaggMachine):
    """The same request on colocated workers: one target per attempt."""

    colocated = True


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestDisaggRequest = DisaggMachine.TestCase
TestDisaggRequest.settings = MACHINE_SETTINGS
TestColocatedRequest = ColocatedMachine.TestCase
TestColocatedRequest.settings = MACHINE_SETTINGS
