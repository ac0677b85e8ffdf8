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


def test_cache_aware_matches_only_in_the_request_namespace() -> None:
    """A prefix another tenant sent does not attract a request (the workers' caches would not
    share it, and following it would let one tenant's prompts steer another's placement); the
    tenant's own prefix still does."""
    workers = [FakeWorker("a"), FakeWorker("b")]
    policy = CacheAwarePolicy()
    assert policy.pick(workers, SYSTEM_A + [1], namespace="alice").addr == "a"
    # bob's identical prompt: no match in bob's namespace, so the least-loaded worker with the
    # smaller tree (b), not the one holding alice's prefix.
    assert policy.pick(workers, SYSTEM_A + [2], namespace="bob").addr == "b"
    assert policy.pick(workers, SYSTEM_A + [3], namespace=None).addr in ("a", "b")
    # Each tenant goes back to the worker holding its own prefix.
    for _ in range(3):
        assert policy.pick(workers, SYSTEM_A + [4], namespace="alice").addr == "a"
        assert policy.pick(workers, SYSTEM_A + [5], namespace="bob").addr == "b"


def test_cache_aware_unsalted_prefix_does_not_attract_a_salted_request() -> None:
    workers = [FakeWorker("a"), FakeWorker("b")]
    policy = CacheAwarePolicy()
    policy.pick(workers, SYSTEM_B + [1])  # shared namespace, lands on a
    assert policy.pick(workers, SYSTEM_B + [2], namespace="salted").addr == "b"
    assert policy.pick(workers, SYSTEM_B + [3]).addr == "a"
