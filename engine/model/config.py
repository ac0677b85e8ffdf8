"""What the engine needs to know about a model, parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.engine.kv_pool import KVLayout

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    ``rope_scaling`` is the HF rope dict without ``rope_theta`` (``None`` for plain RoPE); it
    always carries ``rope_type``. ``sliding_window`` is ``None`` unless every layer uses the same
    window (per-layer windows are refused by :meth:`from_hf`).
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
    sliding_window: int | None
    eos_token_ids: list[int]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_layout(self, page_size: int, dtype_str: str) -> KVLayout:
        """The KV pool geometry for this model at ``page_size`` tokens per page."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype_str)

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse an HF ``config.json`` dict (and optionally ``generation_config.json``).

        Raises:
            ValueError: unsupported architecture or an unsupported feature (per-layer windows).
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else "<missing 'architectures'>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        eos = _as_list(cfg.get("eos_token_id"))
        for t in _as_list((generation_cfg or {}).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            sliding_window=_parse_sliding_window(cfg, arch),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a model folder.

        Raises:
            FileNotFoundError: the folder or its ``config.json`` is missing.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"config.json not found in model folder {path}")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.exists() else None
        return cls.from_hf(json.loads(cfg_file.read_text()), gen)


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
    if rope_type == "default":
        return theta, None
    merged["rope_type"] = rope_type
    return theta, merged


def _parse_sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    if arch == "LlamaForCausalLM":
        return None
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    if window is None:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is None and arch == "Qwen2ForCausalLM":
        # What transformers derives for Qwen2: layers from max_window_layers on use the window.
        first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
        layer_types = [
            "full_attention" if i < first else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1:
        raise ValueError(f"{arch}: per-layer sliding windows (layer_types) are not supported")
    return int(window)
