"""The Triton LoRA kernels (``engine.kernels.triton.lora``: SGMV's shrink and expand over a
projection's stacked slots) against a float32 reference, row by row; without CUDA under
Triton's CPU interpreter (``triton_device``), on tiny shapes."""

from __future__ import annotations

import pytest
import torch

# isort: off
from triton_device import DEVICE  # first: it sets TRITON_INTERPRET before Triton loads
# isort: on

from splitserve.engine.forward_batch import adapter_rows
from splitserve.engine.kernels.triton.lora import sgmv_triton
from tests.engine.lora_reference import random_projection, reference

K, OUTS = 48, [32, 16, 16]
SEQS = [(0, 1), (None, 2), (1, 3), (0, 1), (1, 1)]


def stacked(slots, rank: int, dtype: torch.dtype):
    a = torch.zeros(len(slots), rank, K, dtype=dtype)
    bt = torch.zeros(len(slots), rank, sum(OUTS), dtype=dtype)
    for i, p in enumerate(slots):
        a[i, :p.a.shape[0]] = p.a
        for s in p.slices:
            bt[i, s.rank_offset:s.rank_offset + s.rank,
               s.out_offset:s.out_offset + s.out_size] = s.bt
    return a.to(DEVICE), bt.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_matches_the_reference(dtype) -> None:
    slots = [random_projection(K, OUTS, [8, 4, 4], dtype, seed=1),
             random_projection(K, OUTS, [16, 0, 8], dtype, seed=2)]
    rows = adapter_rows([s for s, _ in SEQS], [n for _, n in SEQS])
    slot_of_row = [s for s, n in SEQS for _ in range(n)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(slot_of_row), K, generator=g).to(dtype)
    y = torch.randn(len(slot_of_row), sum(OUTS), generator=g).to(dtype)
    a, bt = stacked(slots, 32, dtype)
    got = sgmv_triton(x.to(DEVICE), y.clone().to(DEVICE), a, bt, rows.rows.to(DEVICE),
                      rows.segments.to(DEVICE), int(rows.segments[:, 2].max())).cpu()
    want = reference(x, y, slot_of_row, slots)
    # bfloat16: one rounding of the float32 sum, at most an ulp (2^-7 relative: the CPU
    # interpreter's conversion truncates; CUDA rounds to nearest, half that).
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    err = (got.float() - want).abs()
    assert bool((err <= want.abs() * tol + 1e-4).all()), err.max()
    base = [i for i, s in enumerate(slot_of_row) if s is None]
    assert torch.equal(got[base], y[base])
