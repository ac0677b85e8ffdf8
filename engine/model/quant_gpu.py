"""``--quantization int8|int4`` on a CUDA device: the weights the Triton kernels read
(``engine.kernels.triton.quant_matmul``), made at load from the same quantizers as on CPU
(``engine.model.quant``, ``engine.model.quant_int4``), so the served weight ``W'`` is the same.

On CUDA only the quantized copy stays on the device: the projection's float parameter is
released (:func:`release`), so a bfloat16 model's decoder projections take 1 byte per weight
plus 4 per output row (int8) or 0.625 byte per weight (int4) instead of 2, and each decode step
reads that much. The tied embedding table stays (a lookup reads it); an untied LM head's
parameter is released like the projections. Triton is imported only here, when a CUDA model is
quantized, so CPU runs never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.engine.model.quant import quantize_int8
from splitserve.engine.model.quant_int4 import quantize_int4

if TYPE_CHECKING:
    from splitserve.engine.kernels.triton.quant_matmul import TritonInt4Weight, TritonInt8Weight


def on_cuda(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is served by the Triton kernels once quantized (a CUDA tensor)."""
    return weight.device.type == "cuda"


def gpu_int8(weight: torch.Tensor) -> TritonInt8Weight:
    """``weight [N, K]`` (CUDA, any float dtype) -> its int8 form for the Triton kernel: the
    ``W'`` of ``engine.model.quant`` (per-channel scales, float32)."""
    from splitserve.engine.kernels.triton.quant_matmul import TritonInt8Weight

    q, scales = quantize_int8(weight)
    return TritonInt8Weight(q, scales)


def gpu_int4(weight: torch.Tensor, exact: torch.Tensor | None = None) -> TritonInt4Weight:
    """``weight [N, K]`` (CUDA) -> its int4 form for the Triton kernel: the ``W'`` of
    ``engine.model.quant_int4``; ``exact``: the loaded float32 weight where the loader kept
    it (GGUF Q4_0, quantized on its symmetric grid as on CPU).

    Raises:
        ValueError: ``K`` not a multiple of 32.
    """
    from splitserve.engine.kernels.triton.quant_matmul import TritonInt4Weight

    source = weight if exact is None else exact.to(weight.device)
    u, scales, offsets = quantize_int4(source, symmetric=exact is not None)
    return TritonInt4Weight(u, scales, offsets)


def release(param: torch.Tensor) -> None:
    """Drop ``param``'s ``[N, K]`` storage, leaving a ``[0, K]`` tensor: a reader that still
    multiplies by it gets an empty product and fails loudly rather than reading stale
    weights."""
    param.data = param.data.new_empty(0, param.shape[1])
