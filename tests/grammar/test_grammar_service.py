"""GrammarService: error messages, cache hits, timeouts and the fallback chain."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from typing import Any

import pytest

from splitserve.engine.grammar import (
    BaseGrammarBackend,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
    GrammarService,
)

SIMPLE_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})


class _HeldBackend(BaseGrammarBackend):
    """Blocks each compile until ``release`` is set (or fails, without ``inner``), so that a test
    decides when a compile ends instead of guessing a duration; ``finished`` counts the compiles
    that returned."""

    def __init__(
        self, inner: BaseGrammarBackend | None, name: str = "held", hold: bool = True
    ) -> None:
        self.name = name
        self.vocab_size = inner.vocab_size if inner else 0
        self._inner = inner
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.calls = 0
        self.finished = 0

    def compile(self, kind: GrammarKind, text: str, options: Any = None) -> CompiledGrammar:
        self.calls += 1
        # Bounded, so that a test that fails never leaves a compile thread behind for long.
        self.release.wait(30.0)
        try:
            if self._inner is None:
                raise GrammarError(f"{self.name} cannot do this")
            return self._inner.compile(kind, text)
        finally:
            self.finished += 1


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("json_schema", '{"type": "object", "properties": ', "JSON schema syntax error"),
        ("json_schema", '{"type": "strin"}', "strin"),
        ("regex", "[a-", "regex"),
        ("ebnf", 'root ::= "a" (', "EBNF"),
        ("ebnf", 'rot ::= "a"', "root"),
        ("choice", "[]", "non-empty JSON list"),
        ("choice", "yes", "JSON list of strings"),
        ("xml", "<a/>", "unknown constraint kind"),
    ],
)
def test_bad_input_names_problem(
    chain_service: GrammarService, kind: str, text: str, expected: str
) -> None:
    with pytest.raises(GrammarError, match=expected) as info:
        chain_service.compile(kind, text)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_regex_error_mentions_each_backend(chain_service: GrammarService) -> None:
    with pytest.raises(GrammarError) as info:
        chain_service.compile("regex", "(unclosed")
    message = str(info.value)
    assert "xgrammar:" in message and "outlines:" in message and "regex" in message


def test_cache_returns_same_object(xgrammar_backend: BaseGrammarBackend) -> None:
    service = GrammarService([xgrammar_backend])
    first = service.submit("json_schema", SIMPLE_SCHEMA)
    second = service.submit("json_schema", SIMPLE_SCHEMA)
    assert first is second
    assert first.result() is service.compile("json_schema", SIMPLE_SCHEMA)
    assert service.is_cached("json_schema", SIMPLE_SCHEMA)
    assert service.submit("json_object", "") is service.submit("json_object", "{}")
    service.shutdown()


def test_timeout_fails_request(xgrammar_backend: BaseGrammarBackend) -> None:
    held = _HeldBackend(xgrammar_backend)
    service = GrammarService([held], timeout_s=0.05)
    try:
        with pytest.raises(GrammarError, match="timed out after 0.05s"):
            service.compile("regex", "[0-9]+")
        # Failed at the deadline, while the compile had not returned (not when it ended).
        assert held.finished == 0
        assert not service.is_cached("regex", "[0-9]+")  # timeouts are not cached
    finally:
        held.release.set()
        service.shutdown()


def test_fallback_after_failure_and_timeout(xgrammar_backend: BaseGrammarBackend) -> None:
    failing = _HeldBackend(None, name="broken", hold=False)
    hanging = _HeldBackend(xgrammar_backend, name="hanging")
    working = _HeldBackend(xgrammar_backend, name="working", hold=False)
    # The timeout only needs to cover the working backend's compile of a short regex: the
    # hanging one never returns before it (it is released after the assertions).
    service = GrammarService([failing, hanging, working], timeout_s=2.0, num_threads=3)
    try:
        compiled = service.compile("regex", "[0-9]+")
        assert compiled.backend_name == "xgrammar" and working.calls == 1
        assert failing.finished == 1 and hanging.finished == 0  # hanging's timeout moved on
    finally:
        hanging.release.set()
        service.shutdown()


def test_submit_does_not_block(xgrammar_backend: BaseGrammarBackend) -> None:
    """A grammar still compiling stays pending; the caller never waits for it."""
    held = _HeldBackend(xgrammar_backend)
    service = GrammarService([held], timeout_s=60.0, num_threads=2)
    try:
        # submit() returns while the compile cannot finish: had it waited, the held compile
        # would have run out its 30 s bound first and the future would be done here.
        slow: Future = service.submit("regex", "[a-z]+")
        assert not slow.done() and held.finished == 0
        done = threading.Event()
        slow.add_done_callback(lambda _: done.set())
        held.release.set()
        assert done.wait(30.0) and slow.result().backend_name == "xgrammar"
    finally:
        held.release.set()
        service.shutdown()
