"""RequestGrammar (end detection, jump-forward), without a model."""

from __future__ import annotations

import json
from typing import Any

from splitserve.engine.grammar.request_grammar import RequestGrammar


def _grammar(backend: Any, tokenizer: Any, kind: str, text: str) -> RequestGrammar:
    matcher = backend.compile(kind, text).create_matcher(max_rollback_tokens=64)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)
    return RequestGrammar(matcher, backend.vocab_size, [tokenizer.eos_token_id], encode)


def test_must_end_once_only_a_stop_token_may_follow(xgrammar_backend, tokenizer) -> None:
    grammar = _grammar(xgrammar_backend, tokenizer, "choice", json.dumps(["yes", "yesterday"]))
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        assert not grammar.must_end()
        assert grammar.accept(token_id)
    assert grammar.matcher.can_end() and not grammar.must_end()  # "yesterday" still possible
    for token_id in tokenizer.encode("terday", add_special_tokens=False):
        assert grammar.accept(token_id)
    assert grammar.must_end()


def test_forced_tokens_hold_back_the_last_token(xgrammar_backend, tokenizer) -> None:
    grammar = _grammar(xgrammar_backend, tokenizer, "regex", "hello world, (yes|no)")
    forced = grammar.forced_tokens(limit=100)
    full = tokenizer.encode("hello world, ", add_special_tokens=False)
    assert forced == full[:-1] and forced
    for token_id in full[-1:] + tokenizer.encode("no", add_special_tokens=False):
        assert grammar.accept(token_id)  # the matcher advanced past the forced tokens
    assert grammar.must_end()
    assert _grammar(xgrammar_backend, tokenizer, "regex", "hello world").forced_tokens(0) == []
