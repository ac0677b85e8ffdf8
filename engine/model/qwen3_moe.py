"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a sparse mixture-of-experts MLP
(``engine/model/moe.py``) in the layers ``ModelConfig.moe_layers`` marks, a dense gated MLP in
the others (``mlp_only_layers``), as transformers' ``Qwen3MoeForCausalLM``. No shared expert.

Checkpoints name each expert's projections ``mlp.experts.{e}.{gate,up,down}_proj.weight`` and the
router ``mlp.gate.weight``; the experts are stacked into 3-D parameters here.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend
from splitserve.engine.model.base import DecoderLM, WeightMap, rows
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import RMSNorm
from splitserve.engine.model.llama import LlamaDecoderLayer, gated_mlp, hf_weight_map
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.model.qwen3 import Qwen3Attention, qk_norm_weight_map


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3-MoE causal LM (see :class:`~splitserve.engine.model.base.DecoderLM`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attn_backend: BaseAttentionBackend | None = None,
        fused_decode: bool = True,
    ) -> None:
        super().__init__(config, dtype, attn_backend, fused_decode)

        def mlp(i: int) -> nn.Module:
            if not config.moe_layers[i]:
                return gated_mlp(config, dtype)
            return SparseMoE(config.hidden_size, config.moe_intermediate_size,
                             config.num_experts, config.num_experts_per_tok,
                             config.norm_topk_prob, dtype)

        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, Qwen3Attention(config, i, dtype), mlp(i), dtype)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._finish_init()

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        m = {**hf_weight_map(config), **qk_norm_weight_map(config)}
        inter = config.moe_intermediate_size
        for i, sparse in enumerate(config.moe_layers):
            if not sparse:
                continue
            hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
            for name in ("gate_proj", "up_proj", "down_proj"):
                del m[f"{hf}{name}.weight"]
            m[hf + "gate.weight"] = (ours + "gate.weight", ())
            for e in range(config.num_experts):
                x = f"{hf}experts.{e}."
                m[x + "gate_proj.weight"] = (ours + "experts_gate_up", (e, *rows(0, inter)))
                m[x + "up_proj.weight"] = (ours + "experts_gate_up", (e, *rows(inter, inter)))
                m[x + "down_proj.weight"] = (ours + "experts_down", (e,))
        return m
