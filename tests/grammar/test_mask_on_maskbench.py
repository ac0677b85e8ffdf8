"""xgrammar's token mask on real MaskBench schemas agrees with its matcher, token by token.

(Its per-token fill time, which this file used to print, is measured by ``bench/grammar.py``'s
``mask`` section: a time on a shared machine is not something a test can assert.)
"""

from __future__ import annotations

from typing import Any

from grammar_cases import bit_is_set, load_maskbench_cases

from splitserve.engine.grammar import allocate_bitmask
from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend


def test_xgrammar_mask_agrees_with_matcher(
    xgrammar_backend: XGrammarBackend, tokenizer: Any
) -> None:
    """Along each sampled schema's first valid instance, the filled mask allows the next token
    exactly when the matcher accepts it (and the walk stops at the first refused token)."""
    cases = [c for c in load_maskbench_cases()[::12] if c.valid][:12]
    bitmask = allocate_bitmask(1, xgrammar_backend.vocab_size)
    num_checked = num_accepted = 0
    for case in cases:
        matcher = xgrammar_backend.compile("json_schema", case.schema_text).create_matcher()
        for token_id in tokenizer.encode(case.valid[0], add_special_tokens=False):
            matcher.fill_bitmask(bitmask, 0)
            allowed = bit_is_set(bitmask, 0, token_id)
            accepted = matcher.accept_token(token_id)
            assert allowed == accepted, (case.name, token_id)
            num_checked += 1
            if not accepted:
                break
            num_accepted += 1
    assert len(cases) == 12 and num_accepted > 0
    print(f"\nxgrammar mask vs matcher: {len(cases)} schemas, {num_checked} tokens checked, "
          f"{num_accepted} accepted")
