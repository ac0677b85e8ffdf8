"""Phi-3: the Llama layer with checkpoints that already fuse q/k/v (``qkv_proj``) and gate/up
(``gate_up_proj``), which are our own layouts, and LongRoPE scaling (``rope.py``) for the long-
context variants. Every layer is the Llama one, so the C fused decode loop serves it too.
"""

from __future__ import annotations

from splitserve.engine.model.base import WeightMap
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.llama import LlamaForCausalLM, base_weight_map


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM (see :class:`~splitserve.engine.model.base.DecoderLM` for the
    arguments): :class:`LlamaForCausalLM` loaded from Phi-3's tensor names."""

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        m = base_weight_map(config)
        for i in range(config.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            m[hf + "self_attn.qkv_proj.weight"] = (ours + "self_attn.qkv_proj.weight", ())
            m[hf + "mlp.gate_up_proj.weight"] = (ours + "mlp.gate_up_proj.weight", ())
            m[hf + "mlp.down_proj.weight"] = (ours + "mlp.down_proj.weight", ())
        return m
