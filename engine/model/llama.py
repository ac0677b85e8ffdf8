"""One decoder for the Llama family: Llama/SmolLM, Qwen2 (q/k/v bias), Mistral (sliding window).

q/k/v are one fused ``qkv_proj`` and gate/up one fused ``gate_up_proj``; :func:`hf_weight_map`
tells the loader which row slice of a fused weight each Hugging Face tensor fills.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend, create_attention_backend
from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.fused_decode import run_fused_decode_layers
from splitserve.engine.model.kernel_plan import ProductPlan
from splitserve.engine.model.layers import (
    Embedding,
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    can_pack,
)
from splitserve.engine.model.rope import RotaryEmbedding, StepRope


class LlamaAttention(nn.Module):
    """Self-attention with GQA over the paged KV pool."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        backend: BaseAttentionBackend,
        meta: object,
        pool: KVPool,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's new K/V into ``pool``."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k together: one RoPE op (or C call, in place) instead of two.
        qk = rope.apply(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, self.layer, meta, pool, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        backend: BaseAttentionBackend,
        meta: object,
        pool: KVPool,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, backend, meta, pool)
        normed, x = self.post_attention_layernorm.add_forward(h, x)  # x + h, then its norm
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV pool.

    Args:
        config: parsed model config.
        dtype: parameter and activation dtype (float32 or bfloat16); logits are always float32.
        attn_backend: paged attention implementation; default the torch backend.
        fused_decode: run small decode-only steps' layers in one C call when the C kernels are
            packed (``engine.model.fused_decode``); False keeps the per-op path.

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
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.context_len
        )
        # The vocab projection of scored rows (over the tied embedding table or lm_head).
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.head = LMHead(head)
        # The C kernels once packed (CPU bfloat16): RoPE here, norms and MLPs in their modules,
        # and all layers of a small decode-only step in one call (engine/model/fused_decode.py,
        # which reads the packed weights through an address table made on first use).
        self.kernels: CpuKernels | None = None
        self.c_max_rows = 0  # decode steps up to this many rows take the C products
        self.kernel_plan: ProductPlan | None = None
        self.fused_decode = fused_decode
        self._fused_layer_ptrs: torch.Tensor | None = None

    def pack_weights(self, use_cpu_kernels: bool = True) -> bool:
        """Pre-pack every projection for oneDNN (CPU bfloat16 only; see ``layers.pack_weight``)
        and, with ``use_cpu_kernels``, for the C kernels, which then also serve the norms, RoPE
        and SiLU-multiply (``engine.kernels.cpu``). Call after the weights are loaded and the
        model is on its device. Returns whether it packed."""
        if not can_pack(self.head.weight):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(use_cpu_kernels)
        self.kernels = self.head.pack(use_cpu_kernels)
        self.c_max_rows = self.kernels.decode_max_rows if self.kernels is not None else 0
        self._fused_layer_ptrs = None  # the old packed weights are gone
        for module in self.modules():
            if isinstance(module, RMSNorm | GatedMLP):
                module.kernels = self.kernels
        return True

    def quantize_weights(self, scheme: str) -> None:
        """Quantize the decoder layers' projections and the LM head in place
        (``engine.model.quant``; ``scheme``: ``EngineConfig.quantization``, "none" does
        nothing). Call after loading, before :meth:`pack_weights`.

        Raises:
            ValueError: an unknown scheme.
        """
        if scheme == "none":
            return
        if scheme != "int8":
            raise ValueError(f"unknown quantization {scheme!r}")
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.quantize_int8()
        self.head.quantize_int8()

    def set_product_plan(self, plan: ProductPlan) -> None:
        """Use the C products for decode steps of at most ``plan.layer_rows`` rows in every
        layer (and the fused decode path) and ``plan.head_rows`` in the LM head, oneDNN above
        (``engine.model.kernel_plan``). Needs :meth:`pack_weights` first."""
        limit = self.kernels.decode_max_rows if self.kernels is not None else 0
        self.kernel_plan = plan
        self.c_max_rows = min(plan.layer_rows, limit)
        for module in self.modules():
            if isinstance(module, Linear):
                module.c_max_rows = self.c_max_rows
        self.head.c_max_rows = min(plan.head_rows, limit)

    def weight_bytes(self) -> int:
        """Bytes of the parameters plus the packed copies :meth:`pack_weights` made (oneDNN's
        blocked layout and the C kernels' layout: up to 3x the parameters on CPU bfloat16)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return total + sum(m.packed_bytes() for m in linears) + self.head.packed_bytes()

    def to(self, device: torch.device | str) -> LlamaForCausalLM:  # type: ignore[override]
        """Move parameters and the RoPE table (not a module buffer, to keep it float32)."""
        super().to(device)
        self.rope.to(device)
        return self

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        return_hidden: bool = False,
        meta: object | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step: extend every sequence's KV in ``pool`` and score ``batch.logit_indices``.

        Args:
            batch: the step's tokens, positions and page mapping.
            pool: KV pool whose layout matches ``config.kv_layout``.
            return_hidden: also return the final-normed hidden states of the scored tokens.
            meta: attention metadata built ahead for ``batch`` (CUDA-graph capture builds it
                from static buffers: ``engine.runner.cuda_graph``); None builds it here.

        Returns:
            ``logits [N, vocab]`` float32 for the ``N`` tokens in ``batch.logit_indices``, or
            ``(logits, hidden [N, hidden_size] in model dtype)`` when ``return_hidden``.
        """
        x = self.embed_tokens(batch.input_ids)
        # Positions end at seq_len - 1: the bound check needs no read of the positions tensor.
        max_position = max(batch.seq_lens) - 1 if batch.seq_lens else None
        rope = self.rope.for_step(batch.positions, self.dtype, max_position, self.kernels)
        if meta is None:
            meta = self.attn_backend.prepare(batch, pool, self.config.sliding_window)
        if not (self.fused_decode and run_fused_decode_layers(self, x, meta, pool)):
            for layer in self.layers:
                x = layer(x, rope, self.attn_backend, meta, pool)
        # The norm is per row, so only the scored rows need it (and the vocab projection).
        h = self.norm(x[batch.logit_indices])
        logits = self.compute_logits(h)
        return (logits, h) if return_hidden else logits

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [N, hidden]`` (final-normed) -> float32 logits ``[N, vocab]``."""
        return self.head(h)


def hf_weight_map(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Every HF tensor name the model needs -> ``(our parameter name, first row, rows)``.

    Fused parameters take several HF tensors stacked along dim 0 (q, k, v; gate, up).
    """
    m: dict[str, tuple[str, int, int]] = {}

    def whole(hf: str, ours: str, rows: int) -> None:
        m[hf] = (ours, 0, rows)

    whole("model.embed_tokens.weight", "embed_tokens.weight", config.vocab_size)
    whole("model.norm.weight", "norm.weight", config.hidden_size)
    if not config.tie_word_embeddings:
        whole("lm_head.weight", "lm_head.weight", config.vocab_size)
    q, kv, inter, hid = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        whole(hf + "input_layernorm.weight", ours + "input_layernorm.weight", hid)
        whole(hf + "post_attention_layernorm.weight", ours + "post_attention_layernorm.weight", hid)
        kinds = ["weight"] + (["bias"] if config.attention_bias else [])
        for kind in kinds:
            fused = ours + "self_attn.qkv_proj." + kind
            m[hf + "self_attn.q_proj." + kind] = (fused, 0, q)
            m[hf + "self_attn.k_proj." + kind] = (fused, q, kv)
            m[hf + "self_attn.v_proj." + kind] = (fused, q + kv, kv)
        for kind in ["weight"] + (["bias"] if config.o_proj_bias else []):
            whole(hf + "self_attn.o_proj." + kind, ours + "self_attn.o_proj." + kind, hid)
        for kind in ["weight"] + (["bias"] if config.mlp_bias else []):
            fused = ours + "mlp.gate_up_proj." + kind
            m[hf + "mlp.gate_proj." + kind] = (fused, 0, inter)
            m[hf + "mlp.up_proj." + kind] = (fused, inter, inter)
            whole(hf + "mlp.down_proj." + kind, ours + "mlp.down_proj." + kind, hid)
    return m
