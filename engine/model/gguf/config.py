"""A GGUF file's metadata as a Hugging Face ``config.json`` dict, which ``ModelConfig.from_hf``
then parses like any folder's.

Keys follow llama.cpp's GGUF naming (``{arch}.block_count``, ``{arch}.attention.head_count`` ...,
see gguf-py's ``constants.py``). What llama.cpp fixes in code rather than in metadata is filled
the way llama.cpp does: Gemma 3's local RoPE base (10000), its one-global-in-six layer pattern,
and its softmax scale; Qwen3-MoE's renormalized top-k weights. The LM head is tied when the file
has no ``output.weight`` (as transformers decides).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitserve.engine.model.gguf.reader import GGUFError, GGUFFile
from splitserve.engine.model.registry import architecture_for_gguf

# GGUF metadata key (after "{arch}.") -> HF config key, for every supported architecture.
_COMMON_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by hidden / heads, not head_dim


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``gguf`` (``architectures``, sizes, RoPE, token ids).

    Raises:
        GGUFError: an unsupported architecture, a missing size, or a RoPE layout we do not
            implement (partial rotary).
    """
    try:
        arch = architecture_for_gguf(gguf.architecture)
    except ValueError as exc:
        raise GGUFError(f"{gguf.path}: {exc}") from None
    cfg: dict[str, Any] = {"architectures": [arch.name]}
    for key, hf_key in _COMMON_KEYS.items():
        value = gguf.arch_field(key)
        if value is not None:
            cfg[hf_key] = value
    for needed in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if needed not in cfg:
            raise GGUFError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{needed}")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{gguf.path}: no token_embd.weight tensor")
    cfg["vocab_size"] = int(embd.shape[-1])  # GGUF lists [hidden, vocab]
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rot = gguf.arch_field("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFError(
            f"{gguf.path}: partial rotary embedding ({rot} of {head_dim} dims) is not supported"
        )
    cfg["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = gguf.field(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    scaling = _rope_scaling(gguf)
    if arch.family == "gemma3":
        _gemma3(gguf, cfg, scaling)
    else:
        if scaling:
            cfg["rope_scaling"] = scaling
        if arch.family == "qwen3_moe":
            cfg["norm_topk_prob"] = True  # llama.cpp's qwen3moe always renormalizes
            cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size", 0))
        elif arch.family == "phi3":
            _phi3(gguf, cfg)
    if "intermediate_size" not in cfg:
        raise GGUFError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.feed_forward_length")
    return cfg


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    kind = gguf.arch_field("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf.arch_field("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = gguf.arch_field("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(orig)}
    raise GGUFError(f"{gguf.path}: unsupported rope scaling type {kind!r}")


def _gemma3(gguf: GGUFFile, cfg: dict[str, Any], scaling: dict[str, Any] | None) -> None:
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = [
        "sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
        for i in range(n)
    ]
    cfg["rope_parameters"] = {
        "full_attention": {"rope_theta": cfg.pop("rope_theta", 1e6),
                           **(scaling or {"rope_type": "default"})},
        "sliding_attention": {"rope_theta": GEMMA3_LOCAL_ROPE_THETA, "rope_type": "default"},
    }
    cfg["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // cfg["num_attention_heads"] if n == GEMMA3_27B_LAYERS
        else cfg["head_dim"]
    )
    cfg["hidden_activation"] = "gelu_pytorch_tanh"


def _phi3(gguf: GGUFFile, cfg: dict[str, Any]) -> None:
    """LongRoPE: llama.cpp stores the factors as the tensors ``rope_factors_long/short``."""
    long_t, short_t = (gguf.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long_t is None and short_t is None:
        return
    if long_t is None or short_t is None:
        raise GGUFError(f"{gguf.path}: only one of rope_factors_long/short is present")
    orig = gguf.arch_field("rope.scaling.original_context_length")
    if orig is None:
        raise GGUFError(f"{gguf.path}: LongRoPE factors without rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": np.asarray(long_t.data, dtype=np.float32).tolist(),
        "short_factor": np.asarray(short_t.data, dtype=np.float32).tolist(),
        "original_max_position_embeddings": int(orig),
    }
    attn = gguf.arch_field("rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    cfg["rope_scaling"] = scaling
