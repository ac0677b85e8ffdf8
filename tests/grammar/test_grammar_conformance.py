"""Matcher-level conformance on JSON-Schema-Test-Suite (draft2020-12) and MaskBench.

For each sampled schema: compile it (a failure is counted, not an error), then feed each valid
instance's tokens (json.dumps of the data) and require every token accepted and the stop token
allowed at the end; each invalid instance must be refused somewhere (a token or the stop token).

BASELINE holds the counts measured when this layer was written; the test fails if a count drops.
To update after an improvement (or a deliberate trade-off): run
    python -m pytest tests/grammar/test_grammar_conformance.py -q -s
read the "conformance" lines it prints, and copy the new numbers into BASELINE.
"""

from __future__ import annotations

from typing import Any

import pytest
from grammar_cases import Counts, SchemaCase, check_case, load_maskbench_cases, load_suite_cases

from splitserve.engine.grammar import BaseGrammarBackend, GrammarError, GrammarService

# Deterministic subsets (every Nth case in sorted order) keep the run to about a minute on two
# cores; outlines-core alone needs minutes for the full MaskBench copy.
SUITE_STRIDE = 2
MASKBENCH_STRIDE = 6

# (compiled, valid accepted, invalid rejected) per data set and backend; "chain" is xgrammar then
# outlines through GrammarService. Totals per data set are in TOTALS.
# Measured with xgrammar 0.2.9 and outlines-core 0.2.14 on the SmolLM2-135M tokenizer. Out of:
# suite 192 schemas / 385 valid / 276 invalid; maskbench 47 schemas / 57 valid / 80 invalid
# (instances of schemas that did not compile count as neither accepted nor rejected).
BASELINE: dict[tuple[str, str], tuple[int, int, int]] = {
    ("suite", "xgrammar"): (179, 348, 94),
    ("suite", "outlines"): (58, 56, 93),
    ("suite", "chain"): (184, 351, 103),
    ("maskbench", "xgrammar"): (47, 50, 71),
    ("maskbench", "outlines"): (31, 36, 21),
    ("maskbench", "chain"): (47, 50, 71),
}

DATASETS = {
    "suite": lambda: load_suite_cases()[::SUITE_STRIDE],
    "maskbench": lambda: load_maskbench_cases()[::MASKBENCH_STRIDE],
}


def _run(compile_fn: Any, cases: list[SchemaCase], tokenizer: Any) -> tuple[Counts, list[str]]:
    counts, failures = Counts(schemas=len(cases)), []
    for case in cases:
        counts.valid_total += len(case.valid)
        counts.invalid_total += len(case.invalid)
        try:
            compiled = compile_fn(case.schema_text)
        except GrammarError as exc:
            failures.append(f"{case.name}: not compiled: {str(exc)[:120]}")
            continue
        counts.compiled += 1
        failures += check_case(compiled, case, tokenizer, counts)
    return counts, failures


@pytest.fixture(scope="module")
def results(
    backends: dict[str, BaseGrammarBackend], chain_service: GrammarService, tokenizer: Any
) -> dict[tuple[str, str], Counts]:
    out: dict[tuple[str, str], Counts] = {}
    for dataset, load in DATASETS.items():
        cases = load()
        runners = {
            name: (lambda text, b=b: b.compile("json_schema", text)) for name, b in backends.items()
        }
        # The chain reuses the same backend objects, so xgrammar's compile cache makes its
        # first step nearly free; outlines runs only for what xgrammar refused.
        runners["chain"] = lambda text: chain_service.compile("json_schema", text)
        for name, run in runners.items():
            counts, _ = _run(run, cases, tokenizer)
            out[(dataset, name)] = counts
            print(
                f"\nconformance {dataset:9} {name:8} schemas={counts.schemas} "
                f"compiled={counts.compiled} valid={counts.valid_accepted}/{counts.valid_total} "
                f"invalid_rejected={counts.invalid_rejected}/{counts.invalid_total}"
            )
    return out


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("name", ["xgrammar", "outlines", "chain"])
def test_conformance_does_not_drop(
    results: dict[tuple[str, str], Counts], dataset: str, name: str
) -> None:
    counts = results[(dataset, name)]
    baseline = BASELINE[(dataset, name)]
    assert all(now >= then for now, then in zip(counts.as_tuple(), baseline)), (
        f"{dataset}/{name}: {counts.as_tuple()} dropped below baseline {baseline}"
    )


def test_chain_covers_at_least_each_backend(results: dict[tuple[str, str], Counts]) -> None:
    for dataset in DATASETS:
        chain = results[(dataset, "chain")].compiled
        assert chain >= results[(dataset, "xgrammar")].compiled
        assert chain >= results[(dataset, "outlines")].compiled
