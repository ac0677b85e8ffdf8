"""What the grammar side keeps (issue 33: a worker OOM-killed at ~6.5 GB compiling 70 real
schemas): the compiled-grammar cache stays within its byte bound, and a compile process ships
back nothing bigger than the grammar it compiled (xgrammar's ``serialize_json`` was up to 60
times its grammar, and cost GBs to write and read; ``bench/grammar_memory.py``)."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

from splitserve.engine.grammar import (
    BaseGrammarBackend,
    BaseMatcher,
    CompiledGrammar,
    GrammarKind,
    GrammarService,
)
from tests.conftest import DATA

MIB = 2**20


class _SizedGrammar(CompiledGrammar):
    """A compiled grammar that only reports its size."""

    backend_name = "sized"
    vocab_size = 8

    def __init__(self, size: int) -> None:
        self.size = size

    def create_matcher(self, max_rollback_tokens: int = 0) -> BaseMatcher:
        raise NotImplementedError

    def size_bytes(self) -> int:
        return self.size


class _SizedBackend(BaseGrammarBackend):
    """Compiles a regex ``"<n>"`` to a grammar of ``n`` MiB; counts compiles."""

    name = "sized"
    vocab_size = 8

    def __init__(self) -> None:
        self.compiles = 0

    def compile(self, kind: GrammarKind, text: str, options: Any = None) -> CompiledGrammar:
        self.compiles += 1
        return _SizedGrammar(int(text.split(":")[0]) * MIB)


@contextlib.contextmanager
def sized_service(backend: Any = None, **bounds: Any) -> Iterator[GrammarService]:
    """A compile service over ``backend`` (a fresh sized fake by default), shut down after."""
    service = GrammarService([backend or _SizedBackend()], **bounds)
    try:
        yield service
    finally:
        service.shutdown()


def test_the_cache_stays_within_its_byte_bound_least_recent_first() -> None:
    backend = _SizedBackend()
    with sized_service(backend, max_cache_bytes=32 * MIB) as service:
        for n in range(20):  # 20 distinct grammars of 10 MiB: at most 3 fit
            service.compile("regex", f"10:{n}")
            if n == 1:
                service.compile("regex", "10:0")  # used again: now more recent than 10:1
            assert service.cached_bytes() <= 32 * MIB
        assert service.cached_bytes() == 30 * MIB
        assert [service.is_cached("regex", f"10:{n}") for n in (17, 18, 19)] == [True] * 3
        assert not service.is_cached("regex", "10:0")
        assert service.evicted_for_bytes == 17
        compiles = backend.compiles
        service.compile("regex", "10:19")  # a hit: no compile
        assert backend.compiles == compiles


def test_least_recently_used_goes_first() -> None:
    with sized_service(max_cache_bytes=25 * MIB) as service:
        service.compile("regex", "10:a")
        service.compile("regex", "10:b")
        service.compile("regex", "10:a")  # a is now the more recent
        service.compile("regex", "10:c")
        assert service.is_cached("regex", "10:a") and not service.is_cached("regex", "10:b")


def test_a_grammar_bigger_than_the_bound_is_served_but_not_kept() -> None:
    with sized_service(max_cache_bytes=8 * MIB) as service:
        service.compile("regex", "1:small")
        big = service.compile("regex", "9:big")
        assert big.size_bytes() == 9 * MIB  # its request got it
        assert not service.is_cached("regex", "9:big")
        assert service.is_cached("regex", "1:small") and service.cached_bytes() == MIB


def test_no_byte_bound_counts_bytes_only() -> None:
    with sized_service() as service:
        for n in range(5):
            service.compile("regex", f"100:{n}")
        assert service.cached_bytes() == 500 * MIB and service.evicted_for_bytes == 0


def test_xgrammar_ships_nothing_bigger_than_its_grammar(xgrammar_backend) -> None:
    """A real schema whose xgrammar grammar is 1.3 MiB serialized to 48 MiB of JSON (5.5 s to
    write, 2.4 s to read back, ~350 MB of RSS that stayed), where compiling it takes 0.1 s."""
    schema = (DATA / "jsonschemabench/schemas/Github_hard/o83840.json").read_text()
    compiled = xgrammar_backend.compile("json_schema", schema)
    shipped = len(pickle.dumps(xgrammar_backend.export(compiled)))
    grammar_bytes = compiled._compiled.memory_size_bytes  # xgrammar's own figure
    assert shipped <= grammar_bytes, f"{shipped / MIB:.1f} MiB shipped, grammar {grammar_bytes}"
    assert compiled.size_bytes() == grammar_bytes  # what the service counts
    # and the backend keeps no second copy in xgrammar's own compiler cache
    assert xgrammar_backend._compiler.get_cache_size_bytes() == 0
