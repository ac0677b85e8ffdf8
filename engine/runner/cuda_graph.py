"""CUDA-graph capture and replay of decode steps (one new token per sequence).

A decode step of a small model on a large GPU is launch-bound: ~15 kernels per layer, each a few
microseconds of work behind tens of microseconds of Python and launch overhead. Capturing the
whole forward once per batch size and replaying it turns those launches into one (as SGLang's
``CudaGraphRunner`` and vLLM do; this is our own code).

What a captured step needs (and what this module provides):

- static device buffers for the step's inputs (input ids, positions, page table, KV lengths,
  output page and slot), padded to the captured batch size; the real rows are copied in before
  each replay, padding rows write their K/V to the pool's scratch page 0 and attend to one token
  there, and their logits are dropped;
- attention metadata built once from those buffers (``TritonAttentionBackend.decode_metadata``)
  with a split count fixed per captured size, so ``forward`` builds nothing from host lists;
- the position bound check done on the host before replay (inside the graph it would be skipped).

Only decode-only batches that sample every row and score no prompt, within :attr:`limits`, run
here; anything else runs eagerly (the step planner decides: ``engine.step_plan``). ``capture=False`` keeps the static-buffer path but runs it eagerly each step: that is how
the padding logic is tested on a CPU (under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.step_plan import GraphLimits

logger = logging.getLogger(__name__)

# Batch sizes captured by default (SGLang captures a similar ladder); larger batches run eagerly,
# where the launch overhead is a smaller share of the step.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(slots=True)
class _Captured:
    """One batch size's static inputs, metadata, output and (when captured) graph."""

    batch: ForwardBatch  # static tensors of ``size`` rows
    seq_lens: torch.Tensor  # [size] int32 KV length per row, what the attention kernels read
    meta: Any  # attention metadata over the static tensors
    logits: torch.Tensor | None  # [size, vocab] float32 output of the last capture or run
    graph: Any  # torch.cuda.CUDAGraph, or None when running eagerly


class DecodeGraphRunner:
    """Runs decode-only batches through per-batch-size CUDA graphs.

    Args:
        model: an ``engine.model.llama.LlamaForCausalLM`` whose attention backend
            ``supports_cuda_graphs`` (the Triton backend).
        pool: the worker's KV pool (page 0 is the scratch page padding rows write to).
        batch_sizes: sizes to capture; a batch of ``B`` rows runs in the smallest size ``>= B``.
        max_pages_per_seq: page-table width of the static buffers (context length / page size).
        capture: capture CUDA graphs (needs CUDA); False runs the same static path eagerly.

    Raises:
        ValueError: the model's attention backend cannot build static decode metadata.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_pages_per_seq: int | None = None,
        capture: bool = True,
    ) -> None:
        backend = model.attn_backend
        if not backend.supports_cuda_graphs:
            raise ValueError(f"{type(backend).__name__} has no static decode metadata")
        self.model = model
        self.pool = pool
        self.capture = capture
        self.sizes = sorted(set(batch_sizes))
        self.context_len = model.config.context_len
        self.width = max_pages_per_seq or -(-self.context_len // pool.page_size)
        # What the graphs hold, for the step planner (engine.step_plan.plan_step): a batch past
        # the context length runs eagerly, where the bound check raises.
        self.limits = GraphLimits(self.sizes[-1], self.width, self.context_len)
        self.device = pool.buffer.device
        self.graphs: dict[int, _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        t0 = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[size] = self._build(size)
        self.capture_s = time.perf_counter() - t0
        if capture:
            logger.info(
                "captured CUDA graphs for decode batch sizes %s in %.1f s",
                self.sizes,
                self.capture_s,
            )

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Copy ``batch`` (one the step plan replays: ``StepPlan.replay_graph``) into the
        smallest captured size that holds it and replay.

        Returns:
            ``logits [B, vocab]`` float32, a view into the graph's output buffer that the next
            replay overwrites.
        """
        b = batch.batch_size
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        g = self.graphs[size]
        s = g.batch
        s.input_ids[:b].copy_(batch.input_ids)
        s.positions[:b].copy_(batch.positions)
        s.out_page_ids[:b].copy_(batch.out_page_ids)
        s.out_offsets[:b].copy_(batch.out_offsets)
        s.page_table[:b, : batch.page_table.shape[1]].copy_(batch.page_table)
        g.seq_lens[:b].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32), non_blocking=True)
        if b < size:
            _pad_rows(s, g.seq_lens, b)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self.model(s, self.pool, meta=g.meta)
        assert g.logits is not None
        return g.logits[:b]

    def _build(self, size: int) -> _Captured:
        """Static buffers for ``size`` rows, all padding, then a capture (or nothing)."""
        dev = self.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        batch = ForwardBatch(
            input_ids=zeros(size),
            positions=zeros(size),
            extend_lens=[1] * size,
            seq_lens=[1] * size,  # host copy: forward's bound check only (done before replay)
            page_table=zeros(size, self.width),
            out_page_ids=zeros(size),
            out_offsets=zeros(size),
            logit_indices=torch.arange(size, device=dev),
        )
        seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
        meta = self.model.attn_backend.decode_metadata(
            batch, seq_lens, self.pool, self.model.config.layer_windows, self.context_len
        )
        captured = _Captured(batch, seq_lens, meta, None, None)
        if not self.capture:
            return captured
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.pool, meta=meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            captured.logits = self.model(batch, self.pool, meta=meta)
        captured.graph = graph
        return captured


def _pad_rows(batch: ForwardBatch, seq_lens: torch.Tensor, first: int) -> None:
    """Make rows ``first..`` harmless: token 0 at position 0, its K/V written to the scratch
    page's slot 0, attending to that one slot (so every row has a finite softmax)."""
    for t in (batch.input_ids, batch.positions, batch.out_page_ids, batch.out_offsets):
        t[first:].zero_()
    batch.page_table[first:, 0].zero_()
    seq_lens[first:].fill_(1)
