"""All decoder layers of a small decode-only step in one C call (``csrc/decode_layers.c``).

At 1-3 rows a CPU bfloat16 step is memory-bound matrix work plus ~10 Python-level calls per layer
(modules, ctypes calls, tensor allocations), which were about a quarter of the step at batch 1;
at batch 32 with the AVX512_BF16 tiles (2 threads) they were ~9% of it.
This path runs the same kernels in the same order as the per-op path (``llama.py`` with
``cpu_kernels``), so its results are bit-identical to it; it applies only when every piece it
replaces would have taken its kernel: see :func:`run_fused_decode_layers`.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.layers import Linear


def layer_pointers(model: torch.nn.Module) -> torch.Tensor | None:
    """``[L * 15]`` int64 addresses of every layer's norm weights and, per projection, its
    packed weight, bias and int8 or int4 scales (0 when absent: a bfloat16 weight), then the
    layer's weight bits (16, 8 or 4: a number), in ``decode_layers.c``'s order; None if a
    projection has no C decode weight or a layer mixes int8 and int4. The tensors stay owned
    by the model (they never move after packing).
    """
    ptrs: list[int] = []
    for layer in model.layers:  # type: ignore[attr-defined]
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


def fuses_decode_rows(model: torch.nn.Module, pool: KVPool, num_rows: int) -> bool:
    """Whether :func:`run_fused_decode_layers` takes a decode-only step of ``num_rows`` rows
    over ``pool``, as far as that is known before the step's attention metadata exists (the
    same checks, kept in step with it): the
    model's layers are the ones the C loop implements (the Llama family's, which says so with
    ``supports_fused_decode``; Qwen3's q/k norms, Gemma 3's norms and GELU, and per-layer
    windows are not), its fused path and C kernels are on, ``num_rows <= model.c_max_rows``
    (the rows up to which its kernel plan keeps the C products: ``engine.model.kernel_plan``),
    the torch backend keeps a decode cache for the CPU pool, and the C attention kernel takes
    the heads and the pool, and the model computes in bfloat16. What remains is the decode
    cache's plan (it may not fit its memory bound)."""
    cfg = getattr(model, "config", None)
    backend = getattr(model, "attn_backend", None)
    if cfg is None or getattr(model, "kernels", None) is None:
        return False
    if getattr(model, "dtype", None) != torch.bfloat16:  # the hidden state's dtype
        return False
    if not getattr(model, "fused_decode", False):
        return False
    if not getattr(model, "supports_fused_decode", False):
        return False
    if not isinstance(backend, TorchAttentionBackend) or not backend.use_decode_cache:
        return False
    if len(set(cfg.layer_windows)) > 1:
        return False  # the C layer loop is Llama's layer, with one window for every layer
    if num_rows > model.c_max_rows or num_rows > getattr(model, "w4_c_rows", num_rows):
        return False  # int4 steps where the plan picked torch's int4 kernel: the per-op path
    if not CpuKernels.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
        return False
    # Its KV append writes bfloat16 or 8-bit pages (``kv_quant.c``), as the per-op path's does.
    return backend._kernels_for(pool, cfg.num_heads) is not None and pool.buffer.is_contiguous()


def run_fused_decode_layers(
    model: torch.nn.Module, x: torch.Tensor, meta: object, pool: KVPool
) -> bool:
    """Run every decoder layer on ``x [T, hidden]`` (bfloat16, updated in place) if the step
    qualifies: the model's layers are the ones the C loop implements (the Llama family's, which
    says so with ``supports_fused_decode``; Qwen3's q/k norms, Gemma 3's norms and GELU, and
    per-layer windows are not), the model's C kernels are on, ``T <= model.c_max_rows`` (the rows
    up to which its kernel plan keeps the C products: ``engine.model.kernel_plan``), every row
    decodes, the torch backend's decode cache serves the step and its C attention kernel takes
    the heads (the model-level checks are :func:`fuses_decode_rows`'s, which the runner also asks
    before a step's metadata exists).
    Rows of one sequence may share its cache slot (a verify step's drafted positions,
    ``ForwardBatch.as_decode_rows``): each layer appends every row's K/V (``kv_append_*``)
    before any row attends, and each row attends to its slot's keys below its own length only
    (``decode_attention_bf16``), so a row sees its sequence up to its own position, the drafts
    before it included.
    Returns whether it ran (else nothing was touched and the caller runs the layers).

    Raises:
        MemoryError / RuntimeError: the C call failed after it may have written (not expected).
    """
    if not fuses_decode_rows(model, pool, x.shape[0]):
        return False
    if not isinstance(meta, TorchAttentionMetadata) or not meta.is_decode_only:
        return False
    if len(set(meta.windows)) != 1:
        return False  # the C layer loop has one window for every layer
    kernels: CpuKernels = model.kernels  # type: ignore[assignment]
    plan, cache = meta.decode_plan, model.attn_backend.decode_cache  # type: ignore[union-attr]
    if plan is None or cache is None or cache.kt is None or cache.v is None:
        return False
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        return False
    cfg = model.config  # type: ignore[attr-defined]
    ptrs = model._fused_layer_ptrs  # type: ignore[attr-defined]
    if ptrs is None:
        ptrs = layer_pointers(model)
        if ptrs is None:
            return False
        model._fused_layer_ptrs = ptrs  # type: ignore[attr-defined]
    kt, v, slots, positions = cache.append_all_targets(plan)
    batch = meta.batch
    rc = kernels.decode_layers(
        ptrs, x, cfg, model.rope, batch.positions, pool, batch.out_page_ids,  # type: ignore[attr-defined]
        batch.out_offsets, kt, v, slots, positions, plan.lens, meta.windows[0],
    )
    if rc != 0:
        raise RuntimeError(f"fused decode layers failed (code {rc})")
    return True
