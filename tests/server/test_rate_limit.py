"""Per-tenant token buckets (``server.rate_limit``) on a fake clock: bursts of one second's
worth, refill at the rate, tokens charged on admission and at the end (debt allowed), a refused
request costs nothing, tenants never share buckets."""

from __future__ import annotations

import pytest

from splitserve.server.rate_limit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_second_burst_then_refill() -> None:
    clock = Clock()
    rl = RateLimiter(requests_per_s=2, clock=clock)
    assert rl.admit("a", 10) is None and rl.admit("a", 10) is None
    refusal = rl.admit("a", 10)
    assert refusal is not None and "2 requests/s" in refusal.message
    assert refusal.retry_after_s == pytest.approx(0.5) and refusal.retry_after_header == "1"
    assert rl.admit("b", 10) is None  # another tenant has its own bucket
    clock.now += 0.5
    assert rl.admit("a", 10) is None
    assert rl.admit("a", 10) is not None
    clock.now += 60  # refill stops at one second's worth
    assert [rl.admit("a", 1) is None for _ in range(3)] == [True, True, False]


def test_rate_below_one_per_second_still_admits_one() -> None:
    clock = Clock()
    rl = RateLimiter(requests_per_s=0.25, clock=clock)
    assert rl.admit(None, 1) is None
    refusal = rl.admit(None, 1)
    assert refusal.retry_after_s == pytest.approx(4.0) and refusal.retry_after_header == "4"


def test_tokens_debt_then_wait() -> None:
    clock = Clock()
    rl = RateLimiter(tokens_per_s=100, clock=clock)
    assert rl.admit("a", 250) is None  # larger than a second's worth: admitted, into debt
    refusal = rl.admit("a", 1)
    assert refusal is not None and "100 tokens/s" in refusal.message
    assert refusal.retry_after_s == pytest.approx(1.51)  # 150 of debt + 1 token back, at 100/s
    clock.now += 1.0
    assert rl.admit("a", 1) is not None  # still 50 in debt
    clock.now += 0.6
    assert rl.admit("a", 5) is None
    rl.charge("a", 200)  # its generated tokens, at the end
    assert rl.admit("a", 1) is not None
    assert rl.admit("b", 1) is None


def test_refused_request_costs_nothing() -> None:
    clock = Clock()
    rl = RateLimiter(requests_per_s=1, tokens_per_s=10, clock=clock)
    assert rl.admit("a", 20) is None  # tokens now -10
    for _ in range(5):
        assert rl.admit("a", 20) is not None  # refused by requests: tokens untouched
    clock.now += 1.0
    # Requests refilled (1), tokens back to 0: still refused by tokens, and no request taken.
    assert "tokens/s" in rl.admit("a", 1).message
    clock.now += 0.1
    assert rl.admit("a", 1) is None


def test_unlimited_and_bad_rates() -> None:
    rl = RateLimiter()
    assert not rl.enabled
    assert all(rl.admit("a", 10**6) is None for _ in range(100))
    with pytest.raises(ValueError):
        RateLimiter(requests_per_s=-1)


def test_refund_gives_back_an_admission_up_to_capacity() -> None:
    clock = Clock()
    rl = RateLimiter(requests_per_s=1, tokens_per_s=10, clock=clock)
    assert rl.admit("a", 30) is None  # tokens now -20, requests 0
    rl.refund("a", 30)
    assert rl._requests["a"].level == 1.0 and rl._tokens["a"].level == 10.0
    rl.refund("a", 30)  # never above one second's worth
    assert rl._requests["a"].level == 1.0 and rl._tokens["a"].level == 10.0
    assert rl.admit("a", 1) is None
