"""8-bit KV cache values (``--kv-cache-dtype int8|fp8_e4m3``): quantize and de-quantize.

Scales are per token and KV head: each ``[D]`` vector of one layer's K (or V) for one token and
one KV head gets one float32 scale, ``amax(|x|) / QMAX``. The choice over per-page scales:
a page is written a token at a time (decode appends, chunked prefill fills it in pieces), so a
per-page scale would have to be fixed before the page's later tokens are seen or every earlier
token re-quantized when one larger arrives; per token, every write is independent, shared radix
pages never change, and a score needs only ``s_k[t] * (q . k8[t])``. Cost: 4 bytes per ``D``
values (``D = 64``: 68 bytes where bfloat16 takes 128, 0.53x).

- ``int8``: symmetric, ``q = round(x / s)`` in ``[-127, 127]``, ``s = amax / 127``. Round-trip
  error per element at most ``s / 2 = amax / 254``.
- ``fp8_e4m3``: ``q = float8_e4m3fn(x / s)``, ``s = amax / 448`` (the format's largest finite
  value). Round-trip error at most ``|x| * 2**-4`` (3 mantissa bits, round to nearest) for
  normal values, and ``s * 2**-10`` (half the subnormal step) near zero.

A vector of zeros gets scale 1 (its values are exact zeros either way).
"""

from __future__ import annotations

import torch

from splitserve.config.schema import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "QUANTIZED_KV", "dequantize_kv", "quantize_kv", "round_trip_kv"]
QUANTIZED_KV = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}  # stored value dtype
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K or V vectors along their last dim.

    Args:
        x: ``[..., D]`` float tensor (any float dtype; computed in float32).
        kind: ``"int8"`` or ``"fp8_e4m3"``.

    Returns:
        ``(q [..., D]`` in ``QUANTIZED_KV[kind]``, ``scale [...]`` float32``)``, with
        ``dequantize_kv(q, scale) ~= x`` within the bounds in the module docstring.

    Raises:
        KeyError: ``kind`` is not an 8-bit KV dtype.
    """
    qmax = _QMAX[kind]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = xf / scale.unsqueeze(-1)
    if kind == "int8":
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., D]`` (int8 or float8_e4m3fn) times ``scale [...]`` (float32), in float32, then
    cast to ``dtype``: the values attention reads."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def round_trip_kv(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What a pool of ``kind`` reads back for ``x`` (same dtype as ``x``), bit for bit: paths
    that use new K/V directly must see the values that paths reading the pool see."""
    q, scale = quantize_kv(x, kind)
    return dequantize_kv(q, scale, x.dtype)
