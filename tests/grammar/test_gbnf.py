"""llama.cpp-style GBNF through the chain: real files from llama.cpp's grammars/ folder
(tests/data/llama-cpp-grammars, MIT) and the syntax llama.cpp's grammar README uses — empty
alternatives, ``\\xNN`` escapes, ``{m,n}`` repetition — compile (llguidance reads GBNF) and hold
their language: valid text accepted, invalid refused."""

from __future__ import annotations

from typing import Any

import pytest
from grammar_cases import matcher_accepts

from splitserve.engine.grammar import GrammarService
from tests.conftest import DATA

GRAMMARS = DATA / "llama-cpp-grammars"

# file or inline grammar -> (valid texts, invalid texts)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "json.gbnf": (['{"a": 1, "b": [true]}', "{}"], ['{"a": 1.5}', "[1]"]),
    "json_arr.gbnf": (['[\n1,\n"x"]', "[\n]"], ["[1]", '[\n"a"'] ),
    "chess.gbnf": (["1. e4 e5\n2. Nf3 Nc6\n"], ["1. e4\n", "1. e9 e5\n2. a1 a2\n"]),
    "list.gbnf": (["- milk\n- eggs\n"], ["- \n", "milk\n"]),
    # llama.cpp's README: an optional space as an empty alternative.
    'root ::= "yes" space "no"\nspace ::= | " "\n': (["yesno", "yes no"], ["yes  no"]),
    'root ::= [\\x41-\\x43]{2,3} "\\x21"\n': (["AB!", "CCA!"], ["A!", "ABCA!", "AD!"]),
    'root ::= ("ab"){1,2} [0-9]{3}\n': (["ab123", "abab000"], ["ab12", "ababab123"]),
}


def _source(name: str) -> str:
    return (GRAMMARS / name).read_text() if name.endswith(".gbnf") else name


@pytest.mark.parametrize("name", list(CASES), ids=lambda n: n if n.endswith(".gbnf") else n[:20])
def test_gbnf_compiles_and_holds(name: str, chain_service: GrammarService, tokenizer: Any) -> None:
    compiled = chain_service.compile("ebnf", _source(name))
    valid, invalid = CASES[name]
    stop = tokenizer.eos_token_id
    for text in valid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert matcher_accepts(compiled.create_matcher(), ids, stop), (compiled.backend_name, text)
    for text in invalid:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not matcher_accepts(compiled.create_matcher(), ids, stop), text
