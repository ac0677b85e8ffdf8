"""Priority and preemption rules of the scheduler (``engine.sched.scheduler``), as functions of
the queues they read: which request yields when pages or rows run out, and when a waiting
prompt gets a step without the less urgent rows (decoding or waiting).

The semantics are vLLM's priority scheduling: ``SamplingParams.priority``, lower first, then
arrival; when room runs out the least urgent request is preempted (here retracted: its pages
freed, its KV recomputed later over prompt + output, so its output is unchanged), the latest
admitted among equals. With every priority equal (the default 0) none of these rules changes
anything: requests run first come, first served.

These functions hold no state. The scheduler passes its queues (mutated in place), its prefix
cache, and callbacks for the moves it owns (retracting a running request, freeing the pages of a
waiting one, admission and adapter checks); this module never imports the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from splitserve.engine.kv_pool import pages_for
from splitserve.engine.sched.prefix_cache import BasePrefixCache
from splitserve.engine.sched.request import Req


def insert_by_priority(queue: deque[Req], req: Req, ties_first: bool) -> None:
    """Insert ``req`` into ``queue``, kept sorted by ``sampling.priority`` (lowest first).

    Args:
        queue: the queue, mutated in place; already in priority order.
        req: the request to insert.
        ties_first: True: before the requests of its own priority (a retracted request, which
            came before them); False: after them (a new one: arrival order among equals).

    O(1) when it goes last (the usual case), else O(len(queue)).
    """
    p = req.sampling.priority
    if not queue or (queue[-1].sampling.priority < p if ties_first
                     else queue[-1].sampling.priority <= p):
        queue.append(req)
        return
    for i, other in enumerate(queue):
        q = other.sampling.priority
        if q > p or (ties_first and q == p):
            queue.insert(i, req)
            return
    queue.append(req)


def least_urgent(candidates: Iterable[Req]) -> Req | None:
    """The candidate to preempt: the highest ``sampling.priority`` value, the last of them among
    equals (the running list is in admission order, so the latest admitted).

    Returns: that request, or None when ``candidates`` is empty.
    """
    victim = None
    for req in candidates:
        if victim is None or req.sampling.priority >= victim.sampling.priority:
            victim = req
    return victim


def retract_one(
    running: list[Req], keep: Req, scheduled: list[Req], retract: Callable[[Req], None]
) -> bool:
    """Make pages for the decode row ``keep`` by retracting one other running request.

    The victim is :func:`least_urgent` among the running requests other than ``keep``, not in
    this step's batch so far (``scheduled``: retracting one of those would leave it in the batch
    with no pages), and not more urgent than ``keep`` (a lower ``priority``).

    Args:
        running: the scheduler's running list (read; ``retract`` takes the victim out of it).
        keep: the decode row that needs pages.
        scheduled: the rows already chosen for this step.
        retract: the scheduler's retraction (frees the victim's pages, requeues it as waiting).

    Returns: True if one was retracted; False when there is none (then ``keep`` itself yields).
    """
    victim = least_urgent(r for r in running if r is not keep and r not in scheduled
                          and r.sampling.priority >= keep.sampling.priority)
    if victim is None:
        return False
    retract(victim)
    return True


def make_decode_room(
    cache: BasePrefixCache,
    running: list[Req],
    keep: Req,
    scheduled: list[Req],
    num_pages: int,
    retract: Callable[[Req], None],
) -> bool:
    """Free ``num_pages`` pages for the decode row ``keep``: unpinned cache entries are evicted
    first (``cache.ensure_free``); only when that is not enough are running requests retracted,
    one at a time (:func:`retract_one`), until it is or none is left; then ``keep`` itself
    yields (is retracted).

    Args:
        cache: the prefix cache (evicts on ``ensure_free``).
        running: the scheduler's running list.
        keep: the decode row that needs the pages.
        scheduled: the rows already chosen for this step (never retracted here).
        num_pages: pages ``keep`` needs beyond those it holds (> 0).
        retract: the scheduler's retraction (frees a request's pages, requeues it as waiting).

    Returns: True when the pages are free (the caller allocates them); False when ``keep`` was
    retracted (it leaves this step).
    """
    while not cache.ensure_free(num_pages) and retract_one(running, keep, scheduled, retract):
        pass
    if not cache.ensure_free(num_pages):
        retract(keep)
        return False
    return True


def urgent_class(waiting: deque[Req], running: list[Req], max_batch_tokens: int) -> int | None:
    """The priority whose requests alone make the next step, if any.

    It is the waiting head's priority when the head is strictly more urgent than some running
    request or some other waiting one, and the rest of its prompt fits one step
    (``extend_len <= max_batch_tokens`` tokens: the less urgent decode rows and prompts skip
    one step at most for it; a longer prompt is chunked into the usual steps). The running
    requests as urgent as the head, or more, keep decoding beside it (one urgent request still
    decoding does not send the next into the mixed steps), and the waiting ones as urgent
    start beside it. Without the waiting ones counted, an urgent prompt that found no request
    running (the last batch had just finished) was prefilled together with every less urgent
    prompt waiting: under a flood, 7-9 prompts and 180-230 tokens in a step of 190-350 ms,
    against 40-60 ms for its own step (``bench/overload_priority.py``, 2 cores).

    Returns: that priority, else None (always None with every priority equal, or with the
    waiting queue empty).
    """
    if not waiting:
        return None
    head = waiting[0]
    if head.extend_len > max_batch_tokens:
        return None
    # The queue is in priority order: its last request is its least urgent.
    others = [r.sampling.priority for r in running]
    if len(waiting) > 1:
        others.append(waiting[-1].sampling.priority)
    if others and head.sampling.priority < max(others):
        return head.sampling.priority
    return None


def preempt_for_waiting(
    waiting: deque[Req],
    running: list[Req],
    cache: BasePrefixCache,
    *,
    max_running: int,
    can_admit: Callable[[int], bool],
    acquire_adapter: Callable[[Req], bool],
    retract: Callable[[Req], None],
    restart: Callable[[Req], None],
) -> None:
    """vLLM's priority preemption, run before each step is picked.

    While the most urgent waiting request is a new prompt that could start but for room (too
    few free pages, or ``max_running`` rows all taken), make room from requests strictly less
    urgent than it, the least urgent, latest admitted first (:func:`least_urgent`): running ones
    are retracted; for pages, a less urgent prompt waiting half prefilled gives its pages back
    too (it starts over later). Until it fits or none is left. A head that could not start
    anyway (its KV still loading from a lower tier, its adapter without a slot) makes no room:
    nothing would be gained but recomputing. With every priority equal this does nothing:
    requests wait in arrival order.

    Args:
        waiting: the scheduler's waiting queue, in priority order (its head is the candidate).
        running: the scheduler's running list.
        cache: the prefix cache: ``ready``, and ``match`` / ``unmatch`` of the head's cached
            prefix (matched only while its room is measured; unmatched on every exit).
        max_running: sequences per forward pass.
        can_admit: whether a new sequence needing that many pages may be admitted now
            (``Scheduler.can_admit``).
        acquire_adapter: whether the head holds (or got now) a reference on its LoRA adapter's
            slot; the reference stays for the admission pass.
        retract: retract a running victim (pages freed, back to ``waiting``).
        restart: free the pages of a waiting, half-prefilled victim (it stays where it waits).
    """
    if not waiting or waiting[0].page_ids:
        return
    head = waiting[0]
    urgency = head.sampling.priority
    if not any(r.sampling.priority > urgency for r in (*running, *waiting)):
        return
    if not cache.ready(head):
        return
    cache.match(head)
    try:
        total = pages_for(head.seq_len + 1, cache.page_size) - len(head.page_ids)
        if can_admit(total) and len(running) < max_running:
            return  # room enough: nothing to preempt
        if not acquire_adapter(head):
            return  # the admission pass keeps (and uses) the reference when it gets one
        while True:
            if not can_admit(total):
                victim = least_urgent(r for r in (*running, *waiting)
                                      if r.sampling.priority > urgency
                                      and (r in running or r.page_ids))
            elif len(running) >= max_running:
                victim = least_urgent(r for r in running if r.sampling.priority > urgency)
            else:
                return
            if victim is None:
                return
            if victim in running:
                retract(victim)
            else:  # waiting half prefilled: its pages go, it stays where it waits
                restart(victim)
    finally:
        cache.unmatch(head)


def interrupt_floor(reqs: list[Req], drafts: dict[int, list[int]]) -> int | None:
    """The step's ``ScheduledBatch.interrupt_floor``: its least urgent priority, the bound a
    new prompt must be below to have the step given up (``engine.step_interrupt``; the class
    :func:`urgent_class` then steps alone); None when it runs whole: speculative rows, or a
    row whose last step was given up (``Req.given_up``: no row starves)."""
    if drafts or any(r.given_up for r in reqs):
        return None
    return max(r.sampling.priority for r in reqs)
