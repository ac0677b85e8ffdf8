"""Gemma 3 (text): transformers' ``Gemma3ForCausalLM``.

What differs from the Llama layer:

- norms multiply by ``1 + w`` in float32 and cast after (:class:`GemmaRMSNorm`), four per layer:
  before and after attention, before and after the MLP (the "sandwich"), plus per-head q/k norms
  before RoPE;
- layers alternate between a sliding window (5 of every 6 in the released models) and global
  attention, and each kind has its own RoPE: the windowed layers a local base (10000), the global
  ones ``rope_theta`` (1e6) with the model's scaling;
- the softmax scale is ``query_pre_attn_scalar ** -0.5``; the embeddings are multiplied by
  ``sqrt(hidden_size)`` (rounded to the activation dtype); the MLP is GELU(tanh)-gated; the LM
  head is tied, and the logits may be tanh-capped (``final_logit_softcapping``).

The C fused decode loop does not apply (its layer is Llama's); the per-op path serves every step.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.base import DecoderLM, WeightMap
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import GatedMLP, empty_parameter
from splitserve.engine.model.llama import LlamaAttention, hf_weight_map
from splitserve.engine.model.qwen3 import qk_norm_weight_map
from splitserve.engine.model.rope import RotaryEmbedding, StepRope
from splitserve.engine.step_plan import Product


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, all in float32, cast to ``x``'s dtype at the end (Gemma's order,
    unlike Llama's, which casts before the weight)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """GQA attention with Gemma's per-head q/k norms (before RoPE)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer, dtype)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def rotate(self, qk: torch.Tensor, rope: StepRope) -> torch.Tensor:
        q = self.q_norm(qk[:, : self.num_heads])
        k = self.k_norm(qk[:, self.num_heads :])
        return rope.apply(torch.cat((q, k), dim=1))


class Gemma3DecoderLayer(nn.Module):
    """``h = x + post_attn_norm(attn(in_norm(x))); out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))``."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        hid, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, layer, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.mlp = GatedMLP(hid, cfg.intermediate_size, False, dtype, cfg.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(hid, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        backend: BaseAttentionBackend,
        meta: object,
        pool: KVPool,
        product: Product,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; ``product``: the step plan's for the layers."""
        h = self.self_attn(self.input_layernorm(x), rope, backend, meta, pool, product)
        x = x + self.post_attention_layernorm(h)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), product)
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(DecoderLM):
    """Gemma 3 text causal LM (see :class:`~splitserve.engine.model.base.DecoderLM`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attn_backend: BaseAttentionBackend | None = None,
        fused_decode: bool = True,
    ) -> None:
        super().__init__(config, dtype, attn_backend, fused_decode)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The windowed layers' RoPE (self.rope, from DecoderLM, is the global layers').
        self.local_rope = RotaryEmbedding(
            config.head_dim,
            config.local_rope_theta or config.rope_theta,
            config.local_rope_scaling,
            config.context_len,
        )
        # transformers keeps sqrt(hidden) as a float32 tensor cast to the weights' dtype.
        scale = torch.tensor(config.embed_scale or 1.0, dtype=torch.float32)
        self.embed_scale = float(scale.to(dtype))
        self._finish_init()

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [self.rope, self.local_rope]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def step_ropes(self, positions: torch.Tensor, max_position: int | None) -> list[StepRope]:
        glob = self.rope.for_step(positions, self.dtype, max_position, self.kernels)
        local = self.local_rope.for_step(positions, self.dtype, max_position, self.kernels)
        return [glob if w is None else local for w in self.config.layer_windows]

    def compute_logits(self, h: torch.Tensor, product: Product) -> torch.Tensor:
        logits = self.head(h, product)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        m = {**hf_weight_map(config), **qk_norm_weight_map(config)}
        for i in range(config.num_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                m[f"model.layers.{i}.{norm}.weight"] = (f"layers.{i}.{norm}.weight", ())
        return m
