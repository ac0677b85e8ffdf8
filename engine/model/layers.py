"""Building blocks shared by the model files: linear, RMSNorm, gated MLP, embedding, LM head.

Parameters are created uninitialized (``torch.empty``): the loader fills every one of them, and
random init of a large model would cost seconds for nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.kernels.cpu.features import onednn_packs_bf16
from splitserve.engine.model.quant import Int8Weight, quantize_weight_int8
from splitserve.engine.model.quant_gpu import gpu_int4, gpu_int8, on_cuda, release
from splitserve.engine.model.quant_int4 import Int4Weight, quantize_weight_int4, torch_int4_mm
from splitserve.engine.step_plan import Product

if TYPE_CHECKING:
    from splitserve.engine.kernels.triton.quant_matmul import TritonInt4Weight, TritonInt8Weight


class ProjectionAdapters(Protocol):
    """What a :class:`Linear` asks of its LoRA adapters (``engine.lora``, which sets
    ``Linear.lora`` on the projections adapters may target): add the step's low-rank products
    of the rows that run under an adapter."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y [T, out]`` (the base product of ``x [T, in]``) plus each adapted row's
        ``s * (x A^T) B^T``; ``y`` itself when no row of the step has an adapter here."""


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized, frozen parameter of ``shape`` (the loader fills it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def is_cpu_bf16(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a bfloat16 tensor on the CPU: what our C decode kernels take (they
    build on any x86-64 CPU, with AVX-512 paths where the CPU has them)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a bfloat16 weight on a CPU whose oneDNN packs it
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2-only CPUs)."""
    return (
        is_cpu_bf16(weight)
        and torch.backends.mkldnn.is_available()
        and onednn_packs_bf16()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor, batch_hint: int = 32) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout, once, so each product skips
    the reorder: ~20% less time per bfloat16 product at 1-512 rows, bit-identical results."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def int8_kernels(weight: torch.Tensor, use_cpu_kernels: bool = True) -> CpuKernels | None:
    """The C kernels for int8 decode products of a weight served in bfloat16 on CPU, or None
    (kernels off, not built, or neither AVX512-VNNI nor AVX2 without AVX-512: the de-quantized
    weight serves then)."""
    if not use_cpu_kernels or not is_cpu_bf16(weight):
        return None
    kernels = load_cpu_kernels()
    return kernels if kernels is not None and kernels.has_w8 else None


def int4_kernels(weight: torch.Tensor, use_cpu_kernels: bool = True) -> CpuKernels | None:
    """Like :func:`int8_kernels`, for the int4 products (``gemm_w4.c``, AVX512-VNNI)."""
    if not use_cpu_kernels or not is_cpu_bf16(weight):
        return None
    kernels = load_cpu_kernels()
    return kernels if kernels is not None and kernels.has_w4 else None


def _quant_kernels(layer: Linear, use_cpu_kernels: bool) -> CpuKernels | None:
    if layer.int4 is not None:
        return int4_kernels(layer.weight, use_cpu_kernels)
    return int8_kernels(layer.weight, use_cpu_kernels)


def _int4_product(layer: Linear, x: torch.Tensor, product: Product) -> torch.Tensor:
    """The int4 decode product: torch's CPU int4 kernel under ``Product.C_TORCH_INT4`` where
    it packed the weight, else ours (``gemm_w4.c``); the kernel plan measures which is faster
    at each step size (``engine.model.kernel_plan``) and the step plan applies it."""
    w = layer.int4
    assert w is not None and layer.kernels is not None
    if product is Product.C_TORCH_INT4 and w.torch_packed is not None:
        return torch_int4_mm(x, w.torch_packed, w.torch_sz, layer.bias)
    return layer.kernels.linear_w4(x, w.packed, w.scales, layer.bias)


def pack_decode(
    weight: torch.Tensor, use_cpu_kernels: bool = True
) -> tuple[CpuKernels | None, torch.Tensor | None]:
    """The C kernels and ``weight`` packed for their decode-step products (CPU bfloat16 only,
    where :func:`is_cpu_bf16`), or ``(None, None)`` (also when ``use_cpu_kernels`` is off or the
    kernels do not build)."""
    if not use_cpu_kernels or not is_cpu_bf16(weight) or not CpuKernels.can_pack_decode(weight):
        return None, None
    kernels = load_cpu_kernels()
    if kernels is None:
        return None, None
    return kernels, CpuKernels.pack_decode(weight.data)


class Linear(nn.Module):
    """``y = x @ W.T + b``; ``W [out, in]``. Fused projections are one Linear with the HF
    weights stacked along ``out`` (the loader writes each HF shard into its row slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None
        # LoRA adapters on this projection (engine.lora), where the server serves them.
        self.lora: ProjectionAdapters | None = None
        self.packed: torch.Tensor | None = None  # set by pack(); not a parameter
        # Set by pack() too: the C kernels for decode steps and the weight in their layout,
        # used for the steps whose plan says Product.C (engine.step_plan).
        self.kernels: CpuKernels | None = None
        self.decode_packed: torch.Tensor | None = None
        self.int8: Int8Weight | None = None  # set by quantize_int8(): the C products' weight
        self.int4: Int4Weight | None = None  # set by quantize_int4()
        # CUDA: the Triton kernels' weight, set by quantize_int8/int4 (engine.model.quant_gpu);
        # every product takes it and the float parameter is released.
        self.gpu_weight: TritonInt8Weight | TritonInt4Weight | None = None

    def quantize_int8(self) -> None:
        """Weight-only int8 (``engine.model.quant``): on CPU the weight becomes its
        de-quantized value and decode steps take the int8 C products; on CUDA every product
        takes the Triton kernel and the float weight is released (``engine.model.quant_gpu``).
        Call after loading, before pack."""
        if on_cuda(self.weight):
            self.gpu_weight = gpu_int8(self.weight.data)
            release(self.weight)
            return
        self.int8 = quantize_weight_int8(self.weight.data)

    def quantize_int4(self, exact: torch.Tensor | None = None) -> None:
        """Group-wise int4 (``engine.model.quant_int4``), like :meth:`quantize_int8`;
        ``exact``: the loaded weight in float32 where the loader kept it (GGUF Q4_0)."""
        if on_cuda(self.weight):
            self.gpu_weight = gpu_int4(self.weight.data, exact)
            release(self.weight)
            return
        self.int4 = quantize_weight_int4(self.weight.data, exact)

    def pack(self, use_cpu_kernels: bool = True) -> None:
        """Pre-pack the weight for oneDNN if :func:`can_pack` (call after loading; the plain
        weight stays, for anything that reads parameters), and for the C decode products (steps
        of at most ``kernels.decode_max_rows`` rows) when ``use_cpu_kernels`` and they build:
        the int8 ones after :meth:`quantize_int8`, else the bfloat16 ones."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight.data)
        if self.int8 is not None or self.int4 is not None:
            self.kernels = _quant_kernels(self, use_cpu_kernels)
        else:
            self.kernels, self.decode_packed = pack_decode(self.weight, use_cpu_kernels)

    def drop_plain_weight(self) -> int:
        """After :meth:`pack`, where oneDNN's packed copy exists: release the plain weight's
        storage (``quant_gpu.release``: a ``[0, in]`` tensor), which no product reads then
        (:meth:`forward` takes the C kernels' copy or oneDNN's, never ``F.linear``). Returns the
        bytes freed (0: nothing packed, nothing dropped)."""
        if self.packed is None or self.weight.numel() == 0:
            return 0
        freed = _bytes(self.weight)
        release(self.weight)
        return freed

    def packed_bytes(self) -> int:
        """Bytes of the packed copies (a oneDNN copy counted as the weight's size, ``[out,
        in]`` bfloat16: its storage is opaque to torch) and of the int8 or int4 weight."""
        int8 = self.int8.nbytes if self.int8 is not None else 0
        int8 += self.int4.nbytes if self.int4 is not None else 0
        int8 += self.gpu_weight.nbytes if self.gpu_weight is not None else 0
        onednn = self.out_features * self.in_features * 2 if self.packed is not None else 0
        return onednn + _bytes(self.decode_packed) + int8

    def c_product(self, x: torch.Tensor, product: Product = Product.C) -> torch.Tensor:
        """The C decode product on ``x [T, in]`` bfloat16 (``kernels`` set by :meth:`pack`):
        int8 or int4 weights after :meth:`quantize_int8` / :meth:`quantize_int4` (int4: torch's
        int4 kernel under ``Product.C_TORCH_INT4``), else the bfloat16 pair layout."""
        assert self.kernels is not None
        if self.int4 is not None:
            return _int4_product(self, x, product)
        if self.int8 is not None:
            return self.kernels.linear_w8(x, self.int8.packed, self.int8.scales, self.bias)
        return self.kernels.linear_decode(x, self.decode_packed, self.bias)

    def forward(self, x: torch.Tensor, product: Product) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]`` by ``product``, the step plan's choice for the
        decoder layers (``engine.step_plan``): the C products where this module packed their
        weight, else oneDNN's packed product, else (no oneDNN copy: AVX2) the C product at any
        row count, else ``F.linear`` (CUDA: the Triton kernel of a
        quantized weight, whatever ``product`` says); then the step's LoRA products, if any
        row runs under an adapter of this projection."""
        if self.gpu_weight is not None:
            y = self.gpu_weight(x, self.bias)
        elif product is not Product.TORCH and self.kernels is not None and x.dim() == 2 and (
                self.int8 is not None or self.int4 is not None or self.decode_packed is not None):
            y = self.c_product(x.contiguous(), product)
        elif self.packed is not None:
            y = packed_linear(x, self.packed, self.bias)
        elif ((self.decode_packed is not None or self.int8 is not None)
              and self.kernels is not None and x.dim() == 2 and x.shape[0] > 0):
            # bfloat16 or int8 weights where oneDNN packs nothing (AVX2): our product at any row
            # count, 5-7x torch's emulated bfloat16 one at 32 rows (docs/performance.md, Zen 3;
            # int8 prompt steps had gone to F.linear on the de-quantized weight: 26 s TTFT at
            # c=32).
            y = self.c_product(x.contiguous())
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class LMHead:
    """The vocab projection ``h [N, hidden] -> float32 logits [N, vocab]`` over ``weight``
    (the LM head, or the tied embedding table), with the same packed paths as :class:`Linear`:
    the C kernel for small decode steps (int8 after :meth:`quantize_int8`), oneDNN's packed
    copy, else ``F.linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape  # vocab, hidden
        self.packed: torch.Tensor | None = None
        self.kernels: CpuKernels | None = None
        self.decode_packed: torch.Tensor | None = None
        # Set by quantize_int8, under --quantization int8 and int4 alike (the head stays at 8
        # bits under int4: DecoderLM.quantize_weights).
        self.int8: Int8Weight | None = None
        self.gpu_weight: TritonInt8Weight | None = None  # as Linear's

    def quantize_int8(self) -> None:
        """Like :meth:`Linear.quantize_int8`, on a copy: a tied head shares the embedding table,
        which stays unquantized (a lookup reads one row per token). On CUDA no float copy is
        made: the Triton kernel's int8 weight only (``DecoderLM.quantize_weights`` releases an
        untied head's parameter)."""
        if on_cuda(self.weight):
            self.gpu_weight = gpu_int8(self.weight.detach())
            return
        self.weight = self.weight.detach().clone()
        self.int8 = quantize_weight_int8(self.weight)

    def pack(self, use_cpu_kernels: bool = True) -> CpuKernels | None:
        """Pack like :meth:`Linear.pack`; returns the C kernels when they serve."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight.data)
        if self.int8 is not None:
            self.kernels = int8_kernels(self.weight, use_cpu_kernels)
        else:
            self.kernels, self.decode_packed = pack_decode(self.weight, use_cpu_kernels)
        return self.kernels

    def drop_plain_weight(self) -> int:
        """After :meth:`pack`, under int8 with oneDNN's packed copy: release the head's own
        de-quantized copy (:meth:`quantize_int8`'s; never the tied embedding table), which no
        product reads then. Returns the bytes freed."""
        if self.int8 is None or self.packed is None or self.weight.numel() == 0:
            return 0
        freed = _bytes(self.weight)
        release(self.weight)
        return freed

    def packed_bytes(self) -> int:
        # After quantize_int8 the weight is a copy too (the parameter it came from stays),
        # until drop_plain_weight releases it.
        int8 = self.int8.nbytes + _bytes(self.weight) if self.int8 is not None else 0
        int8 += self.gpu_weight.nbytes if self.gpu_weight is not None else 0
        onednn = self.out_features * self.in_features * 2 if self.packed is not None else 0
        return onednn + _bytes(self.decode_packed) + int8

    def c_product(self, h: torch.Tensor) -> torch.Tensor:
        """The C decode product on ``h [T, hidden]`` bfloat16 (``kernels`` set by :meth:`pack`):
        the int8 weight after :meth:`quantize_int8`, else the bfloat16 pair layout."""
        assert self.kernels is not None
        if self.int8 is not None:
            return self.kernels.linear_w8(h, self.int8.packed, self.int8.scales, None)
        return self.kernels.linear_decode(h, self.decode_packed, None)

    def __call__(self, h: torch.Tensor, product: Product) -> torch.Tensor:
        """``h [N, hidden]`` -> float32 logits ``[N, vocab]`` by ``product``, the step plan's
        choice for the head (``engine.step_plan``), as :meth:`Linear.forward` takes it."""
        if self.gpu_weight is not None:
            return self.gpu_weight(h).float()
        if h.shape[0] == 0:  # a step of prompt chunks that finish no prompt samples nothing
            return h.new_empty(0, self.out_features, dtype=torch.float32)
        if product is not Product.TORCH and self.kernels is not None:
            return self.c_product(h.contiguous()).float()
        if self.packed is not None:
            return packed_linear(h, self.packed, None).float()
        if (self.decode_packed is not None or self.int8 is not None) and self.kernels is not None:
            return self.c_product(h.contiguous()).float()  # as Linear's (AVX2)
        return F.linear(h, self.weight).float()


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class RMSNorm(nn.Module):
    """RMSNorm as transformers' Llama computes it: statistics in float32, the normalized value
    cast back to the input dtype before the weight multiply (so bf16 rounds where HF rounds)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps
        self.kernels: CpuKernels | None = None  # the C kernel for bfloat16 on CPU, when set

    def _use_kernel(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.dtype == torch.bfloat16 and x.dim() == 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> same shape and dtype."""
        if self._use_kernel(x) and x.stride(1) == 1:
            assert self.kernels is not None
            return self.kernels.rms_norm(x, self.weight, self.eps)[0]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` for ``x``, ``residual [T, hidden]``: one C
        call in bfloat16 on CPU (same rounding), else two steps."""
        if self._use_kernel(x) and x.stride(1) == 1 and residual.is_contiguous():
            assert self.kernels is not None
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        res = residual + x
        return self(res), res


ACTIVATIONS = {
    "silu": F.silu,
    # GELU with the tanh approximation: transformers' "gelu_pytorch_tanh" (Gemma).
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj``;
    ``act`` is SiLU (the C kernel serves it in bfloat16 on CPU) or another of
    :data:`ACTIVATIONS`.

    Raises:
        ValueError: an activation not in :data:`ACTIVATIONS`.
    """

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype)
        self.down_proj = Linear(intermediate, hidden, bias, dtype)
        self.kernels: CpuKernels | None = None  # the C silu-multiply for bfloat16 on CPU

    def forward(self, x: torch.Tensor, product: Product) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; ``product``: the step plan's for the layers."""
        gate_up = self.gate_up_proj(x, product)
        if (
            self.kernels is not None and self.activation == "silu"
            and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2
        ):
            return self.down_proj(self.kernels.silu_mul(gate_up.contiguous()), product)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up, product)


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` int64 -> ``[T, hidden]``."""
        return F.embedding(ids, self.weight)
