"""Routing policies over fake worker handles (no processes)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from splitserve.server.routing import (
    CacheAwareConfig,
    CacheAwarePolicy,
    RoundRobinPolicy,
    create_routing_policy,
)


@dataclass
class FakeWorker:
    addr: str
    in_flight: int = 0


SYSTEM_A = list(range(100, 160))  # two long shared prefixes
SYSTEM_B = list(range(500, 560))


def test_round_robin_alternates() -> None:
    workers = [FakeWorker("a"), FakeWorker("b")]
    policy = RoundRobinPolicy()
    picks = [policy.pick(workers, SYSTEM_A + [i]).addr for i in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_cache_aware_keeps_a_prefix_on_one_worker() -> None:
    workers = [FakeWorker("a"), FakeWorker("b")]
    policy = CacheAwarePolicy()
    picks = {}
    for i in range(6):
        for name, system in (("A", SYSTEM_A), ("B", SYSTEM_B)):
            w = policy.pick(workers, system + [i, i + 1])
            w.in_flight += 1  # requests stay in flight: load builds up but stays balanced
            picks.setdefault(name, set()).add(w.addr)
    # Each prefix sticks to one worker, and the two prefixes went to different workers.
    assert len(picks["A"]) == len(picks["B"]) == 1
    assert picks["A"] != picks["B"]


def test_cache_aware_falls_back_to_least_loaded() -> None:
    workers = [FakeWorker("a", in_flight=20), FakeWorker("b", in_flight=0)]
    for in_flight, want in ((20, "b"), (3, "a")):
        workers[0].in_flight = in_flight
        policy = CacheAwarePolicy(CacheAwareConfig(balance_abs_threshold=8))
        policy._remember("a", SYSTEM_A)
        # a holds the prefix: it wins unless it is overloaded.
        assert policy.pick(workers, SYSTEM_A + [1]).addr == want


def test_cache_aware_tree_is_bounded_and_flushes() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(max_tree_tokens=100))
    w = FakeWorker("a")
    for i in range(10):
        policy.pick([w], [i] * 30)
    assert policy._tree("a").total_pages <= 100
    policy.flush()
    assert policy._tree("a").total_pages == 0


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        create_routing_policy("random")
