"""Per-token fill_bitmask time for xgrammar (printed, not asserted: CI machines vary)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from grammar_cases import load_maskbench_cases

from splitserve.engine.grammar import allocate_bitmask
from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend


def test_xgrammar_mask_p50(xgrammar_backend: XGrammarBackend, tokenizer: Any) -> None:
    cases = [c for c in load_maskbench_cases()[::12] if c.valid][:12]
    bitmask = allocate_bitmask(1, xgrammar_backend.vocab_size)
    timings_us: list[float] = []
    for case in cases:
        matcher = xgrammar_backend.compile("json_schema", case.schema_text).create_matcher()
        text = case.valid[0]
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            started = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            timings_us.append((time.perf_counter() - started) * 1e6)
            if not matcher.accept_token(token_id):
                break
    assert timings_us
    timings_us.sort()
    p99 = timings_us[int(0.99 * (len(timings_us) - 1))]
    print(
        f"\nxgrammar fill_bitmask over {len(cases)} schemas, {len(timings_us)} tokens: "
        f"p50={statistics.median(timings_us):.1f} us p99={p99:.1f} us "
        f"(schema sample: {json.dumps([c.name for c in cases])[:120]}...)"
    )
