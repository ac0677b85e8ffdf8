"""Grammar-constrained decoding: backends, compile cache, token bitmasks.

Scheduler-side use::

    service = create_grammar_service(tokenizer, vocab_size)
    future = service.submit("json_schema", schema_text)       # when the request arrives
    if future.done():                                         # each step; not done -> keep waiting
        matcher = future.result().create_matcher()            # raises GrammarError -> HTTP 400
    matcher.fill_bitmask(bitmask, row)                        # bitmask = allocate_bitmask(B, V)
    apply_bitmask(logits, bitmask, rows)                      # before sampling
    matcher.accept_token(token_id)                            # after sampling

``ModelRunner`` does the fill and apply per batch with ``batch_mask.BatchMask``, the fill on
``mask_thread.MaskFillThread`` while the forward pass runs.
"""

from splitserve.engine.grammar.base import (
    GRAMMAR_KINDS,
    BaseGrammarBackend,
    BaseMatcher,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
)
from splitserve.engine.grammar.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_torch,
    bitmask_width,
)
from splitserve.engine.grammar.registry import (
    BACKEND_NAMES,
    DEFAULT_BACKEND,
    create_backend,
    create_grammar_service,
)
from splitserve.engine.grammar.service import GrammarService

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "GRAMMAR_KINDS",
    "BaseGrammarBackend",
    "BaseMatcher",
    "CompiledGrammar",
    "GrammarError",
    "GrammarKind",
    "GrammarService",
    "allocate_bitmask",
    "apply_bitmask",
    "apply_bitmask_torch",
    "bitmask_width",
    "create_backend",
    "create_grammar_service",
]
