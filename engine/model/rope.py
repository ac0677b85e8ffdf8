"""Rotary position embedding in the HF "rotate_half" convention (as transformers' Llama).

The first and second halves of each head are the two coordinates of every rotated pair, so for
``x = [x1, x2]``: ``out = [x1*cos - x2*sin, x2*cos + x1*sin]``. The cos/sin table is built once for
every position up to ``context_len`` in float32 (half width, ``[context_len, head_dim // 2]``).

Scaling types: ``default``, ``linear``, ``llama3``, ``yarn``, ``dynamic`` (NTK) and ``longrope``
(Phi-3). Dynamic NTK only changes frequencies past ``max_position_embeddings``, which is where our
table ends, so inside the context it equals the default (as in transformers).

LongRoPE (Ding et al., 2024, as Phi-3 uses it) has two sets of per-frequency factors: ``short``
for the original context, ``long`` beyond it, and multiplies cos/sin by an attention factor.
transformers picks the set per forward call from the longest position in it; here the set is
picked per position (``long`` from ``original_max_position_embeddings`` on), so a token's keys do
not depend on what else runs or what is cached: this equals transformers' incremental decoding
(each step's new token) and its prefill of any prompt within the original context, and differs
from it only for a prompt longer than the original context prefilled in one call (transformers
then rotates its early tokens with the long factors too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.kernels.cpu.bindings import CpuKernels


def inv_freq_and_scale(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, context_len: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the factor cos/sin are multiplied by.

    Raises:
        ValueError: an unknown ``rope_type``.
    """
    dim = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return inv, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, theta, scaling, context_len)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn, dynamic, longrope)"
    )


def longrope_freqs(
    head_dim: int, theta: float, s: dict[str, Any], context_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE's angles ``[context_len, head_dim // 2]`` float32 (short factors before
    ``original_max_position_embeddings``, long ones from there) and the cos/sin factor.

    Raises:
        ValueError: a factor list whose length is not ``head_dim // 2``.
    """
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or context_len / orig
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos = torch.arange(context_len, dtype=torch.float32)
    freqs = []
    for name, span in (("short_factor", pos[:orig]), ("long_factor", pos[orig:])):
        ext = torch.tensor(s[name], dtype=torch.float32)
        if ext.numel() != head_dim // 2:
            raise ValueError(f"longrope {name} has {ext.numel()} entries, expected {head_dim // 2}")
        freqs.append(torch.outer(span, 1.0 / (ext * theta**shape)))
    return torch.cat(freqs), float(attn)


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, out)


def _yarn(dim: int, base: float, s: dict[str, Any], context_len: int) -> tuple[torch.Tensor, float]:
    orig_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or context_len / orig_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig_len / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


class RotaryEmbedding:
    """Precomputed cos/sin table and its application to q/k.

    Args:
        head_dim: rotated width (whole head).
        theta: ``rope_theta``.
        scaling: HF rope scaling dict with ``rope_type``, or None.
        context_len: positions covered by the table.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, context_len: int
    ) -> None:
        if (scaling or {}).get("rope_type") == "longrope":
            assert scaling is not None
            freqs, attn_scale = longrope_freqs(head_dim, theta, scaling, context_len)
        else:
            inv, attn_scale = inv_freq_and_scale(head_dim, theta, scaling, context_len)
            pos = torch.arange(context_len, dtype=torch.float32)
            freqs = torch.outer(pos, inv)
        self.context_len = context_len
        self.cos = freqs.cos() * attn_scale  # [context_len, head_dim // 2] float32
        self.sin = freqs.sin() * attn_scale

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim // 2]`` in ``dtype`` for int64 ``positions [T]``.

        ``max_position`` (the largest of ``positions``, when the caller knows it) spares a
        device-to-host read of ``positions.max()``.

        Raises:
            ValueError: a position is past the context length.
        """
        if max_position is None and positions.numel():
            max_position = int(positions.max())
        if max_position is not None and max_position >= self.context_len:
            raise ValueError(
                f"position {max_position} exceeds context length {self.context_len}"
            )
        # Cast like transformers does (cos/sin to the activation dtype) so bf16 matches it too.
        cos = self.cos.to(positions.device)[positions].to(dtype).unsqueeze(1)
        sin = self.sin.to(positions.device)[positions].to(dtype).unsqueeze(1)
        return cos, sin

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def for_step(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None,
        kernels: CpuKernels | None,
    ) -> StepRope:
        """What every layer of one step needs to rotate its q/k (see :class:`StepRope`):
        the C kernel reads the float32 tables directly in bfloat16 on CPU, else the step's
        cos/sin rows are gathered once (:meth:`cos_sin`, which also checks the positions).

        Raises:
            ValueError: a position is past the context length.
        """
        use_kernel = kernels is not None and dtype == torch.bfloat16
        use_kernel = use_kernel and positions.device.type == "cpu" and self.cos.device.type == "cpu"
        if not use_kernel:
            cos, sin = self.cos_sin(positions, dtype, max_position)
            return StepRope(positions, cos, sin, self, None)
        if max_position is None and positions.numel():
            max_position = int(positions.max())
        if max_position is not None and max_position >= self.context_len:
            raise ValueError(
                f"position {max_position} exceeds context length {self.context_len}"
            )
        return StepRope(positions, None, None, self, kernels)


@dataclass(slots=True)
class StepRope:
    """One step's rotary inputs, shared by every layer.

    Attributes:
        positions: ``[T]`` int64 position of each token.
        cos: ``[T, 1, D // 2]`` in the activation dtype (torch path), or None (kernel path).
        sin: the same for sine.
        table: the model's :class:`RotaryEmbedding` (float32 tables).
        kernels: the C kernels (bfloat16 on CPU), or None.
    """

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    table: RotaryEmbedding
    kernels: CpuKernels | None

    def apply(self, qk: torch.Tensor) -> torch.Tensor:
        """Rotate ``qk [T, H, D]``: in place with the C kernel (returns ``qk``), else into a
        new tensor (:func:`apply_rope`). Both round as transformers does in bfloat16."""
        if self.kernels is not None and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]:
            self.kernels.rope_(qk, self.positions, self.table.cos, self.table.sin)
            return qk
        if self.cos is None or self.sin is None:
            self.cos, self.sin = self.table.cos_sin(
                self.positions, torch.bfloat16, int(self.positions.max())
            )
        return apply_rope(qk, self.cos, self.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos``/``sin [T, 1, D // 2]``; returns a new ``[T, H, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
