"""The prefill<->decode KV handoff as one explicit state machine per request and side.

docs/design.md ("KV transfer") names a transfer's states (bootstrapping -> waiting_for_pages ->
transferring -> done | failed), gives every state a timeout and lets ``failed`` always win.
Each worker keeps one session per request it hands over or receives: a
:class:`~splitserve.kv_transfer.send_session.SendSession` on the prefill side, a
:class:`~splitserve.kv_transfer.recv_session.RecvSession` on the decode side. A session owns
what the handoff knows of its request: its state, that state's deadline, keepalive timing, the
acknowledgement owed or awaited, and the fence. Each side's events and transition table are in
its module; this one holds what both share:

- :class:`TransferState`: the states of either side;
- :class:`BaseSession`: the transition-table check (an event that a state does not list raises
  :class:`IllegalTransition`, so a bug is loud rather than a request silently stuck), the
  deadline and the clock;
- :class:`SessionContext`: what one side's sessions share (the timeout, the clock, the port);
- :class:`SessionTable`: one side's sessions by rid, which the worker asks (``get``,
  ``expire``, ``by_state``, ``abort``). A session leaves its table when it reaches ``DONE`` or
  ``FAILED``.

Time comes from an injected clock (``time.monotonic`` in workers, a fake in tests), and every
side effect (sending a message, freeing a request's pages, reporting a failure to the server,
reading link drops) goes through a small port that the worker implements: the sessions run
with no model and no sockets (``tests/kv_transfer/test_session.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar


class TransferState(enum.Enum):
    """Where one request's KV handoff stands on one side. Deadlines are ``transfer_timeout_s``.

    Prefill side (:class:`~splitserve.kv_transfer.send_session.SendSession`):

    =================== ============================================= ========================
    state               meaning; deadline                             exits
    =================== ============================================= ========================
    WAITING_FOR_TASK    the bootstrap came before the task; from      TRANSFERRING (task),
                        entry                                         FAILED (deadline, abort)
    BOOTSTRAPPING       computing, no bootstrap yet; from entry,      TRANSFERRING, PREFILLED,
                        restarted by each ``KVQueued``                FAILED, RELEASING
    PREFILLED           first token sampled, pages held for the       DRAINING (bootstrap),
                        send, no bootstrap yet; BOOTSTRAPPING's,      FAILED, RELEASING
                        still restarted by ``KVQueued``
    TRANSFERRING        bootstrapped, computing: complete pages go    DRAINING (first token),
                        out after every step, keepalives in between;  FAILED, RELEASING
                        none (it ends with the compute)
    DRAINING            last message sent, the backend may still      DONE (read, or deadline),
                        read the source pages; from entry             RELEASING
    RELEASING           the decode worker failed it and asked for     FAILED (acknowledged, or
                        ``KVReleased``: owed once no write of it is   deadline: not
                        in flight; from entry                         acknowledged)
    =================== ============================================= ========================

    Decode side (:class:`~splitserve.kv_transfer.recv_session.RecvSession`):

    =================== ============================================= ========================
    state               meaning; deadline                             exits
    =================== ============================================= ========================
    QUEUED              waiting for pages to reserve, ``KVQueued``    WAITING_FOR_PAGES,
                        keepalives out; from entry, restarted by      FAILED
                        each one delivered while the link holds
    WAITING_FOR_PAGES   pages reserved and bootstrap sent, KV         KV_READY, DONE (first
                        arriving; from entry, restarted by every      token ended it), FENCED,
                        message of the request                        FAILED
    KV_READY            every page installed, the first token known;  DONE (handed to the
                        none (its grammar compile has its own)        scheduler), FAILED
    FENCED              failed with a one-sided backend: pages held   FAILED (``KVReleased``,
                        until the prefill worker stops writing; from  link drop, deadline)
                        entry
    =================== ============================================= ========================

    Both, terminal: DONE (prefill: every page sent, then freed; decode: handed to the scheduler,
    or freed when the first token ended the request) and FAILED (every page of the request freed
    on this side, after its fence if it had one).
    """

    # prefill side
    WAITING_FOR_TASK = "waiting_for_task"
    BOOTSTRAPPING = "bootstrapping"
    PREFILLED = "prefilled"
    TRANSFERRING = "transferring"
    DRAINING = "draining"
    RELEASING = "releasing"
    # decode side
    QUEUED = "queued"
    WAITING_FOR_PAGES = "waiting_for_pages"
    KV_READY = "kv_ready"
    FENCED = "fenced"
    # both
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class IllegalTransition(RuntimeError):
    """An event that the session's state does not allow (a bug in the caller or the peer)."""


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What every session of one side shares (each side adds its port and backend).

    ``timeout_s``: ``transfer_timeout_s``: every deadline is this long after its start.
    ``clock``: seconds, monotonic (``time.monotonic``; a fake in tests).
    """

    timeout_s: float
    clock: Callable[[], float]


S = TypeVar("S", bound="BaseSession")


class SessionTable(Generic[S]):
    """One side's live sessions by rid, in arrival order. A session that reached ``DONE`` or
    ``FAILED`` is gone from every answer (dropped lazily: sessions do not point back here, so
    no reference cycle keeps a dropped worker's sockets alive)."""

    def __init__(self) -> None:
        self._by_rid: dict[str, S] = {}

    def _add(self, session: S) -> S:
        if self.get(session.rid) is not None:
            raise ValueError(f"a KV transfer session for {session.rid} already exists")
        self._by_rid[session.rid] = session
        return session

    def _live(self) -> list[S]:
        for rid in [rid for rid, s in self._by_rid.items() if s.state.is_terminal]:
            del self._by_rid[rid]
        return list(self._by_rid.values())

    def get(self, rid: str) -> S | None:
        """The live session of ``rid``, or None (never seen, or ended)."""
        session = self._by_rid.get(rid)
        if session is not None and session.state.is_terminal:
            del self._by_rid[rid]
            return None
        return session

    def __contains__(self, rid: str) -> bool:
        return self.get(rid) is not None

    def __len__(self) -> int:
        return len(self._live())

    def __iter__(self) -> Iterator[S]:
        return iter(self._live())

    def by_state(self, *states: TransferState) -> list[S]:
        """The sessions in any of ``states``, in arrival order (a copy: safe to act on)."""
        return [s for s in self._live() if s.state in states]

    def expire(self, now: float) -> list[S]:
        """The sessions whose deadline passed at ``now``; the caller calls their ``time_out``."""
        return [s for s in self._live() if s.deadline is not None and s.deadline < now]

    def abort(self, rid: str) -> S | None:
        """Abort ``rid``'s session (its ``abort``) if there is one; returns it, or None."""
        session = self.get(rid)
        if session is not None:
            session.abort()
        return session


class BaseSession:
    """What both sides' sessions share: ``rid``, ``state`` and its ``deadline``.

    ``transitions`` lists the allowed ``(state, event) -> next state`` edges. An event handler
    first asks :meth:`_next` (which raises :class:`IllegalTransition` before any side effect),
    acts, then :meth:`_enter`\\ s the state; an edge back to the same state is a message that
    changes nothing there (late, or already failed). Failing while handling an event takes the
    failure's own edge instead.
    """

    def __init__(
        self,
        rid: str,
        state: TransferState,
        ctx: SessionContext,
        transitions: Mapping[tuple[TransferState, enum.Enum], TransferState],
    ) -> None:
        self.rid = rid
        self.state = state
        self.deadline: float | None = None  # ctx.clock time; None: this state has none
        self.transitions = transitions
        self._ctx = ctx

    def abort(self) -> None:
        raise NotImplementedError

    def time_out(self) -> None:
        """The deadline passed (:meth:`SessionTable.expire`)."""
        raise NotImplementedError

    def _next(self, event: enum.Enum) -> TransferState:
        """The state ``event`` leads to from the current one.

        Raises:
            IllegalTransition: the transition table has no such edge.
        """
        nxt = self.transitions.get((self.state, event))
        if nxt is None:
            raise IllegalTransition(
                f"{type(self).__name__} {self.rid}: {event.name} in state {self.state.name}"
            )
        return nxt

    def _now(self) -> float:
        return self._ctx.clock()

    def _restart_deadline(self) -> None:
        self.deadline = self._now() + self._ctx.timeout_s

    def _enter(self, state: TransferState, *, timed: bool | None = None) -> None:
        """Go to ``state``; ``timed``: start its deadline now (True), clear it (False) or keep
        the current one (None). A terminal state ends the session (its table drops it)."""
        self.state = state
        if state.is_terminal or timed is False:
            self.deadline = None
        elif timed:
            self._restart_deadline()
