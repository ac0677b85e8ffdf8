"""Grammar masks for speculative drafts, without a model: ``RequestGrammar.accepted_prefix``
trims a draft where the grammar stops accepting it and leaves the matcher as it was, and
``BatchMask.fill_drafted`` writes, row after row, exactly the masks that accepting the draft one
token at a time gives (xgrammar and outlines)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.request_grammar import RequestGrammar

SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"], "additionalProperties": False})


def _grammar(backend: Any, tokenizer: Any) -> RequestGrammar:
    matcher = backend.compile("json_schema", SCHEMA).create_matcher(max_rollback_tokens=64)
    return RequestGrammar(matcher, backend.vocab_size, [tokenizer.eos_token_id])


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_accepted_prefix_trims_and_restores(name: str, backends, tokenizer) -> None:
    grammar = _grammar(backends[name], tokenizer)
    good = _ids(tokenizer, '{"city":"Paris"}')
    assert grammar.accepted_prefix(good) == len(good)
    # A stop token that ends the grammar is left for the model to sample: no mask follows it.
    assert grammar.accepted_prefix(good + [tokenizer.eos_token_id]) == len(good)
    bad = _ids(tokenizer, '{"town":"Paris"}')
    n = grammar.accepted_prefix(bad)
    assert 0 < n < len(bad)
    # Nothing was consumed: the whole valid text is still accepted from the start.
    for t in good:
        assert grammar.accept(t)
    assert grammar.matcher.can_end()


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_fill_drafted_equals_masks_one_token_at_a_time(name: str, backends, tokenizer) -> None:
    backend = backends[name]
    draft = _ids(tokenizer, '{"city":"Lis')
    other = _grammar(backend, tokenizer)  # a second request without a draft, after it
    grammar = _grammar(backend, tokenizer)
    mask = BatchMask(backend.vocab_size)
    start_other = len(draft) + 1
    mask.fill_drafted([grammar, other], [0, start_other], [draft, []])
    got = mask.bitmask[: start_other + 1].clone()

    # The reference: one grammar per row, advanced by the draft's first t tokens, in one fill.
    refs = []
    for t in range(len(draft) + 1):
        ref = _grammar(backend, tokenizer)
        assert all(ref.accept(tok) for tok in draft[:t])
        refs.append(ref)
    want = BatchMask(backend.vocab_size)
    want.fill([*refs, _grammar(backend, tokenizer)], [*range(len(draft) + 1), start_other])
    assert torch.equal(got, want.bitmask[: start_other + 1])
    # The bias rows equal too (applied to zero logits: 0 where allowed, -inf elsewhere).
    a = torch.zeros(start_other + 1, backend.vocab_size)
    b = torch.zeros_like(a)
    mask.apply(a, list(range(start_other + 1)))
    want.apply(b, list(range(start_other + 1)))
    assert torch.equal(a, b)
    # The matcher was rolled back: the draft is accepted again from the start.
    for t in draft:
        assert grammar.accept(t)
