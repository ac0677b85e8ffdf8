"""Continuous batching: every step admits, extends, decodes and retires requests under a token
budget, so a request's output does not depend on what else runs (chunked prefill as in
Sarathi-Serve / SGLang; retraction on page exhaustion as in SGLang).

The scheduler never runs the model. One step is :meth:`Scheduler.schedule` (decide the batch
and allocate its pages: a :class:`~splitserve.engine.sched.batch.ScheduledBatch`), the model
runner's ``run`` (a :class:`~splitserve.engine.sched.batch.ModelOutput`), then
:meth:`Scheduler.update` (advance the requests, retire the finished ones); ``engine.core`` is
that loop. Every page goes through the prefix cache (a no-op one when off), and every
allocation is check-then-act: a request is admitted whole or not at all.

Used by all three worker roles: the colocated worker prefills and decodes; the prefill worker
prefills only (a request stops computing as soon as its first token is sampled, and its pages
stay held while its KV is sent); the decode worker decodes requests whose KV arrived, and
re-prefills locally the requests it had to retract.

The scheduler owns every page a request holds. A request is in exactly one of its queues:

================  =========================================================  ==================
state             meaning                                                    pages
================  =========================================================  ==================
WAITING           needs prefill here (new, or retracted): ``waiting``        from admission on
RUNNING           decoding: exactly one token missing its KV: ``running``    yes
WAITING_FOR_KV    its prompt's KV comes from a prefill worker (decode        once admitted
                  worker): queued for admission (``waiting_for_kv``), then
                  admitted with its pages reserved while the KV arrives
                  (``receiving_kv``)
SENDING_KV        prefilled here (prefill worker): its pages are held        yes
                  while its KV is sent: ``sending_kv``
================  =========================================================  ==================

Admission is one rule (:meth:`Scheduler.can_admit`) for the scheduler's own prompts and for the
reservations of requests whose KV is coming (:meth:`Scheduler.admit_waiting_for_kv`). Both queues
are ordered by ``SamplingParams.priority`` (lower first, vLLM's semantics), then arrival; when
pages run out the least urgent running request is retracted (recomputed later), and a waiting
prompt more urgent than running ones preempts them, in pages or in ``max_running`` rows
(:func:`~splitserve.engine.sched.preemption.preempt_for_waiting`); one more urgent than some
running or waiting request is computed in a step without the less urgent rows, decoding or
waiting (:func:`~splitserve.engine.sched.preemption.urgent_class`); the rules live in
``engine.sched.preemption``. With every priority equal (the default 0) this is first come, first
served. A request under a LoRA adapter is also admitted only with a reference on its adapter's
slot (``engine.lora``), held until its pages are freed; one whose adapter gets no slot yet waits
without holding up the requests behind it, and its adapter is named to the slots so that one is
drained for it (``engine.lora.slots``; the references:
:class:`~splitserve.engine.sched.adapter_refs.AdapterRefs`). A request in a KV handoff leaves
through :meth:`Scheduler.release` (its transfer session ended) or, its KV arrived,
:meth:`Scheduler.add_received`.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from itertools import chain

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import pages_for
from splitserve.engine.lora.manager import LoraManager
from splitserve.engine.sched.adapter_refs import AdapterRefs
from splitserve.engine.sched.batch import ModelOutput, ScheduledBatch, StepOutput, Verified
from splitserve.engine.sched.ngram import draft_tokens
from splitserve.engine.sched.preemption import (
    insert_by_priority,
    interrupt_floor,
    make_decode_room,
    preempt_for_waiting,
    urgent_class,
)
from splitserve.engine.sched.prefix_cache import BasePrefixCache
from splitserve.engine.sched.request import Req

logger = logging.getLogger(__name__)


class Received(enum.Enum):
    """What became of a request whose KV arrived (:meth:`Scheduler.add_received`)."""

    RUNNING = "running"  # it decodes from the next step
    FINISHED = "finished"  # its first token (or the tokens its grammar forced) ended it: freed
    REFUSED = "refused"  # its grammar refused the first token the prefill worker sampled: freed


class Scheduler:
    """Queues of one worker and the policy that turns them into forward passes.

    Args:
        cache: the prefix cache; it owns the pool's allocator and page size, and every page a
            request gets or gives back goes through it.
        engine: the budgets it reads: ``max_batch_tokens`` (new tokens per forward pass,
            prefill chunks and decodes together), ``chunked_prefill_size`` (prompt tokens per
            pass beside decode rows), ``max_running`` (sequences per pass) and
            ``jump_forward`` (append the tokens a grammar forces without sampling them).
        eos_token_ids: tokens that end an output (unless the request ignores EOS).
        prefill_only: the prefill worker's scheduler: a request stops computing with its first
            token (``SENDING_KV``: its pages held for the KV send) and never jumps forward.
        lora: the worker's LoRA adapters (their slots), or None: no request has one.
    """

    def __init__(self, cache: BasePrefixCache, engine: EngineConfig, eos_token_ids: list[int],
                 prefill_only: bool = False, lora: LoraManager | None = None) -> None:
        self.cache = cache
        self.allocator = cache.allocator
        self.page_size = cache.page_size
        self.max_batch_tokens = engine.max_batch_tokens
        self.max_running = engine.max_running
        self.chunked_prefill_size = engine.chunked_prefill_size or engine.max_batch_tokens
        self.jump_forward_on = engine.jump_forward and not prefill_only
        # Speculative decoding (engine.sched.ngram): drafts per decoding row, 0 when off.
        self.num_draft = (
            engine.num_speculative_tokens
            if engine.speculative == "ngram" and not prefill_only else 0
        )
        self.speculative_max_running = engine.speculative_max_running
        self.num_draft_tokens = 0  # drafted since start
        self.num_accepted_tokens = 0  # of those, kept by verification
        self.prefill_only = prefill_only
        self.lora = lora
        self.adapters = AdapterRefs(lora)  # requests' references on their adapters' slots
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()  # need more than one token of KV: new or retracted
        self.running: list[Req] = []  # decoding: exactly one token missing its KV
        # WAITING_FOR_KV: not admitted yet (no pages), in arrival order; then admitted (pages
        # reserved) while the KV arrives, or while a failed one's pages stay fenced.
        self.waiting_for_kv: deque[Req] = deque()
        self.receiving_kv: list[Req] = []
        self.sending_kv: list[Req] = []  # SENDING_KV: prefilled, pages held while KV is sent
        self.num_retracted = 0
        self.last_num_scheduled = 0  # sequences in the last step; 0 means it could not run any

    # ---- queue management -------------------------------------------------------------------

    def fits_pool(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens could ever fit in this pool."""
        return pages_for(num_tokens, self.page_size) <= self.allocator.num_pages - 1

    def can_admit(self, num_pages: int) -> bool:
        """Whether a new sequence needing ``num_pages`` pages may be admitted now: they must be
        free (after evicting unpinned cache entries) with one page of headroom per running
        request, so that admitting never forces a running request to retract. The one rule of
        admission, for the scheduler's own prompts and the reservations of requests whose KV is
        coming (:meth:`admit_waiting_for_kv`)."""
        return self.cache.ensure_free(num_pages + len(self.running))

    def add(self, req: Req) -> None:
        """Queue a request that needs prefill (new, or pages installed but not all of them):
        after every waiting request of the same or a more urgent priority (lower
        ``sampling.priority``), so the queue runs by priority, then arrival. The prefix cache
        starts loading what its lower tiers hold of the prompt meanwhile."""
        insert_by_priority(self.waiting, req, ties_first=False)
        self.cache.prefetch(req)

    def add_running(self, req: Req) -> None:
        """Queue a request whose KV is complete but for its last tokens: the sampled token, plus
        any its grammar forced after it (jump-forward)."""
        assert req.extend_len >= 1, "add_running needs at least one token without KV"
        self.running.append(req)

    def add_waiting_for_kv(self, req: Req) -> None:
        """Queue a request whose prompt's KV a prefill worker computes (``WAITING_FOR_KV``): it
        holds no pages until :meth:`admit_waiting_for_kv` reserves them, by priority, then
        arrival."""
        insert_by_priority(self.waiting_for_kv, req, ties_first=False)

    def admit_waiting_for_kv(self) -> list[Req]:
        """Reserve the prompt's pages of each queued ``WAITING_FOR_KV`` request, by priority
        then arrival, while :meth:`can_admit` allows (the first that does not fit stops the
        rest; one whose adapter has no slot yet is passed over).

        Returns: the requests admitted now, each with ``page_ids`` = its reservation (the pages
        its KV is to be written into), in arrival order."""
        admitted: list[Req] = []
        self.adapters.want(chain(self.waiting, self.waiting_for_kv))
        for req in list(self.waiting_for_kv):
            if not self.adapters.acquire(req):
                continue  # its adapter has no slot yet: the others go ahead
            num_pages = pages_for(req.prompt_len, self.page_size)
            if not self.can_admit(num_pages):
                self.adapters.release(req)
                break
            self.waiting_for_kv.remove(req)
            req.page_ids = self.allocator.alloc(num_pages)
            self.receiving_kv.append(req)
            admitted.append(req)
        return admitted

    def add_received(self, req: Req) -> Received:
        """An admitted ``WAITING_FOR_KV`` request's KV is in its pages, and its first token
        (sampled by the prefill worker) is its one output token without KV. A constrained
        request replays that token into its grammar first (a refused one is freed:
        ``REFUSED``), then is checked for its end and may jump forward, as after any sampled
        token (ended: freed, ``FINISHED``; the caller reports its tokens). Otherwise it runs
        from the next step (``RUNNING``)."""
        self.receiving_kv.remove(req)
        if req.grammar is not None:
            if not req.grammar.accept(req.output_ids[-1]):
                self.free(req)
                return Received.REFUSED
            if self._ends(req):
                self.free(req)
                return Received.FINISHED
        self.add_running(req)
        return Received.RUNNING

    def abort(self, rid: str) -> Req | None:
        """Remove ``rid`` from the waiting and running queues and free its pages. Returns it, or
        None if absent. A request in a KV handoff leaves through :meth:`release` (its transfer
        session decides when: a fenced reservation outlives the abort)."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.free(req)
                    return req
        return None

    def release(self, req: Req) -> None:
        """Take ``req`` (this object) out of whichever queue holds it, if any, and free its
        pages: its KV handoff ended (sent, failed, aborted, timed out) or it was dropped while
        its grammar compiled (then it holds none)."""
        for queue in (self.waiting_for_kv, self.receiving_kv, self.sending_kv, self.waiting,
                      self.running):
            if req in queue:
                queue.remove(req)
                break
        self.free(req)

    def free(self, req: Req) -> None:
        """Give back ``req``'s pages: its computed KV goes to the prefix cache (when on), the
        rest to the pool. Afterwards ``req`` holds no pages and ``kv_len == 0``. The queues are
        the caller's: a queued request is taken out by :meth:`release` or :meth:`abort`. Its
        reference on its adapter's slot goes too."""
        self.cache.release(req)
        self.adapters.release(req)

    def check_pages(self) -> None:
        """Every used page is either the cache's or one request's, in whichever state (waiting,
        running, waiting for or receiving its KV, sending it).

        Raises:
            AssertionError: pages leaked or were counted twice.
        """
        queues = (self.waiting, self.running, self.waiting_for_kv, self.receiving_kv,
                  self.sending_kv)
        held = sum(len(r.page_ids) - r.matched_len // self.page_size
                   for queue in queues for r in queue)
        used, cached = self.allocator.num_used, self.cache.stats().cached_pages
        assert used == cached + held, (used, cached, held)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Choose the next forward pass and allocate its pages; None when nothing can run (no
        work, or every request waits for pages). Decodes first, then prompt chunks by
        priority, then arrival, under ``max_batch_tokens``; a waiting prompt more urgent than
        some running or waiting request gets a step without the less urgent rows."""
        drafts: dict[int, list[int]] = {}
        reqs, chunks = self._schedule(drafts)
        self.last_num_scheduled = len(reqs)
        if not reqs:
            return None
        sample_rows = [
            i for i, (r, n) in enumerate(zip(reqs, chunks)) if n == r.extend_len or i in drafts
        ]
        scored = [i for i, (r, n) in enumerate(zip(reqs, chunks)) if _scores_prompt(r, n)]
        # A prefill worker's rows never decode here: no bounds, so nothing reserves for them.
        max_lens = [] if self.prefill_only else [
            r.prompt_len + r.sampling.max_new_tokens - 1 for r in reqs
        ]
        return ScheduledBatch(reqs, chunks, sample_rows, scored, drafts, max_lens,
                              interrupt_floor(reqs, drafts))

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> list[StepOutput]:
        """Apply what the runner computed for ``batch`` (from :meth:`schedule`, run once):
        advance every request's KV, record prompt logprobs, append the sampled tokens, retire
        finished requests (freeing their pages) and move prefill-only ones to ``SENDING_KV``.
        Returns: one :class:`StepOutput` per sampled token."""
        reqs, chunks = batch.reqs, batch.chunk_lens
        for r in reqs:
            r.given_up = False
        for j, (i, logprobs) in enumerate(zip(batch.scored_rows, output.prompt_logprobs)):
            reqs[i].prompt_logprobs.extend(logprobs)
            if output.prompt_top_ids:
                reqs[i].prompt_top_ids.extend(output.prompt_top_ids[j])
                reqs[i].prompt_top_logprobs.extend(output.prompt_top_logprobs[j])
        for i, (r, n) in enumerate(zip(reqs, chunks)):
            if i in batch.drafts:
                # KV is valid up to the last kept draft token; the rest of the chunk's slots are
                # overwritten when the sequence reaches them.
                r.kv_len += output.verified[i].accepted + 1
                continue
            r.kv_len += n
            if n > 1:  # a prefill chunk (or jump-forward tokens): reusable by later prompts now
                self.cache.cache_prefix(r)
        outs = []
        for j, (i, tok, lp) in enumerate(
            zip(batch.sample_rows, output.token_ids, output.logprobs)
        ):
            if i in batch.drafts:
                outs.append(self._append_verified(reqs[i], output.verified[i]))
                continue
            top = (output.top_ids[j], output.top_logprobs[j]) if output.top_ids else None
            outs.append(self._append_token(reqs[i], tok, lp, top))
        return outs

    def _append_verified(self, req: Req, verified: Verified) -> StepOutput:
        """Append a running request's verified draft tokens and the token after them, up to the
        first that finishes it (EOS, a stop token, ``max_new_tokens``)."""
        self.num_accepted_tokens += verified.accepted
        finished = False
        for tok, lp in zip(verified.tokens, verified.logprobs):
            req.append_output(tok, lp)
            if req.grammar is not None and not req.grammar.accept(tok):
                # The masks allowed only what the grammar accepts: a bug, as in _append_token.
                logger.error("request %s: grammar refused verified token %d", req.rid, tok)
                req.finish_reason = "stop"
            if req.check_finished(self.eos_token_ids) is not None:
                finished = True
                break
        if not finished:
            finished = self.jump_forward(req)
        if finished:
            self.running.remove(req)
            self.free(req)
        return StepOutput(req, req.output_ids[-1], req.output_logprobs[-1], finished)

    def _append_token(
        self,
        req: Req,
        token_id: int,
        logprob: float,
        top: tuple[list[int], list[float]] | None = None,
    ) -> StepOutput:
        was_waiting = req in self.waiting  # O(len(waiting)): only prefill rows get here
        req.append_output(token_id, logprob, *(top or (None, None)))
        if req.grammar is not None and not req.grammar.accept(token_id):
            # The mask allowed only what the grammar accepts, so this is a bug; end the output
            # rather than emit text that breaks the constraint.
            logger.error("request %s: grammar refused sampled token %d", req.rid, token_id)
            req.finish_reason = "stop"
        finished = self._ends(req)
        if was_waiting:
            self.waiting.remove(req)
        elif finished:
            self.running.remove(req)
        if self.prefill_only and was_waiting:
            self.adapters.release(req)  # it computes nothing more here
            self.sending_kv.append(req)
            return StepOutput(req, token_id, logprob, finished, prefilled=True)
        if finished:
            self.free(req)
        elif was_waiting:
            self.running.append(req)
        return StepOutput(req, token_id, logprob, finished)

    def _ends(self, req: Req) -> bool:
        """After a token was appended to ``req`` (sampled, or the prefill worker's first one
        replayed): whether it ends the output (EOS, a stop token, ``max_new_tokens``, the
        grammar complete), else jump forward over what its grammar forces, which may end it."""
        return req.check_finished(self.eos_token_ids) is not None or self.jump_forward(req)

    def jump_forward(self, req: Req) -> bool:
        """Append the tokens ``req``'s grammar forces next, unsampled; the next step extends
        them with the sequence's other missing tokens. Returns: True if ``req`` is now finished.

        The prefill worker never jumps: its request leaves with exactly one sampled token.
        """
        if req.grammar is None or not self.jump_forward_on:
            return req.finish_reason is not None
        room = req.sampling.max_new_tokens - len(req.output_ids)
        forced = req.grammar.forced_tokens(limit=room)
        if not forced:
            return req.finish_reason is not None
        for tok in forced:  # chosen by the grammar: probability 1, no alternatives
            req.append_output(tok, 0.0)
        return req.check_finished(self.eos_token_ids) is not None

    def _schedule(self, drafts: dict[int, list[int]]) -> tuple[list[Req], list[int]]:
        """The step's rows and chunk lengths; speculative drafts go into ``drafts``."""
        preempt_for_waiting(
            self.waiting, self.running, self.cache, max_running=self.max_running,
            can_admit=self.can_admit, acquire_adapter=self.adapters.acquire,
            retract=self._retract, restart=self._restart)
        # A waiting prompt more urgent than some running or waiting request gets a step without
        # the less urgent rows: its first token does not wait for theirs. If none of its class
        # can run now (its KV still loading, no pages), the step is the usual one.
        urgent = urgent_class(self.waiting, self.running, self.max_batch_tokens)
        if urgent is not None:
            reqs, chunks = self._pick(drafts, urgent)
            if reqs:
                return reqs, chunks
        return self._pick(drafts, None)

    def _pick(self, drafts: dict[int, list[int]],
              urgent: int | None) -> tuple[list[Req], list[int]]:
        """The step's rows: decodes, then prompt chunks; with ``urgent``, only the rows of
        requests at least that urgent (running or waiting), none of the less urgent ones."""
        reqs: list[Req] = []
        chunks: list[int] = []
        alloc = self.allocator
        page_size = self.page_size
        speculate = 0 < len(self.running) <= self.speculative_max_running and self.num_draft > 0
        running = self.running if urgent is None else [
            r for r in self.running if r.sampling.priority <= urgent]
        # Decode first: it keeps inter-token latency flat while prompts are chunked in. The
        # most urgent rows first (a stable sort: admission order among equals), so the last
        # free pages go to them and a less urgent row is the one that yields.
        for req in sorted(running, key=lambda r: r.sampling.priority):
            if req not in self.running:  # retracted below while making room
                continue
            if len(reqs) >= self.max_running:
                break
            # Usually 1 (the last sampled token); more after a grammar jump-forward.
            chunk = req.extend_len
            need = pages_for(req.kv_len + chunk, page_size) - len(req.page_ids)
            if need > 0:
                # Evict unpinned cache entries first; retract only when that is not enough.
                if not make_decode_room(self.cache, self.running, req, reqs, need, self._retract):
                    continue  # it yielded: retracted itself
                req.page_ids.extend(alloc.alloc(need))
            if speculate and chunk == 1:
                draft = draft_tokens(req, self.num_draft, alloc, page_size, len(self.running))
                if draft:
                    drafts[len(reqs)] = draft
                    chunk += len(draft)
                    self.num_draft_tokens += len(draft)
            reqs.append(req)
            chunks.append(chunk)
        budget = self.max_batch_tokens - sum(chunks)
        if reqs and urgent is None:  # decode rows in the step: its prompt chunks are bounded
            budget = min(budget, self.chunked_prefill_size)
        if self.lora is not None and self.waiting:
            self.adapters.want(chain(self.waiting, self.waiting_for_kv))
        # The running requests left out of an urgent step keep their rows.
        rows_taken = len(self.running) - len(running)
        admit_new = True  # False once a new prompt had to wait: no later one passes it
        for req in self.waiting:
            if budget <= 0 or rows_taken + len(reqs) >= self.max_running:
                break
            if urgent is not None and req.sampling.priority > urgent:
                break  # the queue is in priority order: the rest wait for the next step
            is_new = not req.page_ids
            if is_new and not admit_new:
                continue
            if is_new and not self.cache.ready(req):
                continue  # its prompt's KV is still loading from a lower tier: the next may go
            if is_new and not self.adapters.acquire(req):
                continue  # its adapter has no slot yet: the prompts behind it go ahead
            if is_new:
                # Admit a new prompt only if all of it fits, with a page of headroom per running
                # request, so a half-prefilled prompt does not force decodes to retract.
                self.cache.match(req)
                total = pages_for(req.seq_len + 1, page_size) - len(req.page_ids)
                if not self.can_admit(total):
                    self.cache.unmatch(req)
                    self.adapters.release(req)
                    # It waits (FIFO among new prompts) until requests finish or cache entries
                    # unpin; a prompt behind it already half prefilled (a retracted request
                    # can come back ahead of one) goes on with its pages, or none would.
                    admit_new = False
                    continue
            chunk = min(req.extend_len, budget)
            need = pages_for(req.kv_len + chunk, page_size) - len(req.page_ids)
            if not self.cache.ensure_free(need):
                if is_new:
                    self.cache.unmatch(req)
                    self.adapters.release(req)
                break  # FIFO: later prompts wait behind this one
            if is_new:
                self.cache.admitted(req)
            req.page_ids.extend(alloc.alloc(need))
            reqs.append(req)
            chunks.append(chunk)
            budget -= chunk
        return reqs, chunks

    def _retract(self, req: Req) -> None:
        # Its KV is recomputed later over prompt + output, which continues the same sequence;
        # it goes back ahead of the waiting requests of its own priority (it came before them).
        self.running.remove(req)
        self.free(req)
        insert_by_priority(self.waiting, req, ties_first=True)
        self.num_retracted += 1

    def _restart(self, req: Req) -> None:
        # A waiting request, half prefilled, gives its pages back for a more urgent prompt: it
        # stays where it waits and starts over when its turn comes.
        self.free(req)
        self.num_retracted += 1


def _scores_prompt(req: Req, chunk_len: int) -> bool:
    """Whether this chunk of ``req`` covers a position that predicts a missing prompt logprob:
    position ``p`` predicts token ``p + 1``."""
    nxt = req.next_prompt_logprob
    return nxt is not None and req.kv_len <= nxt - 1 < req.kv_len + chunk_len
