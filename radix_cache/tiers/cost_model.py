"""Whether loading a tier's blocks beats recomputing their tokens, from measured rates.

Two rates are measured, never assumed: the prefill rate (prompt tokens per second of forward
pass; a start-up probe of the real model, then every prefill step, ``observe_prefill``) and each
tier's load rate (bytes per second; a start-up probe of the tier, then every load,
``observe_load``). Loading ``t`` tokens of ``b`` bytes each from a tier costs ``t * b / rate``;
recomputing them costs ``t / prefill_rate``. A tier whose load is the slower of the two is not
read (counted in :attr:`skipped`), as HiCache and LMCache leave it to the operator to know.
The average prefill rate understates the cost of recomputing late tokens of a long prompt
(attention grows with the position), so the comparison leans towards recomputing.

Rates are exponential moving averages (weight ``ALPHA`` for the newest sample).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

ALPHA = 0.2


@dataclass(slots=True)
class Rate:
    """An exponential moving average of a rate (units per second); None until measured."""

    value: float | None = None
    samples: int = 0

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        r = amount / seconds
        self.value = r if self.value is None else (1 - ALPHA) * self.value + ALPHA * r
        self.samples += 1


@dataclass(slots=True)
class LoadCostModel:
    """Measured rates and the load-or-recompute rule.

    Attributes:
        bytes_per_token: bytes a tier reads per token of a block (page bytes / page size).
        prefill: prompt tokens per second of forward pass.
        loads: per tier name, bytes per second of its loads.
        skipped: per tier name, blocks not loaded because loading was the slower.
    """

    bytes_per_token: float
    prefill: Rate = field(default_factory=Rate)
    loads: dict[str, Rate] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill.observe(tokens, seconds)

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self.loads.setdefault(tier, Rate()).observe(num_bytes, seconds)

    def load_s_per_token(self, tier: str) -> float | None:
        rate = self.loads.get(tier)
        return None if rate is None or not rate.value else self.bytes_per_token / rate.value

    def compute_s_per_token(self) -> float | None:
        return None if not self.prefill.value else 1.0 / self.prefill.value

    def worth_loading(self, tier: str, num_blocks: int = 1) -> bool:
        """Whether ``tier``'s blocks load faster than their tokens compute. Unmeasured (no
        start-up probe ran: unit tests that build a cache by hand) counts as worth it."""
        load, compute = self.load_s_per_token(tier), self.compute_s_per_token()
        if load is None or compute is None or load < compute:
            return True
        with self._lock:
            self.skipped[tier] = self.skipped.get(tier, 0) + num_blocks
        return False
