"""All decoder layers of a small decode-only step in one C call (``csrc/decode_layers.c``).

At 1-3 rows a CPU bfloat16 step is memory-bound matrix work plus ~10 Python-level calls per layer
(modules, ctypes calls, tensor allocations), which were about a quarter of the step at batch 1;
at batch 32 with the AVX512_BF16 tiles (2 threads) they were ~9% of it.
This path runs the same kernels in the same order as the per-op path (``llama.py`` with
``cpu_kernels``), so its results are bit-identical to it.

A model family whose layer is the one the C loop implements (the Llama family's; Qwen3's q/k
norms, Gemma 3's norms and GELU, and per-layer windows are not) offers a
:class:`FusedDecodeLayers` from ``DecoderLM.fused_decode_layers``, built once its weights are
packed; the others return None. Which steps it takes is the step plan's decision
(``engine.step_plan``), not this module's.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.base import BaseAttentionBackend
from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import Linear
from splitserve.engine.model.rope import RotaryEmbedding


def layer_pointers(layers: nn.ModuleList) -> torch.Tensor | None:
    """``[L * 15]`` int64 addresses of every layer's norm weights and, per projection, its
    packed weight, bias and int8 or int4 scales (0 when absent: a bfloat16 weight), then the
    layer's weight bits (16, 8 or 4: a number), in ``decode_layers.c``'s order; None if a
    projection has no C decode weight or a layer mixes int8 and int4. The tensors stay owned
    by the model (they never move after packing).
    """
    ptrs: list[int] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        bits: set[int] = set()
        for item in (
            layer.input_layernorm.weight, attn.qkv_proj, attn.o_proj,
            layer.post_attention_layernorm.weight, mlp.gate_up_proj, mlp.down_proj,
        ):
            if isinstance(item, Linear):
                if item.kernels is None:
                    return None
                w, scales, b = item.decode_packed, None, 16
                if item.int8 is not None:  # --quantization int8: gemm_w8.c's weight
                    w, scales, b = item.int8.packed, item.int8.scales, 8
                if item.int4 is not None:  # --quantization int4: gemm_w4.c's weight
                    w, scales, b = item.int4.packed, item.int4.scales, 4
                bits.add(b)
                if w is None:
                    return None
                ptrs += [w.data_ptr(), 0 if item.bias is None else item.bias.data_ptr(),
                         0 if scales is None else scales.data_ptr()]
            else:
                ptrs.append(item.data_ptr())
        bits.discard(16)  # a bfloat16 projection (no scales) mixes with either kind
        if len(bits) > 1:
            return None
        ptrs.append(bits.pop() if bits else 16)
    return torch.tensor(ptrs, dtype=torch.int64)


class FusedDecodeLayers:
    """A model's decoder layers as one C call for decode-only steps, over the attention
    backend's decode cache (:meth:`BaseAttentionBackend.fused_decode_targets`).

    Rows of one sequence may share its cache slot (a verify step's drafted positions,
    ``ForwardBatch.as_decode_rows``): each layer appends every row's K/V (``kv_append_*``)
    before any row attends, and each row attends to its slot's keys below its own length only
    (``decode_attention_bf16``), so a row sees its sequence up to its own position, the drafts
    before it included.

    Args:
        kernels: the C kernels the weights were packed for.
        config: the model's config (sizes, ``rms_norm_eps``).
        rope: the model's RoPE table (float32 cos/sin).
        ptrs: :func:`layer_pointers` of the model's layers (this object owns the table; the
            weights it points to stay the model's).
        window: the sliding window every layer shares (None: none).
    """

    def __init__(self, kernels: CpuKernels, config: ModelConfig, rope: RotaryEmbedding,
                 ptrs: torch.Tensor, window: int | None) -> None:
        self.kernels = kernels
        self.config = config
        self.rope = rope
        self.ptrs = ptrs
        self.window = window

    @classmethod
    def build(cls, layers: nn.ModuleList, config: ModelConfig, kernels: CpuKernels | None,
              rope: RotaryEmbedding, dtype: torch.dtype) -> FusedDecodeLayers | None:
        """The fused layers of Llama-family ``layers`` once packed, or None where the C loop
        cannot run them: no C kernels packed (CUDA, float32, C kernels off), a hidden state
        other than bfloat16, per-layer windows, heads the C attention does not take, or a
        projection without a C weight (or a layer mixing int8 and int4)."""
        if kernels is None or dtype != torch.bfloat16:
            return None
        if len(set(config.layer_windows)) != 1:
            return None  # the C layer loop has one window for every layer
        if not CpuKernels.supports(config.num_heads, config.num_kv_heads, config.head_dim):
            return None
        ptrs = layer_pointers(layers)
        if ptrs is None:
            return None
        return cls(kernels, config, rope, ptrs, config.layer_windows[0])

    def serves(self, backend: BaseAttentionBackend, pool: KVPool) -> bool:
        """Whether ``backend`` gives these layers a decode cache and C attention over ``pool``
        (a fact for the step planner, ``engine.step_plan``)."""
        return backend.serves_fused_decode(pool, self.config.num_heads)

    def run(self, x: torch.Tensor, batch: ForwardBatch, backend: BaseAttentionBackend,
            meta: object, pool: KVPool,
            lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Run every decoder layer on ``x [T, hidden]`` (bfloat16, updated in place) for the
        decode-only ``batch`` the step plan gave them, writing the new K/V to ``pool`` and the
        decode cache. ``meta``: the backend's metadata for ``batch``; ``lora``: the step's
        LoRA table and adapted rows (``engine.lora.adapters.ModelAdapters.fused_args``), or
        None.

        Returns:
            Whether it ran: False (nothing touched; the caller runs the layers) where the
            decode cache did not take the step (its memory bound) or ``x`` is not a contiguous
            bfloat16 tensor.

        Raises:
            RuntimeError: the C call failed after it may have written (not expected).
        """
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            return False
        targets = backend.fused_decode_targets(meta)
        if targets is None:
            return False
        rc = self.kernels.decode_layers(
            self.ptrs, x, self.config, self.rope, batch.positions, pool, batch.out_page_ids,
            batch.out_offsets, targets.kt, targets.v, targets.slots, targets.positions,
            targets.lens, self.window, lora, targets.pages,
        )
        if rc != 0:
            raise RuntimeError(f"fused decode layers failed (code {rc})")
        return True
