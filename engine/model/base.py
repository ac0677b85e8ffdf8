"""What every model family shares: the step (embed, layers over the paged pool, final norm, vocab
projection of the scored rows), weight packing for the CPU kernels, and the weight-name map's form.

A family file (``llama.py``, ``qwen3.py``, ``gemma3.py``, ``phi3.py``, ``qwen3_moe.py``) builds its
layers in ``__init__`` and says what differs by overriding the small hooks: :meth:`embed`,
:meth:`step_ropes`, :meth:`compute_logits`, :meth:`fused_decode_layers` (the one-call C decode
layers, where its layer is theirs) and :meth:`weight_map` (checkpoint tensor names -> where
they go). Families are found by ``engine.model.registry``.

The path of each step (fused layers or layer by layer, C products or torch's) is the step
plan's (``engine.step_plan``): the runner passes one to :meth:`DecoderLM.forward`, which plans
the step itself when called without one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend, create_attention_backend
from splitserve.engine.forward_batch import AdapterRows, ForwardBatch
from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.fused_decode import FusedDecodeLayers
from splitserve.engine.model.kernel_plan import ProductPlan
from splitserve.engine.model.layers import Embedding, GatedMLP, Linear, LMHead, RMSNorm, is_cpu_bf16
from splitserve.engine.model.quant_gpu import release
from splitserve.engine.model.rope import RotaryEmbedding, StepRope
from splitserve.engine.step_interrupt import StepInterrupted
from splitserve.engine.step_plan import Product, ProductLimits, StepPlan, StepShape, plan_step

# Where one checkpoint tensor goes: (our parameter's name, the index into that parameter's data
# it fills: a tuple of ints and slices, e.g. ``(slice(q, q + kv),)`` for k's rows of the fused
# qkv weight, or ``(3, slice(0, inter))`` for expert 3's gate rows of a stacked expert weight).
WeightSlot = tuple[str, tuple[Any, ...]]
WeightMap = dict[str, WeightSlot]


def rows(start: int, count: int) -> tuple[slice]:
    """The index of ``count`` rows from ``start`` (a :data:`WeightSlot`'s second half)."""
    return (slice(start, start + count),)


class StepAdapters(Protocol):
    """The LoRA adapters of a model (``engine.lora.adapters.ModelAdapters``, set as
    ``DecoderLM.lora`` where the server serves adapters): told each step's adapted rows."""

    def begin(self, rows: AdapterRows) -> None:
        """The step about to run has these adapted rows (the projections read them)."""

    def end(self) -> None:
        """The step ran."""

    def fused_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The fused decode layers' LoRA arguments for the current step, or None."""

    def serves_fused(self) -> bool:
        """Whether the fused decode layers can run steps with adapted rows."""


class DecoderLM(nn.Module):
    """A decoder-only causal LM over a paged KV pool.

    Subclasses set ``embed_tokens``, ``layers`` (each called as ``layer(x, rope, backend, meta,
    pool, product)``), ``norm`` and ``lm_head`` (None when tied) in their ``__init__``, then call
    :meth:`_finish_init`.

    Args:
        config: parsed model config.
        dtype: parameter and activation dtype (float32 or bfloat16); logits are always float32.
        attn_backend: paged attention implementation; default the torch backend.
        fused_decode: run small decode-only steps' layers in one C call where the family offers
            them (:attr:`fused_layers`); False keeps the per-op path. May be switched between
            steps.

    Parameters are uninitialized until :func:`splitserve.engine.model.loader.load_model` fills
    them, which then calls :meth:`pack_weights`.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attn_backend: BaseAttentionBackend | None = None,
        fused_decode: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend = attn_backend or create_attention_backend("torch")
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.context_len
        )
        # The C kernels once packed (CPU bfloat16): RoPE here, norms and MLPs in their modules,
        # and (where the family offers them) all layers of a small decode-only step in one call
        # (fused_layers: engine/model/fused_decode.py, built when the weights are packed).
        self.kernels: CpuKernels | None = None
        self.kernel_plan: ProductPlan | None = None
        # Rows up to which the step planner keeps each group of C products (none until packed).
        self.product_limits = ProductLimits()
        self.fused_decode = fused_decode
        self.fused_layers: FusedDecodeLayers | None = None
        # The loaded checkpoint's identity for the KV handshake (engine.model.weight_digest),
        # set by the loader; "" until then.
        self.weights_digest = ""
        # LoRA adapters (engine.lora), when served: None runs every step on the base weights.
        self.lora: StepAdapters | None = None
        self.layers: nn.ModuleList
        self.norm: nn.Module

    def _finish_init(self) -> None:
        # The vocab projection of scored rows (over the tied embedding table or lm_head).
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.head = LMHead(head)

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """Every RoPE table the model holds (moved with the model by :meth:`to`)."""
        return [self.rope]

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        """Every checkpoint (HF) tensor name the model needs -> its :data:`WeightSlot`."""
        raise NotImplementedError

    def pack_weights(self, use_cpu_kernels: bool = True) -> bool:
        """Pre-pack every projection for oneDNN (CPU bfloat16 where oneDNN packs it; see
        ``layers.can_pack``)
        and, with ``use_cpu_kernels``, for the C kernels, which then also serve the norms, RoPE
        and SiLU-multiply (``engine.kernels.cpu``). Call after the weights are loaded and the
        model is on its device. Returns whether it packed."""
        if not is_cpu_bf16(self.head.weight):
            return False
        for module in self.modules():
            # An untied lm_head is served by self.head, which packs its weight once, below.
            if isinstance(module, Linear) and module is not self.lm_head:
                module.pack(use_cpu_kernels)
                # Every product now reads a packed copy: the plain weight would be a third.
                module.drop_plain_weight()
        self.kernels = self.head.pack(use_cpu_kernels)
        if self.head.packed is not None:
            self.head.drop_plain_weight()  # int8's de-quantized copy
            if self.lm_head is not None:  # untied: no product reads the parameter now
                release(self.lm_head.weight)
        # Until a kernel plan lowers them: the C products up to the kernels' limit, for the
        # layers wherever their projections packed (the head's may not have: a vocab that is
        # not a multiple of 16).
        layer_kernels = next((m.kernels for m in self.layers.modules()
                              if isinstance(m, Linear) and m.kernels is not None), None)
        self.product_limits = ProductLimits(
            layer_kernels.decode_max_rows if layer_kernels is not None else 0,
            self.kernels.decode_max_rows if self.kernels is not None else 0)
        for module in self.modules():
            if isinstance(module, RMSNorm | GatedMLP):
                module.kernels = self.kernels
        self.fused_layers = self.fused_decode_layers()  # over the new packed weights
        return True

    def quantize_weights(self, scheme: str,
                         exact: dict[str, torch.Tensor] | None = None) -> None:
        """Quantize the decoder layers' projections (``engine.model.quant`` for int8,
        ``engine.model.quant_int4`` for int4) and the LM head (int8 under both) in place
        (``scheme``: ``EngineConfig.quantization``, "none" does nothing). Call after loading, before
        :meth:`pack_weights`. Projections that are not :class:`Linear` (a mixture of experts'
        stacked expert weights) stay as loaded. ``exact``: parameter name -> the loaded weight
        in float32 where the loader kept it (int4 quantizes from it instead of the serving
        dtype's rounded copy: GGUF Q4_0 tensors keep their own levels and scales).

        Raises:
            ValueError: an unknown scheme, or int4 on a projection whose input size is not a
                multiple of 32.
        """
        if scheme == "none":
            return
        if scheme not in ("int8", "int4"):
            raise ValueError(f"unknown quantization {scheme!r}")
        exact = exact or {}
        for name, module in self.layers.named_modules(prefix="layers"):
            if isinstance(module, Linear):
                if scheme == "int8":
                    module.quantize_int8()
                else:
                    try:
                        module.quantize_int4(exact.get(f"{name}.weight"))
                    except ValueError as exc:
                        raise ValueError(f"--quantization int4: {name}: {exc}") from exc
        # The LM head stays at 8 bits under int4, as llama.cpp's Q4_K_M keeps its output
        # tensor at Q6_K: the vocab projection holds a fifth of SmolLM2's weights, and at 4
        # bits it was all of int4's loss (bench/quality.py, 2048 tokens: +3.05% perplexity
        # with a 4-bit head, -0.03% with an 8-bit one), for ~15% more weight bytes per token.
        self.head.quantize_int8()
        if self.lm_head is not None and self.head.gpu_weight is not None:
            release(self.lm_head.weight)  # CUDA: only the Triton kernel's int8 copy serves

    def set_product_plan(self, plan: ProductPlan) -> None:
        """Plan the C products for decode steps of at most ``plan.layer_rows`` rows in every
        layer (and the fused decode path) and ``plan.head_rows`` in the LM head, oneDNN above
        (``engine.model.kernel_plan``; the step planner, ``engine.step_plan``, applies the
        limits). Needs :meth:`pack_weights` first."""
        self.kernel_plan = plan
        self.product_limits = plan.limits(
            self.kernels.decode_max_rows if self.kernels is not None else 0)

    def fuses_decode(self, pool: KVPool) -> bool:
        """Whether the fused decode layers can take this model's decode steps over ``pool``
        (a fact for the step planner): switched on (``fused_decode``), offered by the family
        and packed (:attr:`fused_layers`), and served by the attention backend for ``pool``."""
        fused = self.fused_layers
        return self.fused_decode and fused is not None and fused.serves(self.attn_backend, pool)

    def fuses_adapters(self) -> bool:
        """Whether the fused decode layers also take steps with LoRA rows (a fact for the step
        planner: the C LoRA products and the Llama layer's projection order)."""
        return self.lora is not None and self.lora.serves_fused()

    def plan_step(self, batch: ForwardBatch, pool: KVPool) -> StepPlan:
        """The plan of ``batch`` run straight through :meth:`forward` over ``pool`` (no runner:
        no speculative rows, no CUDA graphs): ``engine.step_plan.plan_step`` on this model's
        limits and fused layers."""
        return plan_step(StepShape.of(batch), self.product_limits, self.fuses_decode(pool),
                         fuses_adapters=self.fuses_adapters())

    def weight_bytes(self) -> int:
        """Bytes of the parameters plus the packed copies :meth:`pack_weights` made (oneDNN's
        blocked layout and the C kernels' layout, in place of the projections' plain weights,
        which it releases: about 2x the parameters on CPU bfloat16, plus the head's copies)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return total + sum(m.packed_bytes() for m in linears) + self.head.packed_bytes()

    def to(self, device: torch.device | str) -> DecoderLM:  # type: ignore[override]
        """Move parameters and the RoPE tables (not module buffers, to keep them float32)."""
        super().to(device)
        for table in self.rotary_tables():
            table.to(device)
        return self

    # ---- the hooks a family overrides ----------------------------------------------------------

    def fused_decode_layers(self) -> FusedDecodeLayers | None:
        """The family's layers as one C call for decode steps, built once the weights are
        packed (:meth:`pack_weights`), or None: this family's layer is not the one the C loop
        implements (the Llama family overrides this)."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` int64 -> ``[T, hidden]`` in the model dtype."""
        return self.embed_tokens(input_ids)

    def step_ropes(
        self, positions: torch.Tensor, max_position: int | None
    ) -> list[StepRope]:
        """One :class:`StepRope` per layer for this step (the same object for every layer that
        shares a table).

        Raises:
            ValueError: a position past the context length.
        """
        rope = self.rope.for_step(positions, self.dtype, max_position, self.kernels)
        return [rope] * len(self.layers)

    def compute_logits(self, h: torch.Tensor, product: Product) -> torch.Tensor:
        """``h [N, hidden]`` (final-normed) -> float32 logits ``[N, vocab]``; ``product``: the
        step plan's for the head."""
        return self.head(h, product)

    # ---- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        return_hidden: bool = False,
        meta: object | None = None,
        plan: StepPlan | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step: extend every sequence's KV in ``pool`` and score ``batch.logit_indices``.

        Args:
            batch: the step's tokens, positions and page mapping.
            pool: KV pool whose layout matches ``config.kv_layout``.
            return_hidden: also return the final-normed hidden states of the scored tokens.
            meta: attention metadata built ahead for ``batch`` (CUDA-graph capture builds it
                from static buffers: ``engine.runner.cuda_graph``); None builds it here.
            plan: the step's path (the runner's, ``engine.step_plan``); None plans it here
                (:meth:`plan_step`).
            interrupt: called between layers when the step runs layer by layer (not the fused
                decode layers): True gives the step up (:mod:`~splitserve.engine.step_interrupt`).

        Raises:
            StepInterrupted: ``interrupt`` answered True; the KV written past each sequence's
                prefix is left as garbage that the step's rerun overwrites.

        Returns:
            ``logits [N, vocab]`` float32 for the ``N`` tokens in ``batch.logit_indices``, or
            ``(logits, hidden [N, hidden_size] in model dtype)`` when ``return_hidden``.
        """
        if plan is None:
            plan = self.plan_step(batch, pool)
        lora = self.lora if batch.lora is not None else None
        if lora is None:
            return self._forward(batch, pool, return_hidden, meta, plan, interrupt)
        lora.begin(batch.lora)  # type: ignore[arg-type]
        try:
            return self._forward(batch, pool, return_hidden, meta, plan, interrupt)
        finally:
            lora.end()

    def _forward(
        self, batch: ForwardBatch, pool: KVPool, return_hidden: bool, meta: object | None,
        plan: StepPlan, interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(batch.input_ids)
        # Positions end at seq_len - 1: the bound check needs no read of the positions tensor.
        max_position = max(batch.seq_lens) - 1 if batch.seq_lens else None
        ropes = self.step_ropes(batch.positions, max_position)
        backend = self.attn_backend
        if meta is None:
            meta = backend.prepare(batch, pool, self.config.layer_windows)
        fused = self.fused_layers if plan.fused_layers else None
        lora = None if self.lora is None else self.lora.fused_args()
        if fused is None or not fused.run(x, batch, backend, meta, pool, lora):
            last = len(self.layers) - 1
            for i, (layer, rope) in enumerate(zip(self.layers, ropes, strict=True)):
                x = layer(x, rope, backend, meta, pool, plan.layers)
                if interrupt is not None and i < last and interrupt():
                    raise StepInterrupted(i + 1)
        # The norm is per row, so only the scored rows need it (and the vocab projection); a
        # step that scores every row in order needs no gather (a copy of x).
        h = self.norm(x if batch.logits_every_token else x[batch.logit_indices])
        logits = self.compute_logits(h, plan.head)
        return (logits, h) if return_hidden else logits
