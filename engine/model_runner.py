"""Runs one scheduled step: builds the :class:`ForwardBatch`, calls the model, samples."""

from __future__ import annotations

import torch

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.grammar.batch_mask import fill_grammar_bitmask
from splitserve.engine.grammar.bitmask import apply_bitmask
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.request import Req
from splitserve.engine.sampling import Sampler, make_generator


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one worker.

    Args:
        model: a model whose ``forward(batch, pool)`` returns float32 logits ``[N, vocab]`` at
            ``batch.logit_indices`` (``engine.llama``).
        pool: the worker's KV pool.
        device: device of the model and pool.
        vocab_size: the model's logits width; needed only when requests carry grammars.
    """

    def __init__(
        self, model: torch.nn.Module, pool: KVPool, device: str = "cpu", vocab_size: int = 0
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size  # logits width, for grammar bitmasks (0: no grammars)
        self.pool = pool
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(
        self, reqs: list[Req], chunk_lens: list[int], sample_rows: list[int]
    ) -> tuple[list[int], list[float]]:
        """Extend each ``reqs[i]`` by ``chunk_lens[i]`` tokens (KV written to its pages) and sample
        one token for each batch index in ``sample_rows``.

        Returns:
            token ids and their logprobs, one per entry of ``sample_rows``.
        """
        batch = build_forward_batch(
            token_chunks=[r.tokens(r.kv_len, r.kv_len + n) for r, n in zip(reqs, chunk_lens)],
            prefix_lens=[r.kv_len for r in reqs],
            page_lists=[r.page_ids for r in reqs],
            page_size=self.pool.page_size,
            logit_seq_indices=sample_rows,
            device=self.device,
        )
        picked = [reqs[i] for i in sample_rows]
        # Filled before the forward pass: the matchers' state is already known, and the CPU
        # work then does not sit between the logits and the sampler.
        bitmask, masked_rows = fill_grammar_bitmask(picked, self.vocab_size)
        logits = self.model(batch, self.pool)
        if not sample_rows:
            return [], []
        if masked_rows:
            apply_bitmask(logits, bitmask, masked_rows)
        ids, logprobs = self.sampler.sample(
            logits, [r.sampling for r in picked], [_step_generator(r) for r in picked]
        )
        return ids.tolist(), logprobs.tolist()


def _step_generator(req: Req) -> torch.Generator | None:
    """A generator seeded by (request seed, output position): the draw for each token depends
    only on those, so a seeded request gives the same tokens colocated, disaggregated (where the
    first token is drawn on another process) and after a retraction."""
    seed = req.sampling.seed
    if seed is None:
        return None
    return make_generator((seed * 1_000_003 + len(req.output_ids)) % (2**63))
