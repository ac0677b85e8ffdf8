"""The Llama family: Llama/SmolLM, Qwen2 (q/k/v bias), Mistral (sliding window).

q/k/v are one fused ``qkv_proj`` and gate/up one fused ``gate_up_proj``; :func:`hf_weight_map`
tells the loader which row slice of a fused weight each Hugging Face tensor fills. The attention
and the decoder layer here are the ones Qwen3, Qwen3-MoE and Phi-3 build on.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.base import DecoderLM, WeightMap, rows
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.fused_decode import FusedDecodeLayers
from splitserve.engine.model.layers import GatedMLP, Linear, RMSNorm
from splitserve.engine.model.rope import StepRope
from splitserve.engine.step_plan import Product


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
        self.scale = cfg.attention_scale
        self.qkv_proj = Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype)

    def rotate(self, qk: torch.Tensor, rope: StepRope) -> torch.Tensor:
        """``qk [T, Hq + Hkv, D]`` (the q and k heads) with RoPE applied; a family that
        normalizes q/k first (Qwen3) overrides this."""
        # Rotate q and k together: one RoPE op (or C call, in place) instead of two.
        return rope.apply(qk)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        backend: BaseAttentionBackend,
        meta: object,
        pool: KVPool,
        product: Product,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's new K/V into ``pool``;
        ``product``: the step plan's for the projections (``engine.step_plan``)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x, product)
        qk = self.rotate(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, self.layer, meta, pool, self.scale)
        return self.o_proj(o.reshape(t, self.q_size), product)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    ``mlp`` is any module ``(x [T, hidden], product) -> [T, hidden]`` (a gated MLP, or
    Qwen3-MoE's experts).
    """

    def __init__(
        self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

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
        normed, x = self.post_attention_layernorm.add_forward(h, x)  # x + h, then its norm
        return x + self.mlp(normed, product)


def gated_mlp(cfg: ModelConfig, dtype: torch.dtype) -> GatedMLP:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)


class LlamaForCausalLM(DecoderLM):
    """Llama-family causal LM over a paged KV pool (see :class:`DecoderLM` for the arguments).
    Its layer is the one the fused C decode loop implements (:meth:`fused_decode_layers`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attn_backend: BaseAttentionBackend | None = None,
        fused_decode: bool = True,
    ) -> None:
        super().__init__(config, dtype, attn_backend, fused_decode)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, LlamaAttention(config, i, dtype), gated_mlp(config, dtype),
                              dtype)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._finish_init()

    def fused_decode_layers(self) -> FusedDecodeLayers | None:
        return FusedDecodeLayers.build(self.layers, self.config, self.kernels, self.rope,
                                       self.dtype)

    @staticmethod
    def weight_map(config: ModelConfig) -> WeightMap:
        return hf_weight_map(config)


def hf_weight_map(config: ModelConfig) -> WeightMap:
    """Every HF tensor name a Llama-family model needs -> where it goes (:data:`WeightMap`).

    Fused parameters take several HF tensors stacked along dim 0 (q, k, v; gate, up).
    """
    m = base_weight_map(config)
    q, kv = config.q_size, config.kv_size
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for kind in ["weight"] + (["bias"] if config.attention_bias else []):
            fused = ours + "self_attn.qkv_proj." + kind
            m[hf + "self_attn.q_proj." + kind] = (fused, rows(0, q))
            m[hf + "self_attn.k_proj." + kind] = (fused, rows(q, kv))
            m[hf + "self_attn.v_proj." + kind] = (fused, rows(q + kv, kv))
        m.update(gated_mlp_weight_map(config, hf + "mlp.", ours + "mlp."))
    return m


def base_weight_map(config: ModelConfig) -> WeightMap:
    """The tensors every family of this file's shape has: embeddings, final norm, LM head, and
    per layer the two norms and ``o_proj``."""
    m: WeightMap = {"model.embed_tokens.weight": ("embed_tokens.weight", ()),
                    "model.norm.weight": ("norm.weight", ())}
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head.weight", ())
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            m[f"{hf}{norm}.weight"] = (f"{ours}{norm}.weight", ())
        for kind in ["weight"] + (["bias"] if config.o_proj_bias else []):
            m[hf + "self_attn.o_proj." + kind] = (ours + "self_attn.o_proj." + kind, ())
    return m


def gated_mlp_weight_map(config: ModelConfig, hf: str, ours: str) -> WeightMap:
    """HF ``gate_proj``/``up_proj``/``down_proj`` under ``hf`` -> our fused ``gate_up_proj`` and
    ``down_proj`` under ``ours``."""
    inter = config.intermediate_size
    m: WeightMap = {}
    for kind in ["weight"] + (["bias"] if config.mlp_bias else []):
        fused = ours + "gate_up_proj." + kind
        m[hf + "gate_proj." + kind] = (fused, rows(0, inter))
        m[hf + "up_proj." + kind] = (fused, rows(inter, inter))
        m[hf + "down_proj." + kind] = (ours + "down_proj." + kind, ())
    return m
