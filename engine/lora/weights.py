"""An adapter's weights laid out for our model's projections.

Our projections fuse several of the checkpoint's modules (``qkv_proj`` holds q, k and v;
``gate_up_proj`` holds gate and up; ``engine.model.llama``), so one adapter on one of our
:class:`~splitserve.engine.model.layers.Linear` modules is a :class:`ProjectionLora`: the
``lora_A`` of every adapted module it fuses stacked into one ``A [R, in]`` (so the shrink
``x A^T`` is one product), and per module a slice: its scaled ``B^T [r, out_s]`` and where its
rows of ``x A^T`` and its output columns are. The family's weight map (the one the loader
fills the base weights by) says which module goes where, so every family is served without a
table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.lora.peft import LoraError, PeftAdapter
from splitserve.engine.model.base import DecoderLM
from splitserve.engine.model.layers import Linear

MAX_SLICES = 3  # adapted modules one fused projection holds at most (q, k and v)


@dataclass(slots=True)
class LoraSlice:
    """One adapted module inside a fused projection.

    Attributes:
        out_offset: its first output column in the projection.
        rank_offset: its first row of the stacked ``A`` (and column of ``x A^T``).
        bt: ``s * B^T`` ``[r, out_s]`` in the serving dtype, contiguous.
    """

    out_offset: int
    rank_offset: int
    bt: torch.Tensor

    @property
    def rank(self) -> int:
        return self.bt.shape[0]

    @property
    def out_size(self) -> int:
        return self.bt.shape[1]


@dataclass(slots=True)
class ProjectionLora:
    """One adapter on one projection: ``y += sum_s (x A^T)[:, s.rank_offset : + s.rank] @
    s.bt`` into columns ``s.out_offset ..``.

    Attributes:
        a: the stacked ``A [R, in]`` of its slices, serving dtype, contiguous.
        slices: in ``rank_offset`` order.
    """

    a: torch.Tensor
    slices: list[LoraSlice]


@dataclass(slots=True)
class AdapterWeights:
    """An adapter ready for the slots: ``projections`` maps our Linear modules' dotted names
    (``layers.3.self_attn.qkv_proj``) to their :class:`ProjectionLora`."""

    name: str
    digest: str
    rank: int
    projections: dict[str, ProjectionLora]

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size()
                   + sum(s.bt.numel() * s.bt.element_size() for s in p.slices)
                   for p in self.projections.values())


def adapter_weights(adapter: PeftAdapter, model: DecoderLM, name: str) -> AdapterWeights:
    """``adapter`` on ``model``'s projections, in the model's dtype and on its device.

    Raises:
        LoraError: a module the model does not have (another architecture, or a layer past
            its depth), one that is not a decoder layer's projection (embeddings, the LM
            head, experts), or whose input or output size differs from the model's (an
            adapter trained for another base model, e.g. another hidden size).
    """
    wanted = type(model).weight_map(model.config)
    modules = dict(model.named_modules())
    groups: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for m in adapter.modules:
        short = m.name.rsplit(".", 1)[-1]
        slot = wanted.get(m.name + ".weight")
        if slot is None:
            raise LoraError(f"target {short} ({m.name}) is not a module of the base model "
                            f"({model.config.architecture}, {model.config.num_layers} layers)")
        param, index = slot
        owner = param.rsplit(".", 1)[0]
        linear = modules.get(owner)
        if not isinstance(linear, Linear) or not owner.startswith("layers."):
            raise LoraError(f"target {short} ({m.name}) is not served: adapters apply to the "
                            "decoder layers' projections (q_proj, k_proj, v_proj, o_proj, "
                            "gate_proj, up_proj, down_proj)")
        if index == ():
            offset, size = 0, linear.out_features
        elif len(index) == 1 and isinstance(index[0], slice):
            offset, size = index[0].start, index[0].stop - index[0].start
        else:
            raise LoraError(f"target {short} ({m.name}) is not served (a stacked weight)")
        if m.a.shape[1] != linear.in_features or m.b.shape[0] != size:
            raise LoraError(
                f"module {m.name}: the adapter maps {m.a.shape[1]} -> {m.b.shape[0]} features, "
                f"the base model's {short} maps {linear.in_features} -> {size} (hidden_size "
                f"{model.config.hidden_size}): the adapter was trained for another base model")
        groups.setdefault(owner, []).append((offset, m.a, m.b * m.scaling))
    device = model.embed_tokens.weight.device
    projections = {}
    for owner, parts in groups.items():
        parts.sort(key=lambda p: p[0])
        if len(parts) > MAX_SLICES:
            raise LoraError(f"{owner}: {len(parts)} adapted modules in one projection "
                            f"(at most {MAX_SLICES})")
        slices, rank_offset = [], 0
        for offset, _, b in parts:
            bt = b.t().to(model.dtype).contiguous().to(device)
            slices.append(LoraSlice(offset, rank_offset, bt))
            rank_offset += bt.shape[0]
        a = torch.cat([a for _, a, _ in parts]).to(model.dtype).contiguous().to(device)
        projections[owner] = ProjectionLora(a, slices)
    return AdapterWeights(name, adapter.digest, adapter.rank, projections)
