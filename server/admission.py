"""The router's admission gate: how many requests run on the workers at once, who waits, in
which order, and who is told to come back later.

A request takes one of ``slots()`` (``--max-inflight-per-worker`` times the workers that can
take one more request each: :func:`lanes`) from its start on the workers to its end. With every
slot taken, it waits in :class:`~splitserve.server.priority_classes.PriorityClasses`: by its
``priority`` first (lower first, the request field's vLLM semantics, as the workers' schedulers
order), then in a :class:`~splitserve.server.fair_queue.FairQueue` by its tenant (its API key),
so a tenant's burst waits behind its own requests, not in front of everyone's. At most
``max_waiting()`` wait (``--max-queued-per-worker`` per lane); past that, a place is taken back
from the least urgent class waiting: a more urgent arrival, or one of that class whose tenant
has less waiting (for its weight) than the class's heaviest, takes the place of the heaviest
tenant's newest request there (longest queue drop, ``FairQueue.heaviest``), which is refused;
otherwise the arriving request is. A request more urgent than every one waiting and than some
running ones does not wait for a slot: it borrows one of a less urgent running request's (at
most once each, at most ``slots()`` in all), as a worker's scheduler preempts for it. A
refused request is answered 429 with ``Retry-After`` (:attr:`Overload.retry_after_s`). A
request that waits past the router's deadline (``--max-queue-wait``) is refused the same way
(:meth:`AdmissionGate.expire`); the client's timer calls it.

Events in, actions out: :meth:`AdmissionGate.enter` and :meth:`AdmissionGate.leave` are the
events, the ``wake`` callback each ticket carries is the action (the ZeroMQ client resolves a
future there). The clock is injected; it only measures how long requests hold their slots, for
the ``Retry-After`` estimate. No event loop here: tests drive it step by step.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from splitserve.server.fair_queue import FairQueue
from splitserve.server.priority_classes import PriorityClasses

MIN_RETRY_AFTER_S = 1.0  # Retry-After has whole seconds; 0 would make clients hammer us
# openai-python (and Anthropic's client) honour Retry-After up to 120 s and give up past it;
# a minute keeps clients retrying while a long queue drains.
MAX_RETRY_AFTER_S = 60.0
HOLD_EWMA = 0.2  # weight of the newest slot hold time in the running mean


@dataclass(eq=False, slots=True)
class Ticket:
    """One request at the gate: ``admitted`` once it holds a slot; ``wake`` is called (once)
    when a waiting ticket is admitted, or pushed out of a full queue (``refusal`` set then).
    ``entered_s``/``admitted_s``: clock readings."""

    tenant: Hashable
    wake: Callable[[], None]
    entered_s: float
    priority: int = 0
    admitted: bool = False
    admitted_s: float = 0.0
    left: bool = False
    refusal: Overload | None = None


@dataclass(frozen=True, slots=True)
class Overload:
    """A refusal: the queue is full. ``retry_after_s``: when a place is likely free."""

    message: str
    retry_after_s: float


class AdmissionGate:
    """Slots on the workers, and a fair queue in front of them.

    Args:
        slots: how many requests may run at once now (0: no worker can take one; then nobody
            waits: the request goes on and the client answers 503, no healthy worker).
        max_waiting: how many may wait now (0: none; past ``slots()``, refused at once).
        new_queue: a new empty ``FairQueue`` for one priority class (default: weight 1 for
            every tenant, fair); its ``fair`` switch is the gate's.
        clock: seconds, monotonic (default ``time.monotonic``).
    """

    def __init__(self, slots: Callable[[], int], max_waiting: Callable[[], int],
                 new_queue: Callable[[], FairQueue[Ticket]] = FairQueue,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots, self.max_waiting = slots, max_waiting
        self.queue: PriorityClasses[Ticket] = PriorityClasses(new_queue)
        self.clock = clock
        self.in_use = 0  # admitted tickets that have not left
        self._running: collections.Counter[int] = collections.Counter()  # in_use by priority
        self.hold_s = 0.0  # running mean of how long a request holds its slot (0: none yet)
        self.num_admitted = 0
        self.num_queued = 0  # admitted after waiting
        self.num_refused = 0  # refused at arrival or pushed out of the full queue
        self.num_expired = 0  # refused after waiting past the deadline

    @property
    def lending(self) -> bool:
        """More requests run than there are slots: some borrowed a less urgent one's."""
        slots = self.slots()
        return bool(slots) and self.in_use > slots

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def enter(self, tenant: Hashable, wake: Callable[[], None],
              priority: int = 0) -> Ticket | Overload:
        """A request of ``tenant`` arrives (``priority``: lower is more urgent). Returns its
        ticket, admitted at once when a slot is free and nobody waits (``wake`` is not called
        then), else waiting (``wake`` is called when it is admitted, or when a more urgent or
        lighter tenant's request pushes it out of the full queue: ``refusal`` set); or the
        :class:`Overload` that refuses it (nothing held)."""
        if self.queue:
            self.dispatch()  # slots may have grown since the last leave (a worker joined)
        now = self.clock()
        ticket = Ticket(tenant, wake, now, priority)
        slots = self.slots()
        if (slots == 0 or (not self.queue and self.in_use < slots)
                or self._may_preempt(priority, slots)):
            self._admit(ticket, now)
            return ticket
        limit = self.max_waiting()
        if len(self.queue) >= limit:
            refusal = self._overload(slots, limit)
            victim = self._victim(tenant, priority) if limit else None
            if victim is None:
                self.num_refused += 1
                return refusal
            pushed_out = self.queue.pop_newest(*victim)
            assert pushed_out is not None
            self.num_refused += 1
            pushed_out.left, pushed_out.refusal = True, refusal
            pushed_out.wake()
        self.queue.push(priority, tenant, ticket)
        return ticket

    def _may_preempt(self, priority: int, slots: int) -> bool:
        """Whether a request at ``priority`` is admitted past the slots, as a worker's
        scheduler preempts for it (vLLM's priority preemption, one level up): it is more urgent
        than every request waiting, and more requests less urgent than it are running than
        slots are already over-used, and fewer than twice ``slots`` are in use. So a slot of a
        running less urgent request is lent at most once, and never more than ``slots`` in
        all; what is lent comes back as requests end (no waiting request is admitted while
        ``in_use`` >= ``slots``)."""
        most_urgent_waiting = self.queue.most_urgent()
        if most_urgent_waiting is not None and most_urgent_waiting <= priority:
            return False
        if self.in_use >= 2 * slots:
            return False
        less_urgent = sum(n for p, n in self._running.items() if p > priority)
        return less_urgent > self.in_use - slots

    def _victim(self, tenant: Hashable, priority: int) -> tuple[int, Hashable] | None:
        """Whose newest waiting request a full queue refuses to make room for one of
        ``tenant`` at ``priority``: the heaviest tenant of the least urgent class waiting, if
        the arrival is more urgent than that class, or of it and lighter than that tenant;
        None: the arrival itself is refused."""
        least = self.queue.least_urgent()
        if least is None or priority > least:
            return None
        heaviest = self.queue.heaviest(least)
        assert heaviest is not None
        if priority == least and not self.queue.backlog(least, tenant, 1) < heaviest[1]:
            return None
        return least, heaviest[0]

    def leave(self, ticket: Ticket) -> None:
        """``ticket``'s request ended (or gave up waiting): its slot or its place is freed and
        the next waiting tickets are admitted. Idempotent."""
        if ticket.left:
            return
        ticket.left = True
        if not ticket.admitted:
            self.queue.remove(ticket.priority, ticket.tenant, ticket)
            return
        self.in_use -= 1
        self._running[ticket.priority] -= 1
        if not self._running[ticket.priority]:
            del self._running[ticket.priority]  # any int32 may come: keep only those running
        held = self.clock() - ticket.admitted_s
        self.hold_s = held if not self.hold_s else (1 - HOLD_EWMA) * self.hold_s + HOLD_EWMA * held
        self.dispatch()

    def expire(self, ticket: Ticket, limit_s: float) -> Overload | None:
        """``ticket`` has waited ``limit_s`` seconds (the router's ``--max-queue-wait``): it
        leaves the queue and this returns the refusal to answer it with (429, ``Retry-After``
        as for a full queue). None, and nothing changes, if it is no longer waiting (admitted
        or gone in the meantime)."""
        if ticket.admitted or ticket.left:
            return None
        self.leave(ticket)
        self.num_expired += 1
        waited = self.clock() - ticket.entered_s
        slots = self.slots()
        wait = self.retry_after_s(slots)
        return Overload(f"server overloaded: waited {waited:.1f} s for one of {slots} slots "
                        f"(limit {limit_s:g} s, --max-queue-wait) with {len(self.queue)} "
                        f"others waiting; retry after {wait:.0f} s", wait)

    def dispatch(self) -> list[Ticket]:
        """Admit waiting tickets while slots are free (all of them when ``slots()`` is 0: no
        worker is left, and each is answered at once), waking each; returns them in order.
        The client calls this when capacity may have grown (a worker ready, resumed)."""
        admitted = []
        now = self.clock()
        while self.queue:
            slots = self.slots()
            if slots and self.in_use >= slots:
                break
            ticket = self.queue.pop()
            assert ticket is not None
            self._admit(ticket, now)
            self.num_queued += 1
            admitted.append(ticket)
            ticket.wake()
        return admitted

    def _overload(self, slots: int, limit: int) -> Overload:
        wait = self.retry_after_s(slots)
        return Overload(f"server overloaded: {self.in_use} requests running on {slots} slots "
                        f"and {len(self.queue)} waiting (limit {limit}); retry after "
                        f"{wait:.0f} s", wait)

    def retry_after_s(self, slots: int | None = None) -> float:
        """Seconds until the requests waiting now are likely admitted: each of the ``slots``
        frees after a request's mean hold time, so ``waiting`` are through in about
        ``waiting * hold / slots`` (at least :data:`MIN_RETRY_AFTER_S`, at most
        :data:`MAX_RETRY_AFTER_S`)."""
        slots = self.slots() if slots is None else slots
        estimate = len(self.queue) * self.hold_s / max(1, slots)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def _admit(self, ticket: Ticket, now: float) -> None:
        ticket.admitted, ticket.admitted_s = True, now
        self.in_use += 1
        self._running[ticket.priority] += 1
        self.num_admitted += 1


def lanes(workers: Iterable[object]) -> int:
    """How many requests-at-a-time units the live workers make: the colocated workers that are
    ready and not draining, plus, of the disaggregated pools, the smaller (a request holds a
    decode worker to its end and a prefill worker to its first token, so the smaller pool
    bounds them). Each worker is read for ``role``, ``ready`` and ``draining``."""
    count = {"prefill": 0, "decode": 0, "colocated": 0}
    for w in workers:
        if w.ready and not w.draining:  # type: ignore[attr-defined]
            count[w.role] += 1  # type: ignore[attr-defined]
    return count["colocated"] + min(count["prefill"], count["decode"])


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1) and ``retry-after-ms``, which the OpenAI
    and Anthropic Python clients read first, for a refusal that says ``retry_after_s``."""
    return {"Retry-After": str(max(1, math.ceil(retry_after_s))),
            "retry-after-ms": str(max(1, round(retry_after_s * 1000)))}
