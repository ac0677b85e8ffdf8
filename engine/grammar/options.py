"""How a constraint is compiled, beside its source: the options that change the grammar.

They are part of the compile cache's key (``service.GrammarService``): the same schema with and
without free whitespace are two different grammars.
"""

from __future__ import annotations

from dataclasses import dataclass

# JSON separators when whitespace is not free: the compact form of ``json.dumps(separators=...)``.
COMPACT_ITEM_SEPARATOR = ","
COMPACT_KEY_SEPARATOR = ":"


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Options of one compile.

    Attributes:
        whitespace_flexible: JSON kinds only. False (the default): no whitespace between JSON
            tokens, ``,`` and ``:`` as separators, so greedy decoding cannot spend its budget on
            legal whitespace (vllm#4093). True: any JSON whitespace between tokens (each backend
            bounds a run of it, so a model cannot loop on newlines forever).
        strict: json_schema only. True: only a backend that enforces every keyword of the
            schema may compile it (``constraints.schema_limits``); none can -> ``GrammarError``
            naming each keyword and where it is. False: the best backend runs it and the
            keywords it does not enforce are reported on the compiled grammar
            (``CompiledGrammar.ignored``).
    """

    whitespace_flexible: bool = False
    strict: bool = False


DEFAULT_OPTIONS = CompileOptions()
