"""Tiny GGUF files for tests, written from a tiny Hugging Face checkpoint the way llama.cpp's
converter lays them out (its tensor names, llama's q/k row permutation, Gemma's ``1 + w`` norms,
stacked MoE experts), with gguf-py's writer and quantizers.

This table of names is written independently of ``engine/model/gguf/tensors.py`` (which maps
the other way), so a mapping bug there shows up as a mismatch against transformers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_GEMMA = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: per head, HF's half-split pairs into interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_dir: Path, out: Path, arch: str, hf: dict[str, Any], qtype: str,
    embed_type: str | None = None,
) -> Path:
    """Write the checkpoint in ``hf_dir`` (``model.safetensors``, config ``hf``) as a GGUF of
    architecture ``arch``: weight matrices (and stacked experts) in ``qtype``, the token
    embeddings in ``embed_type`` (default ``qtype``), norms and biases in F32 (as llama.cpp)."""
    import gguf
    from gguf.quants import quantize

    qt = gguf.GGMLQuantizationType
    tensors = load_file(str(hf_dir / "model.safetensors"))
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(hf.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(hf.get("rope_theta", 10000.0))
    w.add_vocab_size(hf["vocab_size"])
    if "head_dim" in hf:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    if "num_experts" in hf:
        w.add_expert_count(hf["num_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    table = _GEMMA if arch == "gemma3" else _LAYER
    experts: dict[str, dict[int, np.ndarray]] = {}

    def add(name: str, a: np.ndarray, kind: str) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if kind == "F32":
            w.add_tensor(name, a)
        elif kind == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, qt[kind]), raw_dtype=qt[kind])

    for name, a in sorted(tensors.items()):
        if name in _TOP:
            gname = _TOP[name]
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            assert m, name
            layer, part, kind = m.groups()
            e = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)_proj", part)
            if e:
                key = f"blk.{layer}.ffn_{e.group(2)}_exps.{kind}"
                experts.setdefault(key, {})[int(e.group(1))] = a
                continue
            gname = f"blk.{layer}.{table[part]}.{kind}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            a = _permute(a, heads if ".attn_q." in gname else kv)
        if arch == "gemma3" and gname.endswith("norm.weight"):
            a = a + 1.0
        kind = (embed_type or qtype) if gname == "token_embd.weight" else qtype
        add(gname, a, kind if a.ndim == 2 else "F32")
    for key, by_expert in experts.items():
        add(key, np.stack([by_expert[i] for i in sorted(by_expert)]), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
