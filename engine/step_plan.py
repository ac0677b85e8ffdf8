"""Which path runs one step, decided once: the step plan and the one function that decides it.

A step's path has four parts:

- a speculative verify step as one decode row per drafted position
  (``ForwardBatch.as_decode_rows``) or as extends;
- by replaying a captured CUDA graph (``engine.runner.cuda_graph``) or eagerly;
- eagerly, every decoder layer in one C call (``engine.model.fused_decode``) or layer by layer;
- the decoder layers' and the LM head's matrix products by our C kernels or by torch (oneDNN's
  packed product, else ``F.linear``; the Triton kernels on CUDA), and int4 weights by ours or by
  torch's CPU int4 kernel.

:func:`plan_step` picks all of it from the step's shape (:class:`StepShape`), the row counts up
to which the kernel plan keeps each group of C products (:class:`ProductLimits`, measured at
start-up by ``engine.model.kernel_plan``; zero where no C kernels were packed: CUDA, float32, C
kernels off) and what the device and the worker offer (whether the fused layers serve the pool;
the captured graphs' reach, :class:`GraphLimits`). The runner (``engine.runner.model_runner``)
executes the :class:`StepPlan`; the model's layers take their products from it. Nothing else
compares a row count with a threshold.

This module is the contract between the runner and the model (as ``forward_batch.py`` is), so
it sits at the engine's root: the model reads it, and the model must not import the runner.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.engine.forward_batch import ForwardBatch

NO_LIMIT = 1 << 30  # rows: no crossover


class Product(enum.Enum):
    """Which kernel runs a step's matrix products (of the decoder layers, or of the LM head).

    ``TORCH``: oneDNN's product on its packed copy of the weight where there is one (CPU
    bfloat16), else ``F.linear``; on CUDA the Triton kernels of quantized weights. ``C``: our C
    products (``gemv.c`` / ``gemm_bf16.c`` in bfloat16, ``gemm_w8.c`` for int8 weights,
    ``gemm_w4.c`` for int4). ``C_TORCH_INT4``: as ``C``, except that int4 weights take torch's
    CPU int4 kernel (``_weight_int4pack_mm_for_cpu``). A module without the chosen kernel's
    weight (none packed for it) takes ``TORCH``.
    """

    TORCH = "torch"
    C = "c"
    C_TORCH_INT4 = "c, torch int4"


@dataclass(frozen=True, slots=True)
class ProductLimits:
    """The most rows each group of C products serves (0: none; rows above take torch).

    Attributes:
        layer_rows: the decoder layers' products (and the fused layers, which run them).
        head_rows: the LM head's product (rows are the step's scored positions).
        w4_layer_rows: int4 weights: ours up to here, torch's int4 kernel above.
    """

    layer_rows: int = 0
    head_rows: int = 0
    w4_layer_rows: int = NO_LIMIT


@dataclass(frozen=True, slots=True)
class GraphLimits:
    """What the captured CUDA graphs hold (``DecodeGraphRunner.limits``).

    Attributes:
        max_rows: the largest captured batch size (sequences).
        max_pages: the static page table's width (pages per sequence).
        context_len: the longest KV a replayed step may reach (a longer one runs eagerly,
            where the position check raises).
    """

    max_rows: int
    max_pages: int
    context_len: int


@dataclass(slots=True)
class StepShape:
    """The facts about one step that choose its path (no tensors, no model). Plain data, made
    once per step on the hot path (a frozen dataclass costs a microsecond more to build).

    Attributes:
        num_rows: sequences in the batch.
        num_tokens: new tokens in the batch (rows of the layers' products).
        num_logits: positions scored (rows of the LM head's product).
        decode_only: every sequence extends by one token.
        keyed: the batch carries sequence ids (the decode KV cache, which the fused layers
            read and write, keys its slots by them).
        verifies: every row is a decoding sequence's missing token plus its speculative draft
            (at least one row has a draft) and no prompt position is scored: the step may run
            as one decode row per drafted position.
        samples_in_order: every row is sampled, in batch order, and no prompt is scored (what
            a captured graph computes).
        max_pages: the page table's width.
        max_seq_len: the longest sequence after the step.
        adapters: some row runs under a LoRA adapter (``ForwardBatch.lora``).
    """

    num_rows: int
    num_tokens: int
    num_logits: int
    decode_only: bool
    keyed: bool = False
    verifies: bool = False
    samples_in_order: bool = False
    max_pages: int = 0
    max_seq_len: int = 0
    adapters: bool = False

    @classmethod
    def of(cls, batch: ForwardBatch, sample_rows: Sequence[int] | None = None,
           scored_rows: Sequence[int] = (), verifies: bool = False) -> StepShape:
        """The shape of ``batch``, whose sequences ``sample_rows`` are sampled and
        ``scored_rows`` score prompt positions (the scheduled step's; None: not a scheduled
        step, as a batch run straight through the model); ``verifies``: see the attribute."""
        num_rows = len(batch.extend_lens)
        in_order = (sample_rows is not None and not scored_rows
                    and list(sample_rows) == list(range(num_rows)))
        return cls(  # positional: the fields' order above
            num_rows, batch.input_ids.shape[0], batch.logit_indices.shape[0],
            batch.is_decode_only, batch.seq_ids is not None, verifies, in_order,
            batch.page_table.shape[1], max(batch.seq_lens, default=0), batch.lora is not None,
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How one step runs (:func:`plan_step` decides it; the runner and the model follow it).

    Attributes:
        as_decode_rows: run the verify step as one decode row per drafted position.
        replay_graph: replay a captured CUDA graph (the model's own fields then do not apply:
            the graph holds the path it was captured with).
        fused_layers: run every decoder layer in one C call (``engine.model.fused_decode``);
            if the decode cache does not take the step (its memory bound, known only once the
            step's attention metadata exists) the layers run one by one, with ``layers``.
        layers: the decoder layers' products.
        head: the LM head's product.
    """

    as_decode_rows: bool
    replay_graph: bool
    fused_layers: bool
    layers: Product
    head: Product


def product_for(num_rows: int, c_rows: int, w4_rows: int = NO_LIMIT) -> Product:
    """The products of ``num_rows`` rows where C serves up to ``c_rows`` rows and our int4
    kernel up to ``w4_rows`` (:func:`plan_step`'s rule, for the layers and for the head)."""
    if not 0 < num_rows <= c_rows:
        return Product.TORCH
    return Product.C if num_rows <= w4_rows else Product.C_TORCH_INT4


def plan_step(shape: StepShape, limits: ProductLimits, fuses: bool,
              graphs: GraphLimits | None = None, fuses_adapters: bool = False) -> StepPlan:
    """The one decision of a step's path.

    Args:
        shape: the step's facts.
        limits: the kernel plan's rows per group of C products.
        fuses: the fused decode layers can serve this model over this pool (CPU bfloat16, a
            Llama-family layer, one window, C kernels on, the torch backend's decode cache and
            its C attention for the pool's heads: ``DecoderLM.fuses_decode``).
        graphs: the captured CUDA graphs (None: none, every step runs eagerly).
        fuses_adapters: the fused decode layers also run LoRA products
            (``DecoderLM.fuses_adapters``).

    Returns:
        The plan. The fused layers take a decode-only, keyed step whose every product is one of
        ours (at most ``layer_rows`` rows, and ``w4_layer_rows``: the C loop has no torch int4
        kernel). A verify step runs as decode rows exactly when they take it: elsewhere its
        rows would share a cache slot on the per-op path, whose torch products cannot scatter
        them (a slow per-row copy), so it stays an extend there. A graph replays a decode-only
        step that samples every row in order, within its sizes, and without LoRA rows (the
        graphs hold the base path). A step with LoRA rows takes the fused layers only where
        they run its adapters' products.
    """
    rows = shape.num_tokens
    layers = product_for(rows, limits.layer_rows, limits.w4_layer_rows)
    fits_fused = (fuses and shape.keyed and layers is Product.C
                  and (fuses_adapters or not shape.adapters))
    as_decode_rows = shape.verifies and fits_fused
    decode_only = shape.decode_only or as_decode_rows
    replay = (
        graphs is not None and decode_only and not as_decode_rows and shape.samples_in_order
        and not shape.adapters
        and 0 < shape.num_rows <= graphs.max_rows and shape.max_pages <= graphs.max_pages
        and shape.max_seq_len <= graphs.context_len
    )
    return StepPlan(
        as_decode_rows=as_decode_rows,
        replay_graph=replay,
        fused_layers=decode_only and fits_fused,
        layers=layers,
        head=product_for(shape.num_logits, limits.head_rows),
    )
