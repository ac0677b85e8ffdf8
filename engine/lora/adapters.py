"""The adapters a model's projections read: one :class:`ProjectionSlots` per decoder-layer
projection (``Linear.lora``), the C kernels' table of the same, and each step's rows.

A step with adapted rows runs the base product of every projection once for all rows, then
the low-rank products grouped by slot (Punica's SGMV, arXiv 2310.18547): for each slot present
one gather of its rows, ``x A^T`` (the shrink: every adapted module the projection fuses at
once), one ``@ Bt`` per module (the expand) and one scatter-add into its columns. On CPU
bfloat16 with the C kernels it is ``lora.c`` (also inside the fused decode layers); elsewhere
torch ops (:func:`sgmv_add`). The model sets the step's rows (:meth:`ModelAdapters.begin`) before
its layers run and clears them after, so a step without adapted rows finds none and runs the
base path only.
"""

from __future__ import annotations

import torch

from splitserve.engine.forward_batch import AdapterRows
from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.lora.weights import MAX_SLICES, AdapterWeights, ProjectionLora
from splitserve.engine.model.base import DecoderLM
from splitserve.engine.model.layers import Linear

LORA_F = 20  # int64s per (slot, projection) entry of the C table (csrc/kernels.h)
LORA_MAX_RANK = 512  # the C kernel's largest rank (csrc/kernels.h)
FUSED_ORDER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def sgmv_add(x: torch.Tensor, y: torch.Tensor, slots: list[ProjectionLora | None],
             groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
    """``y`` (``[T, out]``, updated in place) plus, for each ``(slot, rows)`` group, its
    adapter's products on ``x[rows]`` (``x [T, in]``); torch ops, in ``x``'s dtype."""
    for slot, rows in groups:
        p = slots[slot]
        if p is None:
            continue
        t = x[rows] @ p.a.t()  # [n, R]: every adapted module's shrink in one product
        for s in p.slices:
            d = t[:, s.rank_offset : s.rank_offset + s.rank] @ s.bt
            cols = slice(s.out_offset, s.out_offset + s.out_size)
            if isinstance(rows, slice):
                y[rows, cols] += d
            else:
                y[:, cols].index_add_(0, rows, d)
    return y


class ProjectionSlots:
    """One projection's adapters, by slot (``Linear.lora``: ``engine.model.layers``'s
    ``ProjectionAdapters``).

    Args:
        owner: the model's adapters (the step's rows, the C table).
        index: this projection's row in the C table.
    """

    def __init__(self, owner: ModelAdapters, index: int) -> None:
        self.owner = owner
        self.index = index
        self.slots: list[ProjectionLora | None] = [None] * owner.num_slots

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the step's LoRA products (``y`` as is when the step has no adapted
        rows)."""
        rows = self.owner.rows
        if rows is None:
            return y
        kernels = self.owner.kernels
        if (kernels is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.stride(1) == 1 and y.is_contiguous()):
            table = self.owner.table
            entry = table.data_ptr() + self.index * LORA_F * table.element_size()
            kernels.lora_sgmv(x, y, entry, table.stride(0), rows.rows, rows.segments)
            return y
        return sgmv_add(x, y, self.slots, rows.groups)


class ModelAdapters:
    """The LoRA side of one model: every decoder-layer :class:`Linear` gets a
    :class:`ProjectionSlots` (``Linear.lora``) and the model this object (``DecoderLM.lora``).

    Args:
        model: the loaded (and packed) model.
        num_slots: ``--max-loras``.

    Attributes:
        table: ``[num_slots, P, LORA_F]`` int64, the C kernels' view of every slot: per
            projection the address of ``A``, its rank ``R``, its slice count, then per slice
            the address of ``Bt``, output offset, output size, rank offset and rank (0 where
            the slot's adapter does not adapt the projection). The tensors it points to are
            held by :attr:`weights`.
        fusable: the projections are four per layer in the fused decode layers' order, so
            they take steps with adapted rows too.
    """

    def __init__(self, model: DecoderLM, num_slots: int) -> None:
        self.num_slots = num_slots
        self.dtype = model.dtype
        self.kernels: CpuKernels | None = model.kernels
        self.rows: AdapterRows | None = None
        self.weights: list[AdapterWeights | None] = [None] * num_slots
        self.projections: dict[str, ProjectionSlots] = {}
        for name, module in model.layers.named_modules(prefix="layers"):
            if isinstance(module, Linear):
                module.lora = self.projections[name] = ProjectionSlots(self, len(self.projections))
        self.table = torch.zeros(num_slots, len(self.projections), LORA_F, dtype=torch.long)
        names = list(self.projections)
        self.fusable = names == [f"layers.{i}.{p}" for i in range(len(model.layers))
                                 for p in FUSED_ORDER]
        model.lora = self

    def begin(self, rows: AdapterRows) -> None:
        """The step about to run has these adapted rows."""
        self.rows = rows

    def end(self) -> None:
        """The step ran: no adapted rows until the next :meth:`begin`."""
        self.rows = None

    def fused_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The fused decode layers' LoRA arguments for the current step: ``(table, rows,
        segments)``, or None when the step has no adapted rows."""
        rows = self.rows
        return None if rows is None else (self.table, rows.rows, rows.segments)

    def serves_fused(self) -> bool:
        """Whether the fused decode layers can run steps with adapted rows (the C kernels and
        the projections in their order)."""
        return self.fusable and self.kernels is not None

    def install(self, slot: int, weights: AdapterWeights) -> None:
        """Put ``weights`` in ``slot`` (no request may be using it)."""
        self.clear(slot)
        for name, p in weights.projections.items():
            proj = self.projections[name]
            proj.slots[slot] = p
            entry = self.table[slot, proj.index]
            entry[0], entry[1], entry[2] = p.a.data_ptr(), p.a.shape[0], len(p.slices)
            for i, s in enumerate(p.slices[:MAX_SLICES]):
                entry[3 + 5 * i: 8 + 5 * i] = torch.tensor(
                    [s.bt.data_ptr(), s.out_offset, s.out_size, s.rank_offset, s.rank])
        self.weights[slot] = weights

    def clear(self, slot: int) -> None:
        """Empty ``slot``."""
        for proj in self.projections.values():
            proj.slots[slot] = None
        self.table[slot].zero_()
        self.weights[slot] = None
