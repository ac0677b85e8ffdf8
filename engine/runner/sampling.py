"""Batched next-token sampling for a continuous batch where every row has its own SamplingParams.

Filters (temperature, top-k, top-p, min-p) run as tensor ops over the whole batch. The random
draw uses the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which picks token ``i``
with probability ``p_i`` and needs no renormalisation; each seeded row draws its noise from its own
``torch.Generator``, so its token depends only on its own logits, params and generator state —
never on which other rows share the batch.
"""

from __future__ import annotations

import torch

from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.ipc.messages import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or None for an unseeded request.

    Keep one per request and pass it every step: it carries the request's random state forward,
    so the same seed and the same logits give the same tokens.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Picks one token per row of a ``[B, V]`` logits tensor. Stateless; safe to share.

    Args:
        use_cpu_kernels: all-greedy CPU steps take the C argmax kernel when it builds.
    """

    def __init__(self, use_cpu_kernels: bool = True) -> None:
        self.use_cpu_kernels = use_cpu_kernels

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the next token of every row.

        Args:
            logits: ``[B, V]`` float logits (already grammar-masked with ``-inf`` if constrained).
            params: ``B`` sampling params, one per row.
            generators: ``B`` generators (from :func:`make_generator`); None draws from torch's
                global generator (not reproducible).

        Returns:
            ``(token_ids [B] int64, logprobs [B] float32)``. The logprob is the log-softmax of
            ``logits`` (temperature 1, no filters) at the chosen token; when the logits were
            processed or masked first, ``ModelRunner`` reports the raw one instead
            (``runner.logprobs``), as OpenAI does.

        Raises:
            ValueError: ``params`` or ``generators`` do not have one entry per row.
        """
        if logits.dim() != 2 or len(params) != logits.shape[0] or len(generators) != len(params):
            raise ValueError(
                f"logits {tuple(logits.shape)} needs one params and one generator per row, "
                f"got {len(params)} params and {len(generators)} generators"
            )
        logits = logits.float()
        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            fast = _greedy_with_kernel(logits) if self.use_cpu_kernels else None
            if fast is not None:
                return fast
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_mixed(logits, params, generators, is_greedy)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).squeeze(1)
        return token_ids, logprobs

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        is_greedy: list[bool],
    ) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, g in enumerate(is_greedy) if not g]
        # Work on the sampled rows only, so a row's arithmetic is the same alone or in any batch.
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub_params = [params[i] for i in rows]
        probs = filtered_probs(logits[row_index], sub_params)
        noise = _exponential_noise(probs, [generators[i] for i in rows])
        token_ids[row_index] = (probs / noise).argmax(dim=-1)
        return token_ids


def _greedy_with_kernel(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """All-greedy rows on CPU: the C one-pass argmax + logprob (same tokens as ``argmax``;
    the logprob equal to ``log_softmax`` up to float32 summation order), or None."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    kernels = load_cpu_kernels()
    return None if kernels is None else kernels.greedy(logits)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalised probabilities ``[N, V]`` after temperature, top-k, top-p and min-p.

    Filtered tokens get probability exactly 0; the most likely token always survives. Order
    follows SGLang/vLLM: top-k, then top-p over the top-k renormalised mass, then min-p.
    All rows must be non-greedy (temperature > 0).
    """
    device = logits.device
    num_vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]

    top_k = [p.top_k if 0 < p.top_k < num_vocab else num_vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < num_vocab for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)

    probs = torch.softmax(scaled, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        # min-p is relative to the top token's probability, so renormalisation does not matter.
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to ``-inf`` (one sort for the batch)."""
    device = scaled.device
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=device)
    k = torch.tensor(top_k, device=device)
    drop = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly before each token; a token is kept while that mass is below top_p, so the
    # first (most likely) token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p >= 1 means "off": inf keeps rounding (a cumsum of 1.0000001) from dropping the tail.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=device)
    drop |= mass_before >= p[:, None]
    drop[:, 0] = False

    drop_orig = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return scaled.masked_fill(drop_orig, float("-inf"))


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """``Exp(1)`` noise shaped like ``probs``; each seeded row from its own generator."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        noise[idx] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            row = torch.empty(probs.shape[-1], device=gen.device).exponential_(generator=gen)
            noise[i] = row.to(probs.device)
    # exponential_ can return 0 in float32; 0 would turn a filtered token's 0/0 into NaN.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
