"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, the ``pack-quantized``
format llm-compressor writes for W4A16 / W8A16), de-quantized to float at load.

Each quantized linear layer ``P`` is stored as ``P.weight_packed`` (int32), ``P.weight_scale``
(``[out, 1]`` per channel or ``[out, in / group_size]`` per group), ``P.weight_shape``
(``[out, in]``) and, for asymmetric schemes, ``P.weight_zero_point`` (packed like the weights
but along the output dimension). The packing, as the format defines it: each value ``q`` in
``[-2^(b-1), 2^(b-1))`` is stored as ``q + 2^(b-1)`` in ``b`` bits, value ``i`` of a row at bit
``i * b`` of the row's little-endian bit stream of int32 words (for 4 bits: 8 per word, low
nibble first). De-quantized: ``(q - zero_point) * scale``, computed in float32.

Supported: weight-only ``int`` quantization of 4 or 8 bits, ``channel`` or ``group`` strategy,
symmetric or asymmetric, all config groups with the same weight scheme. Refused at launch with
a ``ValueError`` naming ``config.json`` and the cause: activation or KV-cache quantization,
other bit widths, types, strategies or formats, group activation ordering (``g_idx``),
sparsity or transforms, and any other ``quant_method``. The weights are then served like a
float checkpoint (``--quantization int8``/``int4`` re-quantize them as usual).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

QUANT_METHOD = "compressed-tensors"
PACKED_FORMAT = "pack-quantized"
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
Tensors = Iterator[tuple[str, str, Callable[[], torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class PackScheme:
    """The weight scheme of a ``pack-quantized`` checkpoint (one for all its layers)."""

    num_bits: int  # 4 or 8
    strategy: str  # "channel" or "group"
    group_size: int | None  # for "group"
    symmetric: bool  # False: a zero point per channel/group

    def describe(self) -> str:
        """E.g. ``compressed-tensors 4-bit group 128 symmetric``."""
        size = f" {self.group_size}" if self.group_size else ""
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{QUANT_METHOD} {self.num_bits}-bit {self.strategy}{size} {kind}"


def read_quantization(cfg: dict[str, Any], source: str) -> PackScheme | None:
    """The scheme of ``cfg``'s ``quantization_config`` (an HF ``config.json`` dict), or None
    for an unquantized checkpoint.

    Raises:
        ValueError: naming ``source`` and the cause, for every variant we do not serve.
    """
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return None

    def refuse(cause: str) -> ValueError:
        return ValueError(f"{source}: quantization_config: {cause}")

    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise refuse(
            f"quant_method {method!r} is not supported (only {QUANT_METHOD!r}, "
            f"format {PACKED_FORMAT!r})"
        )
    if qc.get("quantization_status", "compressed") != "compressed":
        raise refuse(
            f"quantization_status {qc['quantization_status']!r}: only compressed "
            "checkpoints are supported"
        )
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise refuse(f"{key} is not supported (weight-only quantization only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    schemes = {
        _group_scheme(name, group, qc.get("format"), refuse) for name, group in groups.items()
    }
    if len(schemes) > 1:
        raise refuse(f"config groups with different weight schemes are not supported: {schemes}")
    return schemes.pop()


def _group_scheme(
    name: str,
    group: dict[str, Any],
    default_format: str | None,
    refuse: Callable[[str], ValueError],
) -> PackScheme:
    fmt = group.get("format") or default_format
    if fmt != PACKED_FORMAT:
        raise refuse(
            f"config group {name}: format {fmt!r} is not supported (only "
            f"{PACKED_FORMAT!r}: W4A16 / W8A16)"
        )
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise refuse(
                f"config group {name}: {key} are quantized (activation "
                "quantization is not supported; weight-only W4A16 / W8A16 only)"
            )
    w = group.get("weights") or {}
    if w.get("type", "int") != "int":
        raise refuse(f"config group {name}: weight type {w.get('type')!r} (only int)")
    if w.get("num_bits") not in (4, 8):
        raise refuse(f"config group {name}: {w.get('num_bits')}-bit weights (only 4 or 8)")
    strategy = w.get("strategy")
    if strategy not in ("channel", "group"):
        raise refuse(f"config group {name}: strategy {strategy!r} (only channel or group)")
    if strategy == "group" and not w.get("group_size"):
        raise refuse(f"config group {name}: strategy group without a group_size")
    if w.get("dynamic"):
        raise refuse(f"config group {name}: dynamic weight quantization")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise refuse(
            f"config group {name}: actorder {w.get('actorder')!r} (group activation "
            "ordering, g_idx, is not supported)"
        )
    group_size = int(w["group_size"]) if strategy == "group" else None
    return PackScheme(int(w["num_bits"]), strategy, group_size, bool(w.get("symmetric", True)))


def unpack(packed: torch.Tensor, num_bits: int, num_cols: int) -> torch.Tensor:
    """The signed values of ``packed`` (int32 ``[rows, words]``), packed along its rows:
    int32 ``[rows, num_cols]``.

    Raises:
        ValueError: a tensor too narrow for ``num_cols`` values, or a big-endian host.
    """
    if sys.byteorder != "little":
        raise ValueError("compressed-tensors unpacking assumes a little-endian host")
    per_word = 32 // num_bits
    if packed.dtype != torch.int32 or packed.shape[-1] * per_word < num_cols:
        raise ValueError(
            f"packed tensor {packed.dtype} {tuple(packed.shape)} cannot hold "
            f"{num_cols} {num_bits}-bit values per row"
        )
    data = packed.contiguous().view(torch.uint8).to(torch.int32)  # little-endian bytes
    if num_bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    return data[:, :num_cols] - (1 << (num_bits - 1))


def dequantize_packed(parts: dict[str, torch.Tensor], scheme: PackScheme) -> torch.Tensor:
    """One layer's float32 weight ``[out, in]`` from its ``weight_*`` tensors (names without
    the layer prefix).

    Raises:
        ValueError: a scale or zero point whose shape does not fit the weight's.
    """
    out_features, in_features = (int(x) for x in parts["weight_shape"].tolist())
    q = unpack(parts["weight_packed"], scheme.num_bits, in_features)
    if q.shape[0] != out_features:
        raise ValueError(f"weight_packed has {q.shape[0]} rows, weight_shape says {out_features}")
    scale = parts["weight_scale"].float()
    num_groups = 1 if scheme.group_size is None else -(-in_features // scheme.group_size)
    if tuple(scale.shape) != (out_features, num_groups):
        raise ValueError(
            f"weight_scale has shape {tuple(scale.shape)}, expected {(out_features, num_groups)}"
        )
    values = q.float()
    if not scheme.symmetric:
        zero = unpack(parts["weight_zero_point"].t(), scheme.num_bits, out_features).t()
        if tuple(zero.shape) != (out_features, num_groups):
            raise ValueError(
                f"weight_zero_point unpacks to {tuple(zero.shape)}, expected "
                f"{(out_features, num_groups)}"
            )
        values = values - _per_column(zero.float(), scheme, in_features)
    return values * _per_column(scale, scheme, in_features)


def _per_column(x: torch.Tensor, scheme: PackScheme, in_features: int) -> torch.Tensor:
    """``[out, groups]`` -> ``[out, in]``: each column takes its group's value."""
    if scheme.group_size is None:
        return x
    return x.repeat_interleave(scheme.group_size, dim=1)[:, :in_features]


def dequantized(tensors: Tensors, scheme: PackScheme) -> Tensors:
    """``tensors`` with each layer's ``weight_*`` parts replaced by its de-quantized
    ``weight`` (float32), once all its parts have been seen; other tensors pass through.

    Raises:
        ValueError: (when iterated) a ``weight_g_idx`` tensor, or a layer missing a part,
            naming the tensor.
    """
    needed = {"weight_packed", "weight_scale", "weight_shape"}
    if not scheme.symmetric:
        needed.add("weight_zero_point")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    wheres: dict[str, str] = {}
    for name, where, load in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, where, load
            continue
        if part == "weight_g_idx":
            raise ValueError(f"{where}: activation-ordered groups (g_idx) are not supported")
        parts = pending.setdefault(prefix, {})
        parts[part] = load()  # compressed parts are small; their file closes after this loop
        wheres.setdefault(prefix, where)
        if needed <= parts.keys():
            done = pending.pop(prefix)
            yield (
                f"{prefix}.weight",
                f"{wheres.pop(prefix)} (compressed-tensors, de-quantized)",
                lambda done=done: dequantize_packed(done, scheme),
            )
    for prefix, parts in pending.items():
        missing = sorted(needed - parts.keys())
        raise ValueError(f"{wheres[prefix]}: layer {prefix} lacks {', '.join(missing)}")
