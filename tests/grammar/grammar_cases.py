"""Loading conformance cases (schema + valid/invalid instances) and running them on a matcher."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.grammar import BaseMatcher, CompiledGrammar

DATA = Path(__file__).resolve().parents[1] / "data"
SUITE_DIR = DATA / "json-schema-test-suite" / "tests" / "draft2020-12"
MASKBENCH_DIR = DATA / "jsonschemabench" / "maskbench"


@dataclass(slots=True)
class SchemaCase:
    """One schema and its instances; ``name`` is stable across runs (file + group index)."""

    name: str
    schema_text: str
    valid: list[str]
    invalid: list[str]


def _case(name: str, schema: Any, tests: list[dict[str, Any]]) -> SchemaCase:
    # Instances are serialized compactly (the grammars' default: no whitespace between tokens)
    # with raw non-ASCII characters, as a model writes them; key order is the data's own.
    return SchemaCase(
        name=name,
        schema_text=json.dumps(schema),
        valid=[compact_json(t["data"]) for t in tests if t["valid"]],
        invalid=[compact_json(t["data"]) for t in tests if not t["valid"]],
    )


def compact_json(data: Any) -> str:
    """Returns: ``data`` as compact JSON (``,`` and ``:``, no whitespace), non-ASCII kept."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def load_suite_cases() -> list[SchemaCase]:
    """Returns: JSON-Schema-Test-Suite draft2020-12 (required part, not ``optional/``) groups."""
    cases = []
    for path in sorted(SUITE_DIR.glob("*.json")):
        for i, group in enumerate(json.loads(path.read_text())):
            cases.append(_case(f"{path.stem}#{i}", group["schema"], group["tests"]))
    return cases


def load_maskbench_cases() -> list[SchemaCase]:
    """Returns: every MaskBench schema copied into tests/data, with its instances."""
    cases = []
    for path in sorted(MASKBENCH_DIR.glob("*/*.json")):
        if path.name == "MANIFEST.json":
            continue
        doc = json.loads(path.read_text())
        cases.append(_case(f"{path.parent.name}/{path.stem}", doc["schema"], doc["tests"]))
    return cases


def bit_is_set(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    """Whether ``token_id`` is allowed in ``row`` of an int32 ``[B, ceil(V/32)]`` bitmask."""
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def matcher_accepts(matcher: BaseMatcher, token_ids: list[int], stop_token_id: int) -> bool:
    """Feed tokens, then the stop token; True if every one was accepted and the matcher ended."""
    for token_id in token_ids:
        if not matcher.accept_token(token_id):
            return False
    if not matcher.can_end():
        return False
    return matcher.accept_token(stop_token_id) and matcher.is_terminated()


@dataclass(slots=True)
class Counts:
    """Conformance tallies for one backend (or the chain) on one data set."""

    schemas: int = 0
    compiled: int = 0
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    invalid_total_compiled: int = 0

    @property
    def invalid_accepted(self) -> int:
        """Invalid instances of compiled schemas that the grammar let through."""
        return self.invalid_total_compiled - self.invalid_rejected

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.compiled, self.valid_accepted, self.invalid_rejected)


def check_case(
    compiled: CompiledGrammar, case: SchemaCase, tokenizer: Any, counts: Counts
) -> list[str]:
    """Run a compiled schema over its instances, updating ``counts``.

    Returns:
        Descriptions of the failures (valid refused / invalid accepted), for debugging.
    """
    failures = []
    stop = tokenizer.eos_token_id
    for text in case.valid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if matcher_accepts(compiled.create_matcher(), ids, stop):
            counts.valid_accepted += 1
        else:
            failures.append(f"{case.name}: valid refused: {text[:80]}")
    counts.invalid_total_compiled += len(case.invalid)
    for text in case.invalid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if matcher_accepts(compiled.create_matcher(), ids, stop):
            failures.append(f"{case.name}: invalid accepted: {text[:80]}")
        else:
            counts.invalid_rejected += 1
    return failures
