"""The LoRA products of a step's adapted rows (``engine.lora.adapters``): the C kernel
(``csrc/lora.c``) and the torch path against a float32 reference, row by row, on a projection
that fuses three modules of different ranks, with rows of two adapters and of the base model
interleaved; and the grouping of rows by slot (``forward_batch.adapter_rows``)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.forward_batch import adapter_rows
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.lora.adapters import LORA_F, sgmv_add, table_entry
from tests.engine.lora_reference import random_projection, reference

K, OUTS = 96, [64, 32, 32]  # a fused q/k/v-like projection
# Per sequence: (adapter slot or None, new tokens): decode rows and a prompt chunk, mixed.
SEQS = [(0, 1), (None, 1), (1, 3), (0, 2), (None, 2), (1, 1), (2, 1)]


def step(dtype: torch.dtype):
    slots = [random_projection(K, OUTS, [8, 4, 16], dtype, seed=1),
             random_projection(K, OUTS, [16, 0, 8], dtype, seed=2),
             None]  # slot 2's adapter does not adapt this projection
    rows = adapter_rows([s for s, _ in SEQS], [n for _, n in SEQS])
    slot_of_row = [s for s, n in SEQS for _ in range(n)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(slot_of_row), K, generator=g).to(dtype)
    y = torch.randn(len(slot_of_row), sum(OUTS), generator=g).to(dtype)
    return slots, rows, slot_of_row, x, y


def test_rows_are_grouped_by_slot() -> None:
    rows = adapter_rows([0, None, 1, 0], [2, 1, 3, 1])
    groups = {slot: r for slot, r in rows.groups}
    assert groups[1] == slice(3, 6)  # consecutive: no gather
    assert groups[0].tolist() == [0, 1, 6]
    assert rows.rows.tolist() == [0, 1, 6, 3, 4, 5]
    assert rows.segments.tolist() == [[0, 0, 3], [1, 3, 3]]
    assert adapter_rows([None, None], [1, 4]) is None  # a base-only step has none


def test_torch_products_match_the_reference() -> None:
    slots, rows, slot_of_row, x, y = step(torch.float32)
    want = reference(x, y, slot_of_row, slots)
    got = sgmv_add(x, y.clone(), slots, rows.groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_c_kernel_matches_the_reference() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C kernels on this machine")
    slots, rows, slot_of_row, x, y = step(torch.bfloat16)
    table = torch.zeros(len(slots), LORA_F, dtype=torch.long)
    for i, p in enumerate(slots):
        if p is not None:
            table[i] = torch.tensor(table_entry(p))
    got = y.clone()
    kernels.lora_sgmv(x, got, table.data_ptr(), table.stride(0), rows.rows, rows.segments)
    want = reference(x, y, slot_of_row, slots)
    # The sum in float32, rounded once to bfloat16: within half an ulp of the reference (plus
    # float32 summation order).
    err = (got.float() - want).abs()
    assert bool((err <= want.abs() * 2.0**-8 + 1e-5).all()), err.max()
    base = [i for i, s in enumerate(slot_of_row) if s is None or slots[s] is None]
    assert torch.equal(got[base], y[base])  # base rows, and slot 2's, untouched
