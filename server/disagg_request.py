"""The one owner of a request on the workers, as the router runs it: :class:`DisaggRequest`.

A request goes to one prefill and one decode worker at once (docs/design.md, "Processes and
data flow"), or to one colocated worker: the same owner with one target. From its first send
to its last event the owner

- picks each attempt's workers (through its port: the routing policy, the least loaded decode
  worker, the overload limit) and sends each its ``GenerateTask``, the decode worker first (it
  starts reserving pages), whose copy names the prefill worker's inbox;
- merges the prefill worker's first token with the decode worker's stream by output index and
  delivers them, in order, to its one reader;
- keeps each worker's in-flight count (``WorkerHandle.in_flight``, which routing balances):
  counted as its task goes, the prefill worker uncounted once the first token is delivered,
  every worker still counted uncounted exactly once when the attempt ends;
- re-runs the request once on other workers when a worker it depends on is lost before any
  token was delivered, under a new wire rid (``<rid>.retry1``): the old wire rid leaves the
  routing table first, so a late message of the old attempt never touches the new one;
- ends it on a worker's ``RequestError``, a worker lost after a token (503), the reader
  leaving, or :meth:`RequestTable.abort`, and sends ``AbortTask`` to every worker that received
  a task of the attempt (it may hold pages), exactly once per attempt; a finished attempt needs
  none, each of its workers freed its pages itself.

Its states and transition table are in ``server.disagg_transitions``; an event its state does
not list raises ``IllegalTransition``. Every side effect goes through a :class:`DisaggPort`
(the ZeroMQ client; fakes in tests), so it runs with no sockets and no workers
(``tests/server/test_disagg_request.py``). It keeps no time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

import msgspec

from splitserve.ipc.messages import (
    GenerateTask,
    LoraRef,
    RequestError,
    SamplingParams,
    TokenOutput,
    encode,
)
from splitserve.kv_transfer.session import IllegalTransition
from splitserve.server.disagg_transitions import DISAGG_TRANSITIONS, DisaggEvent, DisaggState
from splitserve.server.engine_client import PromptAffinity, TokenEvent
from splitserve.server.replies import Replies

logger = logging.getLogger(__name__)

S, E = DisaggState, DisaggEvent
MAX_RETRIES = 1  # re-runs of a request that lost a worker before producing any token
_LIVE = (S.SENDING, S.WAITING, S.STREAMING)
_STREAMING = S.STREAMING  # a module global: one lookup on the per-token path
_RETRY = object()  # in the replies: the attempt was retried; the reader starts the next one
_END = object()  # in the replies: closed from outside; the reader's stream ends


class DisaggPort(Protocol):
    """What a request does to the world (``server.worker_client``; fakes in tests). A worker is
    the port's own handle, opaque here except for ``role`` (``"prefill"``, ``"decode"`` or
    ``"colocated"``) and identity. ``inbox_addr``: where workers send this router's replies."""

    inbox_addr: str

    def targets(
        self, input_ids: list[int], affinity: PromptAffinity | None, namespace: str | None,
        adapter: str | None = None,
    ) -> list[tuple[Any, str | None]] | TokenEvent:
        """One attempt's workers in sending order, each with the prefill worker's inbox its task
        names (None: it computes the prompt itself); or the 503 event that refuses the request
        (no healthy worker, or one at its in-flight limit). ``namespace``: the request's
        prefix-cache namespace (its tenant's); ``adapter``: the name of its LoRA adapter, whose
        workers it prefers and whose identity the port folds into ``namespace`` before
        cache-aware routing matches in it (``WorkerPool.adapter_key``)."""

    def send_task(self, worker: Any, frame: bytes) -> Awaitable[Any]:
        """Send an encoded ``GenerateTask``; awaiting it waits while the link is full.

        Raises (when awaited): whatever the link raises."""

    def send_abort(self, worker: Any, rid: str) -> None:
        """Send ``AbortTask(rid)`` without blocking, after the tasks already sent to
        ``worker``; a link that is full or gone gets none (the worker's own timeouts free the
        pages)."""

    def count(self, worker: Any) -> None:
        """One more request in flight on ``worker``."""

    def uncount(self, worker: Any) -> None:
        """One request fewer in flight on ``worker``."""

    def heard_from(self, worker: Any) -> None:
        """``worker`` sent tokens: a sign of life besides its heartbeat."""


class RequestTable:
    """The router's requests in flight. ``by_wire``: by the wire rid of each one's current
    attempt, where the inbox reader routes a worker's reply (an attempt enters at ``SEND`` and
    leaves when it ends, so a late reply of an ended attempt goes nowhere). ``by_rid``: by the
    caller's rid, from the request's first event to its last (for :meth:`abort`)."""

    __slots__ = ("by_rid", "by_wire")

    def __init__(self) -> None:
        self.by_wire: dict[str, DisaggRequest] = {}
        self.by_rid: dict[str, DisaggRequest] = {}

    def worker_lost(self, worker: Any, message: str) -> None:
        """``worker`` was declared dead (``message`` says why): every request tells whether it
        depended on it (:meth:`DisaggRequest.on_worker_lost`)."""
        for req in list(self.by_wire.values()):
            req.on_worker_lost(worker, message)

    def abort(self, rid: str) -> None:
        """Close ``rid`` (:meth:`DisaggRequest.close`) if it is in flight. A rid not here has
        no worker holding its pages: each of its attempts finished or was aborted already."""
        req = self.by_rid.get(rid)
        if req is not None:
            req.close()


class DisaggRequest:
    """One request, ``rid``, across its attempts (states: :class:`DisaggState`).

    :meth:`events` runs it and is what ``BaseEngineClient.generate`` returns. The inbox reader
    calls :meth:`on_tokens` and :meth:`on_error` with the replies whose rid is :attr:`wire`,
    the pool :meth:`on_worker_lost` (through :meth:`RequestTable.worker_lost`).

    Args:
        rid: the caller's request id; attempt ``k`` > 0 runs as ``<rid>.retry<k>``.
        input_ids, sampling, cache_namespace, lora: what every task carries (``lora``: the
            LoRA adapter it runs under, None for the base model).
        port: the world (:class:`DisaggPort`).
        table: where it routes itself while in flight.
        affinity: the requests that share its prompt (``PromptAffinity``), for the port.
        metrics: optional ``ServerMetrics``: request outcomes, latencies, retries.
        max_retries: re-runs allowed after a lost worker.
        timing: its ``observe.timing.RequestTiming``: the tasks' send time, the first and last
            token's arrival and the workers' stamps are recorded there (None: not timed).
        trace: its ``server.request_trace.RequestTrace`` (None: not traced): each attempt is
            a span (``attempt``, then ``retry``), whose ``traceparent`` its tasks carry.
    """

    __slots__ = ("_affinity", "_attempt", "_counted", "_heard_from", "_input_ids", "_lora",
                 "_lost", "_max_retries", "_metrics", "_namespace", "_pending", "_port", "_prefill",
                 "_sampling", "_sent_to", "_table", "_timing", "_trace", "_workers",
                 "next_index", "num_attempts", "replies", "rid", "state", "wire")

    def __init__(
        self, rid: str, input_ids: list[int], sampling: SamplingParams, port: DisaggPort,
        table: RequestTable, *, cache_namespace: str | None = None,
        affinity: PromptAffinity | None = None, metrics: Any = None,
        max_retries: int = MAX_RETRIES, lora: LoraRef | None = None, timing: Any = None,
        trace: Any = None,
    ) -> None:
        self.rid = rid
        self.state = S.NEW
        self.wire = ""  # the current (or last) attempt's rid on the wire
        self.num_attempts = 0
        self.next_index = 0  # output tokens delivered to the reader
        self.replies = Replies()  # TokenEvents, or _RETRY / _END
        self._input_ids, self._sampling, self._namespace = input_ids, sampling, cache_namespace
        self._affinity, self._port, self._table = affinity, port, table
        self._lora = lora
        self._metrics, self._max_retries = metrics, max_retries
        self._heard_from = port.heard_from
        self._workers: list[Any] = []  # the attempt's workers, in sending order
        self._prefill: Any = None  # the attempt's prefill worker, if it has one
        self._sent_to: list[Any] = []  # got the attempt's task: aborted unless it finishes
        self._counted: list[Any] = []  # count this request in flight
        self._pending: dict[int, TokenOutput] = {}  # arrived ahead of ``next_index``
        self._timing, self._trace = timing, trace
        self._attempt: Any = None  # the current attempt's span (server.request_trace.Attempt)
        self._lost = ""  # why the last attempt was retried (the retry span says it)

    # ---- the reader -------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Run the request: yield its :class:`TokenEvent` s until one has ``finish_reason`` or
        ``error``; a refused request yields that one error event (503, or 400 for a value the
        wire cannot carry). Closing it early (``aclose``, or cancelling the task iterating it)
        closes the request; an :meth:`close` from elsewhere ends the stream after what was
        delivered.

        Raises:
            Exception: whatever sending a task raised (the request is closed first).
        """
        timing = self._timing
        timer = self._metrics.request_timer(timing) if self._metrics is not None else None
        self._table.by_rid[self.rid] = self
        replies = self.replies
        try:
            while True:
                plan = self.start()
                if isinstance(plan, TokenEvent):
                    if timer is not None:
                        timer.rejected()
                    yield plan
                    return
                for worker, frame in plan:
                    if not self.task_out(worker):
                        break
                    await self._port.send_task(worker, frame)
                self.all_sent()
                while True:
                    item = await replies.get()
                    if item is _RETRY:
                        if self.state is not S.RETRYING:
                            continue  # closed meanwhile: its _END follows
                        if self._metrics is not None:
                            self._metrics.retries.inc()
                        break
                    if item is _END:
                        return
                    if timing is not None:
                        _record(timing, item)
                    if timer is not None:
                        timer.on_event(item)
                    yield item
                    if item.error is not None or item.finish_reason is not None:
                        return
        finally:
            self.close()
            if self._table.by_rid.get(self.rid) is self:
                del self._table.by_rid[self.rid]

    # ---- events -----------------------------------------------------------------------------

    def start(self) -> list[tuple[Any, bytes]] | TokenEvent:
        """Start an attempt (``SEND``): pick its workers, route its wire rid, and return each
        worker with its encoded task, in sending order. Or refuse it (``REFUSE``) and return
        the event that says why; nothing is counted or sent then."""
        self._next(E.SEND)  # REFUSE leaves the same states
        lora = self._lora
        if lora is None:
            targets = self._port.targets(self._input_ids, self._affinity, self._namespace)
        else:  # routed in the adapter's own namespace, to the workers that hold it
            targets = self._port.targets(self._input_ids, self._affinity, self._namespace,
                                         adapter=lora.name)
        if isinstance(targets, TokenEvent):
            return self._refuse(targets)
        wire = self.rid if self.num_attempts == 0 else f"{self.rid}.retry{self.num_attempts}"
        attempt = None
        if self._trace is not None:
            attempt = self._trace.attempt(wire, self.num_attempts, self._lost or None)
        try:
            frames = [encode(GenerateTask(rid=wire, input_ids=self._input_ids,
                                          sampling=self._sampling,
                                          reply_addr=self._port.inbox_addr, prefill_addr=addr,
                                          cache_namespace=self._namespace, lora=lora,
                                          traceparent=attempt and attempt.traceparent))
                      for _, addr in targets]
        except (OverflowError, msgspec.EncodeError) as exc:
            if attempt is not None:
                attempt.end("rejected", str(exc))
            # A number the wire cannot carry (an integer past 64 bits): the request's fault.
            return self._refuse(TokenEvent([], [], error=f"a request value is out of range: {exc}",
                                           error_code=400))
        self._attempt = attempt
        self.num_attempts += 1
        self.wire = wire
        self._workers = [w for w, _ in targets]
        self._prefill = next((w for w in self._workers if w.role == "prefill"), None)
        self._table.by_wire[wire] = self
        self.state = S.SENDING
        return list(zip(self._workers, frames, strict=True))

    def task_out(self, worker: Any) -> bool:
        """``TASK``: ``worker``'s task is about to be sent. From now it counts ``worker`` in
        flight and aborts it unless the attempt finishes. False: the attempt has ended
        meanwhile (retried, failed, closed, finished) and its remaining tasks stay unsent."""
        nxt = self._next(E.TASK)
        if nxt is not S.SENDING and nxt is not S.STREAMING:
            return False
        self._port.count(worker)
        self._counted.append(worker)
        self._sent_to.append(worker)
        return True

    def all_sent(self) -> None:
        """``SENT``: the attempt's sending is over (every task sent, or the attempt ended)."""
        self.state = self._next(E.SENT)
        if self._timing is not None:
            self._timing.sent = time.time()
        if self._attempt is not None:
            self._attempt.routed([w.worker_id for w in self._sent_to])

    def on_tokens(self, out: TokenOutput) -> None:
        """``out`` came for :attr:`wire`. Delivered at once when it is next in output order,
        else held until the gap fills; one already delivered is dropped. Tokens are a sign of
        life of their sender: the first comes from the prefill worker, the rest from the decode
        (or colocated) worker. The first delivered is ``TOKENS`` (or ``FINISH``), the last
        ``FINISH``.

        The inbox reader calls this once per output: the server's hottest path at one user.
        In ``STREAMING`` a token in order takes the table's ``TOKENS`` self-edge without a
        lookup."""
        index = out.index
        pending = self._pending
        if index == self.next_index and not pending:
            if self.state is _STREAMING and out.finish_reason is None:  # TOKENS, a self-edge
                self.next_index = index + len(out.token_ids)
                self.replies.put_nowait(_event(out))
            else:
                self._deliver(out)
        else:
            self._next(E.TOKENS)  # out of order, or already delivered: while an attempt lives
            if index >= self.next_index:
                pending[index] = out
                while self.next_index in pending:  # an end of the attempt empties it
                    self._deliver(pending.pop(self.next_index))
        prefill = self._prefill
        self._heard_from(prefill if index == 0 and prefill is not None else self._workers[0])

    def on_error(self, msg: RequestError) -> None:
        """``WORKER_ERROR``: a worker failed the request; the error ends it (HTTP status
        ``msg.code``) and every worker that got the attempt's task is aborted."""
        self.state = self._next(E.WORKER_ERROR)
        self._end_attempt(abort=True, error=msg.message)
        self.replies.put_nowait(TokenEvent([], [], error=msg.message, error_code=msg.code))

    def on_worker_lost(self, worker: Any, message: str) -> None:
        """``worker`` was declared dead (``message`` says why). Nothing happens unless the
        current attempt depends on it: one of its workers, but not the prefill worker once the
        decode worker sent token 1 (the KV has arrived). Then the attempt ends, its workers
        aborted; before any token and with a retry left the request is re-run (``RETRY``),
        else it fails with 503 (``WORKER_LOST``)."""
        if self.state not in _LIVE or worker not in self._workers:
            return
        if worker is self._prefill and self.next_index > 1:
            return
        retry = self.state is not S.STREAMING and self.num_attempts <= self._max_retries
        self.state = self._next(E.RETRY if retry else E.WORKER_LOST)
        self._lost = message
        self._end_attempt(abort=True, error=message)
        if retry:
            logger.warning("re-running %s: %s", self.rid, message)
            self.replies.put_nowait(_RETRY)
        else:
            self.replies.put_nowait(TokenEvent([], [], error=message, error_code=503))

    def close(self) -> None:
        """``CLOSE``: the reader left, sending a task raised, or an abort. A live attempt's
        workers are uncounted and aborted, and a reader still waiting sees its stream end.
        Once the request has ended it does nothing: call it as often as you like."""
        nxt = self._next(E.CLOSE)
        if nxt is self.state:
            return
        self.state = nxt
        self._end_attempt(abort=True)
        self.replies.put_nowait(_END)

    # ---- inside -----------------------------------------------------------------------------

    def _next(self, event: DisaggEvent) -> DisaggState:
        """The state ``event`` leads to from the current one.

        Raises:
            IllegalTransition: the transition table has no such edge.
        """
        nxt = DISAGG_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise IllegalTransition(f"DisaggRequest {self.rid}: {event.name} in state "
                                    f"{self.state.name}")
        return nxt

    def _refuse(self, event: TokenEvent) -> TokenEvent:
        self.state = self._next(E.REFUSE)
        return event

    def _deliver(self, o: TokenOutput) -> None:
        """Hand ``o``, next in output order, to the reader."""
        if o.finish_reason is None and self.state is _STREAMING:
            nxt = None  # the TOKENS self-edge
        else:
            nxt = self._next(E.TOKENS if o.finish_reason is None else E.FINISH)
        self.next_index += len(o.token_ids)
        self.replies.put_nowait(_event(o))
        if nxt is None:
            return
        self.state = nxt
        if nxt is S.FINISHED:
            self._end_attempt(abort=False)
        elif self._prefill is not None and self._prefill in self._counted:
            # The first token is out: the prefill worker's part is (nearly) done, so it stops
            # counting towards that worker's load, which the routing policy balances.
            self._counted.remove(self._prefill)
            self._port.uncount(self._prefill)

    def _end_attempt(self, *, abort: bool, error: str | None = None) -> None:
        """Uncount every worker still counted and (``abort``) abort every worker that got the
        attempt's task, once; unroute the attempt's wire rid; end its span (``error``: why it
        failed)."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.end("retried" if self.state is S.RETRYING else self.state.name.lower(), error)
        for w in self._counted:
            self._port.uncount(w)
        self._counted.clear()
        if abort:
            for w in self._sent_to:
                self._port.send_abort(w, self.wire)
        self._sent_to.clear()
        self._pending.clear()
        if self._table.by_wire.get(self.wire) is self:
            del self._table.by_wire[self.wire]


def _event(o: TokenOutput) -> TokenEvent:
    """The reader's event for output ``o``."""
    return TokenEvent(o.token_ids, o.logprobs, o.finish_reason, prompt_len=o.prompt_len,
                      cached_len=o.cached_len, cached_by_tier=o.cached_by_tier,
                      prompt_logprobs=o.prompt_logprobs,
                      top_ids=o.top_ids, top_logprobs=o.top_logprobs,
                      prompt_top_ids=o.prompt_top_ids, prompt_top_logprobs=o.prompt_top_logprobs,
                      stamps=o.stamps, grammar_backend=o.grammar_backend,
                      grammar_ignored=o.grammar_ignored)


def _record(timing: Any, ev: TokenEvent) -> None:
    """What reaching the reader tells ``timing`` (``observe.timing.RequestTiming``): the
    workers' stamps, the first and the last token's arrival."""
    if ev.stamps is not None:
        timing.merge(ev.stamps)
    if ev.token_ids and not timing.first:
        timing.first = time.time()
    if ev.finish_reason is not None:
        timing.last = time.time()
