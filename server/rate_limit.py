"""Per-tenant rate limits: a token bucket of requests per second and one of tokens per second.

Each tenant (an API key of ``--api-key-file``; every caller without one shares the tenant
``None``) has its own buckets. Each holds at most one second's worth (``rate``), refilled
continuously.

- Requests: a request takes one; with less than one left it is refused.
- Tokens: a request is admitted while the bucket is not in debt; its prompt tokens are taken on
  admission and its generated tokens as they are produced (``charge``, per streamed event), so
  the level may go below zero (a single request larger than a second's worth is still served,
  and its tenant then waits the debt off). While in debt, new requests are refused; the ones
  running go on. Charging as tokens come means a tenant's long answers count against its next
  requests while they stream, not only once each ends.

A request the router then refuses (its queue is full: 429, ``server.admission``) never ran:
``refund`` gives back what its admission took, so a tenant retrying an overloaded cluster is
not also pushed into its own rate limit.

A refusal says how long until the request would be admitted (``retry_after_s``), which the API
answers as 429 with ``Retry-After``. The clock is injected (tests use a fake one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """``level`` units, refilled at ``rate`` per second up to ``capacity``; may go negative."""

    rate: float
    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds at least ``level`` (0 if it does now)."""
        return max(0.0, (level - self.level) / self.rate)


@dataclass(slots=True)
class Refusal:
    """Why a request was refused: which limit, and seconds until it would pass."""

    message: str
    retry_after_s: float

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds, at least 1 (the header has no fractions)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class RateLimiter:
    """Token buckets per tenant.

    Args:
        requests_per_s: requests each tenant may start per second (0: unlimited).
        tokens_per_s: prompt + generated tokens each tenant may use per second (0: unlimited).
        clock: seconds, monotonic (default ``time.monotonic``).

    Tenants are the keys of the key file plus ``None``, so the table stays bounded.
    """

    def __init__(self, requests_per_s: float = 0.0, tokens_per_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if requests_per_s < 0 or tokens_per_s < 0:
            raise ValueError("rate limits must be >= 0")
        self.requests_per_s = requests_per_s
        self.tokens_per_s = tokens_per_s
        self.clock = clock
        self._requests: dict[str | None, TokenBucket] = {}
        self._tokens: dict[str | None, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_s or self.tokens_per_s)

    def _bucket(self, table: dict[str | None, TokenBucket], tenant: str | None, rate: float,
                now: float) -> TokenBucket:
        bucket = table.get(tenant)
        if bucket is None:
            # A burst of one second's worth; at least one request, so a rate below 1/s works.
            capacity = max(rate, 1.0) if table is self._requests else rate
            bucket = table[tenant] = TokenBucket(rate, capacity, capacity, now)
        bucket.refill(now)
        return bucket

    def admit(self, tenant: str | None, prompt_tokens: int) -> Refusal | None:
        """Take one request and ``prompt_tokens`` from ``tenant``'s buckets, or take nothing
        and return why not (check-then-act: a refused request costs nothing)."""
        now = self.clock()
        req = tok = None
        if self.requests_per_s:
            req = self._bucket(self._requests, tenant, self.requests_per_s, now)
            if req.level < 1.0:
                return Refusal(f"rate limit of {self.requests_per_s:g} requests/s reached",
                               req.seconds_until(1.0))
        if self.tokens_per_s:
            tok = self._bucket(self._tokens, tenant, self.tokens_per_s, now)
            if tok.level <= 0.0:
                # Wait until the debt is paid and a little is back (0 would admit at once).
                wait = tok.seconds_until(min(tok.capacity, 1.0))
                return Refusal(f"rate limit of {self.tokens_per_s:g} tokens/s reached", wait)
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens
        return None

    def refund(self, tenant: str | None, prompt_tokens: int) -> None:
        """Give back what :meth:`admit` took for a request that then never ran (one request,
        ``prompt_tokens`` tokens), up to each bucket's capacity."""
        now = self.clock()
        if self.requests_per_s:
            bucket = self._bucket(self._requests, tenant, self.requests_per_s, now)
            bucket.level = min(bucket.capacity, bucket.level + 1.0)
        if self.tokens_per_s and prompt_tokens > 0:
            bucket = self._bucket(self._tokens, tenant, self.tokens_per_s, now)
            bucket.level = min(bucket.capacity, bucket.level + prompt_tokens)

    def charge(self, tenant: str | None, tokens: int) -> None:
        """Take ``tokens`` (just generated by an admitted request; called once per streamed
        event) from ``tenant``'s token bucket."""
        if self.tokens_per_s and tokens > 0:
            self._bucket(self._tokens, tenant, self.tokens_per_s, self.clock()).level -= tokens
