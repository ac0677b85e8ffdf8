"""Grammar fixtures: one backend of each kind per session (building a vocabulary takes ~1 s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from splitserve.engine.grammar import BaseGrammarBackend, CompiledGrammar, GrammarService
from splitserve.engine.grammar.llguidance_backend import LLGuidanceBackend
from splitserve.engine.grammar.outlines_backend import OutlinesBackend
from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend


@pytest.fixture(scope="session")
def xgrammar_backend(tokenizer: Any) -> XGrammarBackend:
    return XGrammarBackend(tokenizer)


@pytest.fixture(scope="session")
def llguidance_backend(tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer)


@pytest.fixture(scope="session")
def outlines_backend(tokenizer: Any) -> OutlinesBackend:
    return OutlinesBackend(tokenizer)


@pytest.fixture(scope="session")
def backends(
    llguidance_backend: LLGuidanceBackend,
    xgrammar_backend: XGrammarBackend,
    outlines_backend: OutlinesBackend,
) -> dict[str, BaseGrammarBackend]:
    return {"llguidance": llguidance_backend, "xgrammar": xgrammar_backend,
            "outlines": outlines_backend}


@pytest.fixture(scope="session")
def chain_service(backends: dict[str, BaseGrammarBackend]) -> GrammarService:
    """The production chain (registry order: llguidance, xgrammar, outlines), sharing the
    session's backends (and xgrammar's compile cache)."""
    service = GrammarService(list(backends.values()), timeout_s=120.0)
    yield service
    service.shutdown()


@pytest.fixture(scope="session")
def compile_once(
    backends: dict[str, BaseGrammarBackend],
) -> Callable[[str, str, str], CompiledGrammar]:
    """Memoized ``backends[name].compile(kind, text)``: outlines' json_object alone takes ~20 s."""
    compiled: dict[tuple[str, str, str], CompiledGrammar] = {}

    def compile_(name: str, kind: str, text: str) -> CompiledGrammar:
        key = (name, kind, text)
        if key not in compiled:
            compiled[key] = backends[name].compile(kind, text)  # type: ignore[arg-type]
        return compiled[key]

    return compile_
