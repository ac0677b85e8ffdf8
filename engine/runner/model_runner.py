"""Runs one scheduled step: builds the :class:`ForwardBatch`, calls the model, samples.

The runner reads the requests of a :class:`~splitserve.engine.sched.batch.ScheduledBatch` and
returns a :class:`~splitserve.engine.sched.batch.ModelOutput`; it changes no request (the
scheduler's ``update`` does), and it owns the model, the pool's tensors, the sampler, the
grammar mask and the CUDA graphs. Each step's path (verify rows as decode rows, a CUDA graph,
the fused layers, which products) is planned once (:meth:`ModelRunner.plan_step`,
``engine.step_plan``) and then executed.
"""

from __future__ import annotations

from functools import partial

import torch

from splitserve.engine.forward_batch import ForwardBatch, build_forward_batch
from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.mask_thread import MaskFillThread
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.base import DecoderLM
from splitserve.engine.runner.cuda_graph import DecodeGraphRunner
from splitserve.engine.runner.logprobs import raw_logprobs, top_alternatives
from splitserve.engine.runner.penalties import needs_processing, process_logits
from splitserve.engine.runner.sampling import Sampler, make_generator
from splitserve.engine.runner.verify import verify_drafts
from splitserve.engine.sched.batch import ModelOutput, ScheduledBatch
from splitserve.engine.sched.request import Req
from splitserve.engine.step_interrupt import InterruptCheck
from splitserve.engine.step_plan import StepPlan, StepShape, plan_step


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one worker.

    Args:
        model: the model (``engine.model.base.DecoderLM``): ``forward(batch, pool, plan=...)``
            returns float32 logits ``[N, vocab]`` at ``batch.logit_indices``.
        pool: the worker's KV pool.
        device: device of the model and pool.
        vocab_size: the model's logits width; needed only when requests carry grammars.
        overlap_grammar_mask: fill constrained rows' masks on a background thread while the
            forward pass runs (see ``grammar.mask_thread`` for why that is safe); False fills
            them on the calling thread before the forward pass. Same tokens either way; may be
            switched between steps.
        decode_graphs: replays the decode-only steps the step plan gives it
            (``engine.runner.cuda_graph``); None runs every step eagerly.
        eos_token_ids: the model's EOS ids, which ``min_tokens`` masks (``runner.penalties``).

    Attribute ``interrupt`` (None by default; the worker sets it where it prefills prompts):
    called between the layers of a step that runs layer by layer and may be given up
    (``ScheduledBatch.interrupt_floor`` is not None), with that floor; True gives the step up
    (:mod:`~splitserve.engine.step_interrupt`: :meth:`run` raises ``StepInterrupted``).

    The logits of the sampled rows go through, in this order: raw logprobs (of the model's
    distribution, ``runner.logprobs``) -> penalties, ``logit_bias``, ``min_tokens``
    (``runner.penalties``) -> the grammar mask -> temperature, top-k, top-p, min-p and the draw
    (``runner.sampling``).
    """

    def __init__(
        self,
        model: DecoderLM,
        pool: KVPool,
        device: str = "cpu",
        vocab_size: int = 0,
        overlap_grammar_mask: bool = True,
        decode_graphs: DecodeGraphRunner | None = None,
        use_cpu_kernels: bool = True,
        eos_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size  # logits width, for grammar bitmasks (0: no grammars)
        self.pool = pool
        self.device = device
        self.sampler = Sampler(use_cpu_kernels)
        self.overlap_grammar_mask = overlap_grammar_mask
        self.grammar_mask: BatchMask | None = None  # made at the first constrained step
        self.mask_thread = MaskFillThread()
        self.decode_graphs = decode_graphs
        self.interrupt: InterruptCheck | None = None

    def close(self) -> None:
        """Stop the grammar mask thread (if it was ever started)."""
        self.mask_thread.close()

    @torch.inference_mode()
    def run(self, step: ScheduledBatch) -> ModelOutput:
        """Extend each ``step.reqs[i]`` by ``step.chunk_lens[i]`` tokens (KV written to its
        pages), score the prompt positions of ``step.scored_rows`` and sample one token for each
        row in ``step.sample_rows``, under its grammar's mask if it has one; a row with a
        speculative draft (``step.drafts``) is verified instead (``runner.verify``)."""
        reqs, chunk_lens, sample_rows = step.reqs, step.chunk_lens, step.sample_rows
        drafts = step.drafts
        picked = [reqs[i] for i in sample_rows]
        picked_drafts = [drafts.get(i, []) for i in sample_rows]
        # Logits rows: one per sampled row, or one per drafted position of a speculative row.
        counts = [len(d) + 1 for d in picked_drafts]
        firsts = [0]
        for c in counts[:-1]:
            firsts.append(firsts[-1] + c)
        constrained = [j for j, r in enumerate(picked) if r.grammar is not None]
        mask_rows = [firsts[j] + t for j in constrained for t in range(counts[j])]
        mask = (
            self._start_grammar_mask(
                [picked[j] for j in constrained], [firsts[j] for j in constrained],
                [picked_drafts[j] for j in constrained],
            )
            if constrained else None
        )
        scored = step.scored_rows
        prompt_logprobs: list[tuple[list[float], list[list[int]], list[list[float]]]] = []
        try:
            batch = build_forward_batch(
                token_chunks=[
                    r.tokens(r.kv_len, r.seq_len) + drafts[i] if i in drafts
                    else r.tokens(r.kv_len, r.kv_len + n)
                    for i, (r, n) in enumerate(zip(reqs, chunk_lens))
                ],
                prefix_lens=[r.kv_len for r in reqs],
                page_lists=[r.page_ids for r in reqs],
                page_size=self.pool.page_size,
                logit_seq_indices=sample_rows,
                device=self.device,
                all_logit_seq_indices=scored,
                seq_ids=[r.uid for r in reqs],
                logit_counts=counts if drafts else None,
                max_seq_lens=step.max_seq_lens or None,
                lora_slots=None if self.model.lora is None else [r.lora_slot for r in reqs],
            )
            plan = self.plan_step(step, batch)
            if plan.as_decode_rows:
                batch = batch.as_decode_rows()
            if plan.replay_graph:
                assert self.decode_graphs is not None
                logits = self.decode_graphs.run(batch)
            else:
                check = None
                if self.interrupt is not None and step.interrupt_floor is not None:
                    check = partial(self.interrupt, step.interrupt_floor)
                logits = self.model(batch, self.pool, plan=plan, interrupt=check)
            num_sampled = sum(counts)
            if scored:
                # Rows after the sampled ones score every position of the scored chunks, in order.
                prompt_logprobs = _prompt_logprobs(
                    [reqs[i] for i in scored], [chunk_lens[i] for i in scored],
                    logits[num_sampled:],
                )
                logits = logits[:num_sampled]
        finally:
            # Grammar state is the caller's again only after this (grammar.mask_thread, point 3).
            self.mask_thread.join()
        out = ModelOutput([], [], [lp for lp, _, _ in prompt_logprobs])
        if any(r.sampling.top_logprobs for r in (reqs[i] for i in scored)):
            out.prompt_top_ids = [ids for _, ids, _ in prompt_logprobs]
            out.prompt_top_logprobs = [lps for _, _, lps in prompt_logprobs]
        if not sample_rows:
            return out
        if drafts:
            self._verify(step, picked, picked_drafts, firsts, logits, mask, out)
        else:
            self._sample(logits, picked, mask, mask_rows, out)
        return out

    def plan_step(self, step: ScheduledBatch, batch: ForwardBatch) -> StepPlan:
        """The path of ``step`` (built as ``batch``): ``engine.step_plan.plan_step`` over its
        shape, the model's kernel-plan limits and fused layers on this pool, and the captured
        CUDA graphs.

        A verify step (every row a decoding sequence's missing token plus its draft, no prompt
        logprobs; a prompt chunk or a jump-forward run keeps it an extend) may run as one decode
        row per drafted position: one call of the fused C decode layers, which append every
        row's K/V before any row attends, so each row sees its sequence up to its own position;
        as an extend it takes the general path (extend attention over the pool, per-op
        layers), about twice a fused decode step of as many rows."""
        drafts, scored = step.drafts, step.scored_rows
        verifies = bool(drafts) and not scored and all(
            n == 1 + len(drafts.get(i, ())) for i, n in enumerate(step.chunk_lens))
        shape = StepShape.of(batch, step.sample_rows, scored, verifies)
        graphs, model = self.decode_graphs, self.model
        return plan_step(shape, model.product_limits, model.fuses_decode(self.pool),
                         None if graphs is None else graphs.limits, model.fuses_adapters())

    def _sample(
        self,
        logits: torch.Tensor,
        picked: list[Req],
        mask: BatchMask | None,
        masked_rows: list[int],
        out: ModelOutput,
        mask_rows: list[int] | None = None,
    ) -> None:
        """Process ``logits`` (``[len(picked), V]``, changed in place) in the class docstring's
        order and sample one token per row into ``out``. ``masked_rows``: the constrained rows
        of ``logits``; ``mask_rows``: the mask's rows filled for them (default the same)."""
        processed = [j for j, r in enumerate(picked) if needs_processing(r)]
        top_counts = [r.sampling.top_logprobs for r in picked]
        # Logprobs are of the raw distribution: taken before anything below changes the logits.
        # Without processing, a mask or alternatives the sampler's own logprob is that already.
        raw = raw_logprobs(logits) if processed or mask is not None or any(top_counts) else None
        if processed:
            process_logits(logits, processed, [picked[j] for j in processed], self.eos_token_ids)
        if mask is not None:
            mask.apply(logits, masked_rows, mask_rows)
        ids, logprobs = self.sampler.sample(
            logits, [r.sampling for r in picked], [_step_generator(r) for r in picked]
        )
        if raw is not None:
            logprobs = raw.gather(1, ids[:, None])[:, 0]
        out.token_ids, out.logprobs = ids.tolist(), logprobs.tolist()
        if any(top_counts):
            out.top_ids, out.top_logprobs = top_alternatives(raw, top_counts)

    def _verify(
        self,
        step: ScheduledBatch,
        picked: list[Req],
        picked_drafts: list[list[int]],
        firsts: list[int],
        logits: torch.Tensor,
        mask: BatchMask | None,
        out: ModelOutput,
    ) -> None:
        """A step with speculative rows: rows without a draft sample as usual (``_sample``),
        rows with one are verified under their masks at every drafted position
        (``runner.verify``; the scheduler drafts only for rows that need no penalties or
        alternatives, so their raw logprobs are those of the unmasked logits)."""
        n = len(picked)
        ids, lps = [0] * n, [0.0] * n
        top_ids: list[list[int]] = [[] for _ in range(n)]
        top_lps: list[list[float]] = [[] for _ in range(n)]
        plain = [j for j, d in enumerate(picked_drafts) if not d]
        if plain:
            sub = ModelOutput([], [])
            constrained = [k for k, j in enumerate(plain) if picked[j].grammar is not None]
            self._sample(
                logits[[firsts[j] for j in plain]], [picked[j] for j in plain], mask,
                constrained, sub, [firsts[plain[k]] for k in constrained],
            )
            for k, j in enumerate(plain):
                ids[j], lps[j] = sub.token_ids[k], sub.logprobs[k]
                if sub.top_ids:
                    top_ids[j], top_lps[j] = sub.top_ids[k], sub.top_logprobs[k]
        spec = [j for j, d in enumerate(picked_drafts) if d]
        rows = torch.cat([logits[firsts[j] : firsts[j] + len(picked_drafts[j]) + 1] for j in spec])
        raw = raw_logprobs(rows)
        masked = [r for r, j in enumerate(spec) if picked[j].grammar is not None]
        if mask is not None and masked:
            offsets = [0]
            for j in spec[:-1]:
                offsets.append(offsets[-1] + len(picked_drafts[j]) + 1)
            local = [offsets[r] + t for r in masked for t in range(len(picked_drafts[spec[r]]) + 1)]
            source = [firsts[spec[r]] + t for r in masked
                      for t in range(len(picked_drafts[spec[r]]) + 1)]
            mask.apply(rows, local, source)
        results = verify_drafts(
            rows, [picked_drafts[j] for j in spec], [picked[j].sampling for j in spec],
            [len(picked[j].output_ids) for j in spec], raw,
        )
        for j, res in zip(spec, results):
            ids[j], lps[j] = res.tokens[-1], res.logprobs[-1]
            out.verified[step.sample_rows[j]] = res
        out.token_ids, out.logprobs = ids, lps
        if any(top_ids):
            out.top_ids, out.top_logprobs = top_ids, top_lps

    def _start_grammar_mask(
        self, reqs: list[Req], firsts: list[int], drafts: list[list[int]]
    ) -> BatchMask:
        """Start filling the masks of the constrained ``reqs``: row ``firsts[k]`` for one without
        a draft, rows ``firsts[k] ..`` one per drafted position for one with a draft; on the
        mask thread, so that it overlaps the forward pass, or here and now when overlap is off.

        Returns: the runner's mask, to ``apply`` once the fill is joined.

        Raises:
            ValueError: if the runner was built without ``vocab_size``.
        """
        if self.grammar_mask is None:
            self.grammar_mask = BatchMask(self.vocab_size, self.device)
        mask = self.grammar_mask
        grammars = [r.grammar for r in reqs]

        def fill() -> None:
            # Inference mode is per thread: without it the mask thread could not write in place
            # to buffers first made under ``run``'s inference mode (e.g. by a serial step).
            with torch.inference_mode():
                if any(drafts):
                    mask.fill_drafted(grammars, firsts, drafts)  # type: ignore[arg-type]
                else:
                    mask.fill(grammars, firsts)  # type: ignore[arg-type]

        if self.overlap_grammar_mask:
            self.mask_thread.start(fill)
        else:
            fill()
        return mask


def _prompt_logprobs(
    reqs: list[Req], chunk_lens: list[int], logits: torch.Tensor
) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
    """For each request, the logprobs of the prompt tokens its chunk's logits predict, and
    per token its ``sampling.top_logprobs`` most likely alternatives (ids, logprobs)."""
    out = []
    row = 0
    for req, n in zip(reqs, chunk_lens):
        first, nxt = req.kv_len, req.next_prompt_logprob
        assert nxt is not None
        # Positions p in [nxt - 1, min(end, prompt_len - 1)) predict prompt tokens p + 1.
        lo, hi = nxt - 1, min(first + n, req.prompt_len - 1)
        rows = raw_logprobs(logits[row + lo - first : row + hi - first])
        targets = torch.tensor(req.input_ids[lo + 1 : hi + 1], dtype=torch.long)
        lp = rows.gather(1, targets.to(rows.device)[:, None])
        top_ids, top_lps = top_alternatives(rows, [req.sampling.top_logprobs] * rows.shape[0])
        out.append((lp[:, 0].tolist(), top_ids, top_lps))
        row += n
    return out


def _step_generator(req: Req) -> torch.Generator | None:
    """A generator seeded by (request seed, output position): the draw for each token depends
    only on those, so a seeded request gives the same tokens colocated, disaggregated (where the
    first token is drawn on another process) and after a retraction."""
    seed = req.sampling.seed
    if seed is None:
        return None
    return make_generator((seed * 1_000_003 + len(req.output_ids)) % (2**63))
