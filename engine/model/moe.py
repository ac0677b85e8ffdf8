"""A sparse mixture-of-experts MLP: top-k softmax routing, experts' products grouped by expert.

Routing as Qwen3-MoE and Mixtral do it (transformers' ``Qwen3MoeTopKRouter``): router logits
``[T, E]`` in the activation dtype, softmax over experts in float32, the top ``k`` kept (and
renormalized to sum 1 with ``norm_topk_prob``), then cast back to the activation dtype. Each
expert is a gated SiLU MLP; a token's output is the routing-weighted sum of its ``k`` experts'.

The ``T * k`` (token, expert) pairs are sorted by expert once, so each expert that any token
chose runs one product over all of its rows (a loop over at most ``E`` experts, never over
tokens); the weighted rows are summed back per token with one ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.layers import Linear, empty_parameter
from splitserve.engine.step_plan import Product


class SparseMoE(nn.Module):
    """``x [T, hidden] -> [T, hidden]`` through ``top_k`` of ``num_experts`` gated MLPs.

    Parameters: ``gate.weight [E, hidden]`` (the router), ``experts_gate_up [E, 2 * inter,
    hidden]`` (each expert's gate rows, then its up rows) and ``experts_down [E, hidden, inter]``.
    """

    def __init__(
        self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.inter, self.num_experts, self.top_k = inter, num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden, num_experts, False, dtype)
        self.experts_gate_up = empty_parameter(num_experts, 2 * inter, hidden, dtype=dtype)
        self.experts_down = empty_parameter(num_experts, hidden, inter, dtype=dtype)

    def route(self, x: torch.Tensor, product: Product) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, experts [T, k] int64)`` of each token; ``product``:
        the step plan's for the router's projection."""
        probs = torch.softmax(self.gate(x, product), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, product: Product) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; ``product``: the step plan's for the layers
        (the router's; the stacked experts are not :class:`Linear` and take ``F.linear``)."""
        weights, experts = self.route(x, product)
        flat = experts.flatten()  # pair p = token p // k, its (p % k)-th expert
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read
        rows = x.index_select(0, token)  # [T * k, hidden], grouped by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = rows[start : start + n]
            gate, up = F.linear(seg, self.experts_gate_up[e]).split(self.inter, dim=-1)
            out_rows[start : start + n] = F.linear(F.silu(gate) * up, self.experts_down[e])
            start += n
        out_rows *= weights.flatten().index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, token, out_rows)
