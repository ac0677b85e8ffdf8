"""What the engine needs to know about a model, parsed from a Hugging Face ``config.json``.

A GGUF file's metadata is first turned into the same ``config.json`` form
(``engine/model/gguf/config.py``), so this is the one parser of model shapes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from splitserve.engine.kv_pool import KVLayout
from splitserve.engine.model.compressed import read_quantization
from splitserve.engine.model.registry import SUPPORTED_ARCHITECTURES, get_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a decoder of one of the supported families
    (``engine.model.registry``).

    ``rope_scaling`` is the HF rope dict without ``rope_theta`` (``None`` for plain RoPE); it
    always carries ``rope_type``. ``layer_windows`` has each layer's sliding window (None: the
    layer attends to every earlier key). The fields after ``bos_token_id`` are those of one
    family or another and default to "absent".
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama by flag)
    o_proj_bias: bool  # Llama's ``attention_bias`` also puts a bias on o_proj
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]
    eos_token_ids: list[int]
    bos_token_id: int | None
    # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE.
    qk_norm: bool = False
    # Gemma 3: the MLP's activation, the softmax scale's ``query_pre_attn_scalar``, the factor
    # the embeddings are multiplied by, the final logits' tanh cap, and the RoPE of the layers
    # with a sliding window (theta and scaling; None: the same as the global layers').
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (Qwen3-MoE): experts, experts per token, each expert's MLP width,
    # whether the top-k routing weights are renormalized, and which layers are sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # How the checkpoint stores its weights when not as floats ("compressed-tensors 4-bit
    # group 64 symmetric": engine.model.compressed); part of the fingerprint, so two workers
    # on differently quantized checkpoints of one model refuse each other's KV.
    weight_format: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The window of the layers that have one (None when no layer has)."""
        return next((w for w in self.layer_windows if w is not None), None)

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def fingerprint(self) -> str:
        """16 hex digits hashing every parsed field (shapes, norms, RoPE, windows, tokens).

        Two workers with different fingerprints run different models and must not exchange KV
        (the KV handshake compares it). It identifies the architecture, not the weight values:
        checkpoints of the same shape and family, such as two fine-tunes of one base, share a
        fingerprint, and the handshake tells them apart by the loaded weights' digest
        (``engine.model.weight_digest``, ``ipc.messages.WeightsMsg.weights_digest``).
        """
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def kv_layout(self, page_size: int, dtype_str: str, kv_cache_dtype: str = "auto") -> KVLayout:
        """The KV pool geometry for this model at ``page_size`` tokens per page, read back in
        ``dtype_str`` and stored as ``kv_cache_dtype`` (auto: that dtype; int8, fp8_e4m3)."""
        return KVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype_str, kv_cache_dtype
        )

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse an HF ``config.json`` dict (and optionally ``generation_config.json``).

        Raises:
            ValueError: unsupported architecture, or a feature of it we do not implement (named).
        """
        archs = cfg.get("architectures") or []
        arch = get_architecture(archs[0] if archs else "<missing 'architectures'>")
        family = arch.family
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        is_qwen2 = arch.name == "Qwen2ForCausalLM"
        is_llama = arch.name == "LlamaForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and is_llama
        qkv_bias = is_qwen2 or llama_bias
        if family in ("qwen3", "qwen3_moe", "gemma3"):
            qkv_bias = bool(cfg.get("attention_bias", False))
        eos = _as_list(cfg.get("eos_token_id"))
        for t in _as_list((generation_cfg or {}).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
        config = cls(
            architecture=arch.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            attention_bias=qkv_bias,
            o_proj_bias=llama_bias or (family in ("qwen3", "qwen3_moe", "gemma3") and qkv_bias),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and is_llama,
            layer_windows=_parse_layer_windows(cfg, arch.name, family, num_layers),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        )
        if family == "gemma3":
            _gemma3_fields(config, cfg)
        elif family == "qwen3_moe":
            _moe_fields(config, cfg)
        elif family == "phi3":
            _phi3_fields(config, cfg)
        return config

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a model folder.

        Raises:
            FileNotFoundError: the folder or its ``config.json`` is missing.
            ValueError: an unsupported architecture, or weight quantization
                (``engine.model.compressed``), naming the file and the cause.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"config.json not found in model folder {path}")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.exists() else None
        cfg = json.loads(cfg_file.read_text())
        # An unsupported quantized checkpoint fails here, at launch.
        scheme = read_quantization(cfg, str(cfg_file))
        config = cls.from_hf(cfg, gen)
        if scheme is not None:
            config.weight_format = scheme.describe()
        return config


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, list) else [x]


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from either the transformers-5 ``rope_parameters`` dict or the
    older ``rope_theta`` + ``rope_scaling`` pair (whose type key may be ``type`` or ``rope_type``)."""
    params = cfg.get("rope_parameters")
    if params and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; Llama family has only one
    merged: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    merged.update(params or {})
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    partial = float(merged.pop("partial_rotary_factor", None)
                    or cfg.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:  # our RoPE rotates whole heads
        raise ValueError(f"partial_rotary_factor {partial} is not supported")
    if rope_type == "default":
        return theta, None
    merged["rope_type"] = rope_type
    return theta, merged


def _parse_layer_windows(
    cfg: dict[str, Any], arch: str, family: str, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window from ``sliding_window`` and ``layer_types`` (or, without
    ``layer_types``, what transformers derives for the architecture)."""
    window = cfg.get("sliding_window")
    is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch == "LlamaForCausalLM" or window is None:
        return (None,) * num_layers
    if is_qwen and not cfg.get("use_sliding_window", False):  # off unless asked
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if family == "gemma3":  # every sixth layer global, as Gemma3TextConfig derives
            pattern = cfg.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        elif is_qwen:  # layers from max_window_layers on use the window.
            first = cfg.get("max_window_layers", num_layers)
            layer_types = ["full_attention" if i < first else "sliding_attention"
                           for i in range(num_layers)]
        else:  # Mistral, Phi-3: every layer
            layer_types = ["sliding_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"{arch}: {len(layer_types)} layer_types for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"{arch}: unsupported layer_types {sorted(unknown)}")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _gemma3_fields(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """Gemma 3's extras (transformers' ``Gemma3TextConfig``); refuses what we do not run."""
    for key in ("attn_logit_softcapping",):
        if cfg.get(key) is not None:
            raise ValueError(f"Gemma3ForCausalLM: {key}={cfg[key]} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma3ForCausalLM: hidden_activation {act!r} is not supported")
    config.hidden_act = act
    config.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar", 256))
    config.embed_scale = config.hidden_size**0.5
    cap = cfg.get("final_logit_softcapping")
    config.final_logit_softcapping = None if cap is None else float(cap)
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        local = dict(local)
        config.local_rope_theta = float(local.pop("rope_theta", 10000.0))
        rope_type = local.pop("rope_type", None) or local.pop("type", None) or "default"
        config.local_rope_scaling = None if rope_type == "default" else {
            **local, "rope_type": rope_type
        }
    else:  # the older form: rope_local_base_freq, plain RoPE
        config.local_rope_theta = float(cfg.get("rope_local_base_freq", 10000.0))


def _moe_fields(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """Qwen3-MoE's routing (transformers' ``Qwen3MoeConfig``): layer ``i`` is sparse unless it is
    in ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0``."""
    config.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    config.num_experts_per_tok = int(cfg["num_experts_per_tok"])
    config.moe_intermediate_size = int(cfg["moe_intermediate_size"])
    config.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    config.moe_layers = tuple(
        i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        for i in range(config.num_layers)
    )
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"Qwen3MoeForCausalLM: num_experts_per_tok {config.num_experts_per_tok} with "
            f"{config.num_experts} experts"
        )


def _phi3_fields(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """Phi-3: ``su``/``yarn`` rope types mean LongRoPE (as transformers reads them), and the
    top-level ``original_max_position_embeddings`` is LongRoPE's."""
    scaling = config.rope_scaling
    if scaling is None:
        return
    if scaling["rope_type"] in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "longrope":
        # The top-level value wins over the rope dict's, as in transformers' Phi3Config.
        top = cfg.get("original_max_position_embeddings")
        if top is not None:
            scaling["original_max_position_embeddings"] = top
        scaling.setdefault("original_max_position_embeddings", config.context_len)
