"""Each constraint kind on each backend: valid text accepted, invalid refused, masks consistent."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from grammar_cases import bit_is_set, matcher_accepts

from splitserve.engine.grammar import (
    BaseGrammarBackend,
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_torch,
)

IPV4 = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
ISO_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = json.dumps(["yes", "no", "maybe later", 'say "hi"'])
SQL_EBNF = r"""
root ::= "SELECT " columns " FROM " ident where? ";"?
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "!=" | "<" | ">" | "<=" | ">="
value ::= [0-9]+ | "'" [a-zA-Z0-9 ]* "'"
ident ::= [a-zA-Z_] [a-zA-Z0-9_]*
"""

# (kind, source, valid texts, invalid texts, backends that support the kind)
CASES: list[tuple[str, str, list[str], list[str], tuple[str, ...]]] = [
    (
        "regex",
        IPV4,
        ["192.168.0.1", "8.8.8.8"],
        ["256.1.1.1", "1.2.3", "1.2.3.4.5"],
        ("llguidance", "xgrammar", "outlines"),
    ),
    (
        "regex",
        ISO_DATE,
        ["2024-02-29", "1999-12-31"],
        ["2024-13-01", "24-01-01", "2024-1-1"],
        ("llguidance", "xgrammar", "outlines"),
    ),
    (
        "choice",
        CHOICES,
        ["yes", "maybe later", 'say "hi"'],
        ["ye", "yesno", "Yes"],
        ("llguidance", "xgrammar", "outlines"),
    ),
    (
        "json_object",
        "",
        ['{"a":1,"b":[true,null]}', "{}"],  # compact JSON: the default
        ["[1, 2]", '"x"', '{"a": }', '{"a": 1}'],
        ("llguidance", "xgrammar", "outlines"),
    ),
    (
        "ebnf",
        SQL_EBNF,
        ["SELECT * FROM users;", "SELECT id, name FROM t WHERE age >= 18 AND name = 'bob'"],
        ["SELECT FROM t", "select * from t", "SELECT * FROM t WHERE"],
        ("llguidance", "xgrammar"),
    ),
]
CASE_IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _params() -> list[Any]:
    return [
        pytest.param(name, case, id=f"{name}-{cid}")
        for case, cid in zip(CASES, CASE_IDS)
        for name in ("llguidance", "xgrammar", "outlines")
        if name in case[4]
    ]


@pytest.mark.parametrize(("name", "case"), _params())
def test_kind_accepts_valid_rejects_invalid(
    name: str, case: tuple, compile_once: Callable, tokenizer: Any
) -> None:
    kind, source, valid, invalid, _ = case
    compiled = compile_once(name, kind, source)
    eos = tokenizer.eos_token_id
    for text in valid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert matcher_accepts(compiled.create_matcher(), ids, eos), text
    for text in invalid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not matcher_accepts(compiled.create_matcher(), ids, eos), text


@pytest.mark.parametrize(("name", "case"), _params())
def test_bitmask_allows_each_next_token(
    name: str,
    case: tuple,
    backends: dict[str, BaseGrammarBackend],
    compile_once: Callable,
    tokenizer: Any,
) -> None:
    kind, source, valid, _, _ = case
    backend = backends[name]
    compiled = compile_once(name, kind, source)
    eos = tokenizer.eos_token_id
    bitmask = allocate_bitmask(3, backend.vocab_size)
    row = 1  # a middle row: the matcher must write only its own row
    for text in valid:
        matcher = compiled.create_matcher()
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            matcher.fill_bitmask(bitmask, row)
            assert bit_is_set(bitmask, row, token_id), (text, token_id)
            assert not bit_is_set(bitmask, row, eos) or matcher.can_end()
            assert matcher.accept_token(token_id)
        matcher.fill_bitmask(bitmask, row)
        assert bit_is_set(bitmask, row, eos)
        # Special tokens never appear as text, even inside a JSON string.
        for special in tokenizer.all_special_ids:
            if special != eos:
                assert not bit_is_set(bitmask, row, special)
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())


@pytest.mark.parametrize("name", ["llguidance", "xgrammar", "outlines"])
def test_rollback_copy_reset(
    name: str, backends: dict[str, BaseGrammarBackend], tokenizer: Any
) -> None:
    compiled = backends[name].compile("regex", ISO_DATE)
    ids = tokenizer.encode("2024-02-29", add_special_tokens=False)
    matcher = compiled.create_matcher(max_rollback_tokens=8)
    for token_id in ids:
        assert matcher.accept_token(token_id)
    assert matcher.can_end()
    twin = matcher.copy()
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    assert not matcher.accept_token(ids[0])  # nothing after the stop token
    matcher.rollback(2)  # the stop token and the last text token
    assert not matcher.is_terminated() and not matcher.can_end()
    assert matcher.accept_token(ids[-1]) and matcher.can_end()
    assert twin.can_end() and not twin.is_terminated()
    matcher.reset()
    assert not matcher.can_end() and matcher.accept_token(ids[0])


def test_ebnf_refused_by_outlines(outlines_backend: BaseGrammarBackend) -> None:
    with pytest.raises(GrammarError, match="EBNF grammars are not supported by the outlines"):
        outlines_backend.compile("ebnf", SQL_EBNF)


def test_jump_forward_string(xgrammar_backend: BaseGrammarBackend) -> None:
    schema = json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    )
    matcher = xgrammar_backend.compile("json_schema", schema).create_matcher()
    assert matcher.find_jump_forward_string().startswith("{")


def test_apply_bitmask_matches_torch_reference(
    xgrammar_backend: BaseGrammarBackend, tokenizer: Any
) -> None:
    vocab_size = xgrammar_backend.vocab_size
    bitmask = allocate_bitmask(3, vocab_size)
    compiled = xgrammar_backend.compile("regex", IPV4)
    compiled.create_matcher().fill_bitmask(bitmask, 0)
    compiled.create_matcher().fill_bitmask(bitmask, 2)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, [0, 2])
    rows = [0, 2]
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    digit = tokenizer.encode("1", add_special_tokens=False)[0]
    assert torch.isfinite(logits[0, digit]) and logits[0, tokenizer.eos_token_id] == float("-inf")
    assert torch.isfinite(logits[1]).all()  # the unconstrained row is untouched
