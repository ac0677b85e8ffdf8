"""Qwen3: the Llama layer with an RMSNorm over each head of q and k before RoPE (``q_norm``,
``k_norm``, one ``[head_dim]`` weight each, shared by the heads), as transformers' Qwen3 has it.

Qwen3-MoE (``qwen3_moe.py``) shares this attention. The C fused decode loop does not apply (it
has no q/k norm); the per-op path serves every step.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend
from splitserve.engine.model.base import DecoderLM, WeightMap
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import RMSNorm
from splitserve.engine.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    gated_mlp,
    hf_weight_map,
)
from splitserve.engine.model.rope import StepRope


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with per-head RMSNorm of q and k (before RoPE)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def rotate(self, qk: torch.Tensor, rope: StepRope) -> torch.Tensor:
        t, heads, d = qk.shape
        q = self.q_norm(qk[:, : self.num_heads].reshape(-1, d))
        k = self.k_norm(qk[:, self.num_heads :].reshape(-1, d))
        qk = torch.cat((q.view(t, self.num_heads, d), k.view(t, heads - self.num_heads, d)), 1)
        return rope.apply(qk)


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 causal LM (see :class:`~splitserve.engine.model.base.DecoderLM` for the arguments)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attn_backend: BaseAttentionBackend | None = None,
        fused_decode: bool = True,
    ) -> None:
        super().__init__(config, dtype, attn_backend, fused_decode)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, Qwen3Attention(config, i, dtype), gated_mlp(config, dtype),
                              dtype)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._finish_init()

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        return {**hf_weight_map(config), **qk_norm_weight_map(config)}


def qk_norm_weight_map(config: ModelConfig) -> WeightMap:
    """Each layer's ``self_attn.q_norm`` / ``k_norm`` weight."""
    m: WeightMap = {}
    for i in range(config.num_layers):
        for norm in ("q_norm", "k_norm"):
            m[f"model.layers.{i}.self_attn.{norm}.weight"] = (
                f"layers.{i}.self_attn.{norm}.weight", ()
            )
    return m
