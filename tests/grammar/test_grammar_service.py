"""GrammarService: error messages, cache hits, timeouts and the fallback chain."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest

from splitserve.engine.grammar import (
    BaseGrammarBackend,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
    GrammarService,
)

SIMPLE_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})


class _SlowBackend(BaseGrammarBackend):
    """Sleeps before delegating (or failing), to exercise timeouts and fallback."""

    def __init__(
        self, inner: BaseGrammarBackend | None, delay_s: float, name: str = "slow"
    ) -> None:
        self.name = name
        self.vocab_size = inner.vocab_size if inner else 0
        self._inner = inner
        self._delay_s = delay_s
        self.calls = 0

    def compile(self, kind: GrammarKind, text: str) -> CompiledGrammar:
        self.calls += 1
        time.sleep(self._delay_s)
        if self._inner is None:
            raise GrammarError(f"{self.name} cannot do this")
        return self._inner.compile(kind, text)


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("json_schema", '{"type": "object", "properties": ', "JSON schema syntax error"),
        ("json_schema", '{"type": "strin"}', "strin"),
        ("regex", "[a-", "regex"),
        ("ebnf", 'root ::= "a" | ', "EBNF"),
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
    service = GrammarService([_SlowBackend(xgrammar_backend, delay_s=1.0)], timeout_s=0.05)
    started = time.perf_counter()
    with pytest.raises(GrammarError, match="timed out after 0.05s"):
        service.compile("regex", "[0-9]+")
    assert time.perf_counter() - started < 0.9  # failed at the deadline, not when the sleep ended
    assert not service.is_cached("regex", "[0-9]+")  # timeouts are not cached
    service.shutdown()


def test_fallback_after_failure_and_timeout(xgrammar_backend: BaseGrammarBackend) -> None:
    failing = _SlowBackend(None, delay_s=0.0, name="broken")
    hanging = _SlowBackend(xgrammar_backend, delay_s=2.0, name="hanging")
    working = _SlowBackend(xgrammar_backend, delay_s=0.0, name="working")
    service = GrammarService([failing, hanging, working], timeout_s=0.2, num_threads=3)
    compiled = service.compile("regex", "[0-9]+")
    assert compiled.backend_name == "xgrammar" and working.calls == 1
    service.shutdown()


def test_submit_does_not_block(xgrammar_backend: BaseGrammarBackend) -> None:
    """A slow grammar stays pending while a fast one finishes; the caller never waits."""
    slow_backend = _SlowBackend(xgrammar_backend, delay_s=0.5)
    service = GrammarService([slow_backend], timeout_s=5.0, num_threads=2)
    started = time.perf_counter()
    slow: Future = service.submit("regex", "[a-z]+")
    assert time.perf_counter() - started < 0.1 and not slow.done()
    done = threading.Event()
    slow.add_done_callback(lambda _: done.set())
    assert done.wait(5.0) and slow.result().backend_name == "xgrammar"
    service.shutdown()
