"""The adapters a model's projections read: one :class:`ProjectionSlots` per decoder-layer
projection (``Linear.lora``), the C kernels' table of the same, and each step's rows.

A step with adapted rows runs the base product of every projection once for all rows, then
the low-rank products grouped by slot (Punica's SGMV, arXiv 2310.18547): for each slot present
one gather of its rows, ``x A^T`` (the shrink: every adapted module the projection fuses at
once), one ``@ Bt`` per module (the expand) and one scatter-add into its columns. On CPU
bfloat16 with the C kernels it is ``lora.c`` (also inside the fused decode layers); on CUDA
the Triton kernels (``engine.kernels.triton.lora``, over each projection's slots stacked in two
buffers); elsewhere torch ops (:func:`sgmv_add`). The model sets the step's rows (:meth:`ModelAdapters.begin`) before
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

    def __init__(self, owner: ModelAdapters, index: int, linear: Linear) -> None:
        self.owner = owner
        self.index = index
        self.slots: list[ProjectionLora | None] = [None] * owner.num_slots
        # Stacked (the Triton kernels'): every slot's A [R, in] and s * B^T [R, out], zero
        # where its adapter has no rank or no module.
        self.a_stack: torch.Tensor | None = None
        self.bt_stack: torch.Tensor | None = None
        if owner.stacked_rank:
            device, r = linear.weight.device, owner.stacked_rank
            self.a_stack = torch.zeros(owner.num_slots, r, linear.in_features,
                                       dtype=owner.dtype, device=device)
            self.bt_stack = torch.zeros(owner.num_slots, r, linear.out_features,
                                        dtype=owner.dtype, device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the step's LoRA products (``y`` as is when the step has no adapted
        rows)."""
        rows = self.owner.rows
        if rows is None:
            return y
        if self.a_stack is not None:
            from splitserve.engine.kernels.triton.lora import sgmv_triton

            owner = self.owner
            return sgmv_triton(x, y, self.a_stack, self.bt_stack, owner.device_rows,
                               owner.device_segments, owner.max_count)
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
        max_rank: ``--max-lora-rank`` (sizes the stacked buffers).
        stacked: keep each projection's slots stacked for the Triton kernels (default: on
            CUDA); the CPU interpreter runs them too, for tests.

    Attributes:
        table: ``[num_slots, P, LORA_F]`` int64, the C kernels' view of every slot: per
            projection the address of ``A``, its rank ``R``, its slice count, then per slice
            the address of ``Bt``, output offset, output size, rank offset and rank (0 where
            the slot's adapter does not adapt the projection). The tensors it points to are
            held by :attr:`weights`.
        fusable: the projections are four per layer in the fused decode layers' order, so
            they take steps with adapted rows too.
    """

    def __init__(self, model: DecoderLM, num_slots: int, max_rank: int = 64,
                 stacked: bool | None = None) -> None:
        self.num_slots = num_slots
        self.dtype = model.dtype
        self.kernels: CpuKernels | None = model.kernels
        self.rows: AdapterRows | None = None
        if stacked is None:
            stacked = model.embed_tokens.weight.device.type == "cuda"
        self.stacked_rank = -(-max_rank // 16) * 16 if stacked else 0  # padded for tl.dot
        self.device = model.embed_tokens.weight.device
        self.device_rows: torch.Tensor | None = None  # the step's rows on the device (stacked)
        self.device_segments: torch.Tensor | None = None
        self.max_count = 0
        self.weights: list[AdapterWeights | None] = [None] * num_slots
        self.projections: dict[str, ProjectionSlots] = {}
        for name, module in model.layers.named_modules(prefix="layers"):
            if isinstance(module, Linear):
                module.lora = self.projections[name] = ProjectionSlots(
                    self, len(self.projections), module)
        self.table = torch.zeros(num_slots, len(self.projections), LORA_F, dtype=torch.long)
        names = list(self.projections)
        self.fusable = names == [f"layers.{i}.{p}" for i in range(len(model.layers))
                                 for p in FUSED_ORDER]
        model.lora = self

    def begin(self, rows: AdapterRows) -> None:
        """The step about to run has these adapted rows."""
        self.rows = rows
        if self.stacked_rank:  # once per step, for every projection's kernels
            self.device_rows = rows.rows.to(self.device)
            self.device_segments = rows.segments.to(self.device)
            self.max_count = int(rows.segments[:, 2].max())

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
            self.table[slot, proj.index] = torch.tensor(table_entry(p))
            if proj.a_stack is not None:
                rank = p.a.shape[0]
                proj.a_stack[slot, :rank] = p.a
                for s in p.slices:
                    proj.bt_stack[slot, s.rank_offset:s.rank_offset + s.rank,
                                  s.out_offset:s.out_offset + s.out_size] = s.bt
        self.weights[slot] = weights

    def clear(self, slot: int) -> None:
        """Empty ``slot``."""
        for proj in self.projections.values():
            proj.slots[slot] = None
            if proj.a_stack is not None:
                proj.a_stack[slot].zero_()
                proj.bt_stack[slot].zero_()
        self.table[slot].zero_()
        self.weights[slot] = None


def table_entry(p: ProjectionLora) -> list[int]:
    """The C kernels' entry (``LORA_F`` int64s, ``csrc/kernels.h``) of adapter projection
    ``p``: the address of ``A``, its rank, its slice count, then per slice the address of its
    ``Bt``, output offset, output size, rank offset and rank."""
    entry = [p.a.data_ptr(), p.a.shape[0], len(p.slices)]
    for s in p.slices[:MAX_SLICES]:
        entry += [s.bt.data_ptr(), s.out_offset, s.out_size, s.rank_offset, s.rank]
    return entry + [0] * (LORA_F - len(entry))
