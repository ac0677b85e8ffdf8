"""BatchMask (fill + bias apply) against the plain-torch bitmask reference, and MaskFillThread,
without a model."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from splitserve.engine.grammar import allocate_bitmask, apply_bitmask_torch
from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.mask_thread import MaskFillThread
from splitserve.engine.grammar.request_grammar import RequestGrammar

IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
SCHEMA = json.dumps({"type": "object", "properties": {"story": {"type": "string"}}})


def _grammar(backend: Any, tokenizer: Any, kind: str, text: str, prefix: str) -> RequestGrammar:
    """A grammar advanced over ``prefix``: states from restrictive (few tokens) to open text."""
    grammar = RequestGrammar(
        backend.compile(kind, text).create_matcher(8), backend.vocab_size, [tokenizer.eos_token_id]
    )
    for token_id in tokenizer.encode(prefix, add_special_tokens=False):
        assert grammar.accept(token_id)
    return grammar


@pytest.fixture(params=["llguidance", "xgrammar", "outlines"])
def grammars(request, backends, tokenizer) -> list[RequestGrammar]:
    backend = backends[request.param]
    return [
        _grammar(backend, tokenizer, "regex", IPV4, "19"),
        _grammar(backend, tokenizer, "json_schema", SCHEMA, ""),  # only "{" and whitespace
        _grammar(backend, tokenizer, "json_schema", SCHEMA, '{"story":"Once upon'),  # open text
        _grammar(backend, tokenizer, "choice", json.dumps(["yes", "no"]), "yes"),  # EOS only
    ]


def _expected(
    logits: torch.Tensor, grammars: list[RequestGrammar], rows: list[int]
) -> torch.Tensor:
    """The reference: a fresh batch bitmask applied by plain torch ops."""
    bitmask = allocate_bitmask(logits.shape[0], grammars[0].vocab_size)
    for grammar, row in zip(grammars, rows):
        grammar.fill_bitmask(bitmask, row)
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, rows)
    return expected


@pytest.mark.parametrize("use_bias", [True, False])  # False: the non-CPU path, xgrammar's kernel
def test_apply_matches_reference_and_leaves_other_rows(grammars, use_bias: bool) -> None:
    vocab_size = grammars[0].vocab_size
    rows = [0, 2, 3, 5]  # rows 1 and 4 unconstrained; 2-3 a run, 0 and 5 alone
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(0))
    expected = _expected(logits, grammars, rows)
    mask = BatchMask(vocab_size)
    mask.use_bias = use_bias
    masked = logits.clone()
    mask.fill(grammars, rows)
    mask.apply(masked, rows)
    assert torch.equal(masked, expected)
    for row in (1, 4):  # bit for bit, not just equal values
        assert torch.equal(masked[row].view(torch.int32), logits[row].view(torch.int32))
    assert all(int(torch.isfinite(masked[r]).sum()) < vocab_size for r in rows)


def test_buffers_grow_and_old_rows_do_not_leak(grammars) -> None:
    vocab_size = grammars[0].vocab_size
    mask = BatchMask(vocab_size)
    mask.fill(grammars[:1], [0])
    rows = [1, 3, 4, 7]  # grows the buffers past the first fill
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(1))
    mask.fill(grammars, rows)
    masked = logits.clone()
    mask.apply(masked, rows)
    assert torch.equal(masked, _expected(logits, grammars, rows))
    mask.fill(grammars[1:2], [2])  # a smaller batch: rows filled earlier are stale, never used
    masked = logits[:3].clone()
    mask.apply(masked, [2])
    assert torch.equal(masked, _expected(logits[:3], grammars[1:2], [2]))


def test_narrower_logits_are_masked_wider_refused(grammars) -> None:
    vocab_size = grammars[0].vocab_size
    mask = BatchMask(vocab_size)
    mask.fill(grammars[:2], [0, 1])
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(2))
    narrow = logits[:, : vocab_size - 7].clone()
    mask.apply(narrow, [0, 1])
    assert torch.equal(narrow, _expected(logits, grammars[:2], [0, 1])[:, : vocab_size - 7])
    with pytest.raises(ValueError, match="exceeds the grammar vocab"):
        mask.apply(torch.zeros(2, vocab_size + 32), [0, 1])
    with pytest.raises(ValueError, match="vocab_size"):
        BatchMask(0)


def test_bfloat16_logits(grammars) -> None:
    mask = BatchMask(grammars[0].vocab_size)
    mask.fill(grammars, [0, 1, 2, 3])
    logits = torch.randn(4, grammars[0].vocab_size).to(torch.bfloat16)
    expected = _expected(logits, grammars, [0, 1, 2, 3])
    mask.apply(logits, [0, 1, 2, 3])
    assert torch.equal(logits, expected)


def test_mask_thread_runs_elsewhere_and_reraises() -> None:
    thread = MaskFillThread()
    seen: list[int] = []
    thread.start(lambda: seen.append(threading.get_ident()))
    thread.join()
    assert seen and seen[0] != threading.get_ident()
    release = threading.Event()
    thread.start(release.wait)
    with pytest.raises(RuntimeError, match="still in flight"):
        thread.start(lambda: None)
    release.set()
    thread.join()

    def fail() -> None:
        raise KeyError("boom")

    thread.start(fail)
    with pytest.raises(KeyError, match="boom"):
        thread.join()
    thread.join()  # nothing in flight: a no-op
    thread.close()
    thread.close()
