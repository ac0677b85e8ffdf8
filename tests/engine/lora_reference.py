"""Random LoRA projections for the kernel tests, and the float32 reference of their products."""

from __future__ import annotations

import torch

from splitserve.engine.lora.weights import LoraSlice, ProjectionLora


def random_projection(k: int, outs: list[int], ranks: list[int], dtype: torch.dtype,
                      seed: int) -> ProjectionLora:
    """An adapter projection of ``k`` inputs fusing one module per entry of ``outs`` (its
    output size) and ``ranks`` (its rank; 0: the adapter does not adapt that module)."""
    g = torch.Generator().manual_seed(seed)
    a_parts, slices, offset, rank_offset = [], [], 0, 0
    for n, r in zip(outs, ranks, strict=True):
        if r:
            a_parts.append(torch.randn(r, k, generator=g) / k**0.5)
            bt = torch.randn(r, n, generator=g) / r**0.5
            slices.append(LoraSlice(offset, rank_offset, bt.to(dtype).contiguous()))
            rank_offset += r
        offset += n
    return ProjectionLora(torch.cat(a_parts).to(dtype).contiguous(), slices)


def reference(x: torch.Tensor, y: torch.Tensor, slot_of_row: list[int | None],
              slots: list[ProjectionLora | None]) -> torch.Tensor:
    """``y + s (x A^T) B^T`` row by row in float32 (the adapters' weights as stored)."""
    out = y.float().clone()
    for i, slot in enumerate(slot_of_row):
        p = None if slot is None else slots[slot]
        if p is None:
            continue
        t = x[i].float() @ p.a.float().t()
        for s in p.slices:
            out[i, s.out_offset:s.out_offset + s.out_size] += (
                t[s.rank_offset:s.rank_offset + s.rank] @ s.bt.float())
    return out
