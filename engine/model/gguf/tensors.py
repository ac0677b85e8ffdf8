"""GGUF tensor names and layouts -> the Hugging Face checkpoint names our model files map.

llama.cpp renames every tensor (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``,
gguf-py's ``tensor_mapping.py`` lists them) and changes three things on the way, which are undone
here the way transformers undoes them, so that both load the same numbers:

- ``llama``: the q/k projection rows are permuted from HF's half-split RoPE pairs into
  interleaved pairs; they are permuted back.
- ``gemma3``: every ``*norm.weight`` is stored as ``1 + w`` (Gemma's norm multiplies by
  ``1 + w``); ``1`` is subtracted again, in float32.
- ``qwen3moe``: the experts' weights are stacked, ``[experts, rows, cols]``; each expert is yielded
  under its HF name.

Tensors are de-quantized to float32 as they are yielded; :class:`GGUFTensor` keeps the GGML
type, so a later loader can keep one quantized instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from splitserve.engine.model.gguf.reader import GGUFFile

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {**_LAYER, "ffn_up": "mlp.gate_up_proj"}  # Phi-3 keeps gate and up fused
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Read into the config instead (Phi-3's LongRoPE factors).
_CONFIG_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One checkpoint tensor from a GGUF file.

    Attributes:
        hf_name: its Hugging Face checkpoint name.
        gguf_name: the GGUF tensor it comes from.
        tensor_type: that tensor's GGML type (``Q4_K``).
        load: de-quantizes it: float32, in the HF tensor's shape.
    """

    hf_name: str
    gguf_name: str
    tensor_type: str
    load: Callable[[], torch.Tensor]


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The HF name of a GGUF tensor that maps one to one, or None (stacked experts, config
    tensors, or a name we do not know)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    table = {"gemma3": _GEMMA3_LAYER, "phi3": _PHI3_LAYER}.get(architecture, _LAYER)
    ours = table.get(part)
    return None if ours is None else f"model.layers.{layer}.{ours}.{kind}"


def iter_tensors(gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> Iterator[GGUFTensor]:
    """Every tensor of ``gguf`` under its HF name, de-quantized on ``load()``.

    Args:
        gguf: the checked file.
        num_heads, num_kv_heads: attention heads (to undo llama's q/k row permutation).

    A name this module does not know is yielded as it is; the loader then reports the HF
    tensors the model lacks.
    """
    arch = gguf.architecture
    for name, t in gguf.tensors.items():
        ttype = gguf.tensor_types[name]
        if name in _CONFIG_TENSORS:
            continue
        m = _BLOCK.fullmatch(name)
        if m is not None and m.group(2) in _EXPERTS:
            layer, part, kind = m.groups()
            yield from _experts(gguf, name, ttype, int(t.shape[-1]), layer, _EXPERTS[part], kind)
            continue
        target = hf_name(name, arch) or name
        yield GGUFTensor(target, name, ttype, _loader(gguf, name, arch, num_heads, num_kv_heads))


def _loader(
    gguf: GGUFFile, name: str, arch: str, num_heads: int, num_kv_heads: int
) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        w = gguf.dequantize(name)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = num_heads if ".attn_q." in name else num_kv_heads
            w = unpermute_rope_rows(w, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0
        return w

    return load


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows ``[pair 0 x, pair 0 y, pair 1 x, ...]``
    back to HF's ``[x of every pair, then y of every pair]`` (works for weights and biases)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _experts(
    gguf: GGUFFile, name: str, ttype: str, num_experts: int, layer: str, proj: str, kind: str
) -> Iterator[GGUFTensor]:
    """One stacked ``[experts, rows, cols]`` tensor as each expert's HF tensor; the stack is
    de-quantized once, by the first expert's ``load``, and shared by the rest."""
    cache: dict[str, torch.Tensor] = {}

    def expert(e: int) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            if "all" not in cache:
                cache["all"] = gguf.dequantize(name)
            out = cache["all"][e]
            if e == num_experts - 1:
                cache.clear()
            return out

        return load

    for e in range(num_experts):
        hf = f"model.layers.{layer}.mlp.experts.{e}.{proj}.{kind}"
        yield GGUFTensor(hf, name, ttype, expert(e))
