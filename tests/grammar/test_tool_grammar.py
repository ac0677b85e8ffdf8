"""The tool-call grammar (``server.tools.grammar``) compiled by xgrammar and run on a matcher over
the default tokenizer, for every format: a valid call is accepted; a wrong name, arguments that
break the function's schema, text where only calls may go and a second call with parallel calls
off are refused; free text stays free under ``auto``."""

from __future__ import annotations

import json

import pytest
from grammar_cases import matcher_accepts

from splitserve.server.tools.formats import (
    DEEPSEEK_V3,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    QWEN3_CODER,
    ToolCallFormat,
)
from splitserve.server.tools.grammar import FunctionSpec, tool_call_constraint
from splitserve.server.tools.parsers import parse_tool_calls

WEATHER = FunctionSpec("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False})
ADD = FunctionSpec("add", {"type": "object", "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": False})
FUNCTIONS = [WEATHER, ADD]
GOOD_WEATHER = '{"city": "Paris", "unit": "c"}'
GOOD_ADD = '{"a": 2, "b": 3}'
BAD_ARGS = ['{"unit": "c"}',  # required key missing
            '{"city": "Paris", "unit": "kelvin"}',  # not in the enum
            '{"city": 3}',  # wrong type
            '{"city": "Paris", "zip": "75001"}']  # additionalProperties false


def _accepts(tokenizer, backend, fmt: ToolCallFormat, mode: str, parallel: bool, text: str,
             functions: list[FunctionSpec] = FUNCTIONS) -> bool:
    constraint = tool_call_constraint(fmt, functions, mode, parallel)  # type: ignore[arg-type]
    assert constraint.kind == "structural_tag"
    compiled = backend.compile(constraint.kind, constraint.text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher_accepts(compiled.create_matcher(), ids, tokenizer.eos_token_id)


def _calls(fmt: ToolCallFormat, *calls: tuple[str, str]) -> str:
    return fmt.render_calls(list(calls))


ALL_FORMATS = [HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC, DEEPSEEK_V3]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_valid_calls_accepted(tokenizer, xgrammar_backend, fmt, mode: str) -> None:
    one = _calls(fmt, ("get_weather", GOOD_WEATHER))
    two = _calls(fmt, ("get_weather", GOOD_WEATHER), ("add", GOOD_ADD))
    assert _accepts(tokenizer, xgrammar_backend, fmt, mode, True, one)
    assert _accepts(tokenizer, xgrammar_backend, fmt, mode, True, two)
    # parallel_tool_calls false: one call, and a second one is refused
    assert _accepts(tokenizer, xgrammar_backend, fmt, mode, False, one)
    assert not _accepts(tokenizer, xgrammar_backend, fmt, mode, False, two)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_wrong_name_and_bad_arguments_refused(tokenizer, xgrammar_backend, fmt,
                                              mode: str) -> None:
    wrong = _calls(fmt, ("get_wether", GOOD_WEATHER))
    if fmt is PYTHONIC and mode == "auto":
        # A list starts only at a function's name ("[get_weather("): anything else is text,
        # and the parser reads it as text too.
        assert parse_tool_calls(wrong, fmt, functions={"get_weather": {}})[1] == []
    else:
        assert not _accepts(tokenizer, xgrammar_backend, fmt, mode, True, wrong)
    for bad in BAD_ARGS:
        if fmt is QWEN3_CODER and bad == '{"city": 3}':
            continue  # an XML value is text: "3" is a valid string
        text = _calls(fmt, ("get_weather", bad))
        assert not _accepts(tokenizer, xgrammar_backend, fmt, mode, True, text), text
    for arguments in BAD_ARGS:  # each is valid JSON: only the schema refuses it
        json.loads(arguments)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_required_refuses_text_auto_allows_it(tokenizer, xgrammar_backend, fmt) -> None:
    text = "The weather in Paris is sunny."
    assert _accepts(tokenizer, xgrammar_backend, fmt, "auto", True, text)
    assert not _accepts(tokenizer, xgrammar_backend, fmt, "required", True, text)
    assert not _accepts(tokenizer, xgrammar_backend, fmt, "required", True, "")


def test_auto_constrains_a_call_after_text(tokenizer, xgrammar_backend) -> None:
    good = "Let me look.\n" + _calls(HERMES, ("get_weather", GOOD_WEATHER))
    bad = "Let me look.\n" + _calls(HERMES, ("get_weather", BAD_ARGS[0]))
    assert _accepts(tokenizer, xgrammar_backend, HERMES, "auto", True, good)
    assert not _accepts(tokenizer, xgrammar_backend, HERMES, "auto", True, bad)
    # The bare object (Qwen2.5-Coder's way) is a call under Hermes too, constrained alike.
    assert _accepts(tokenizer, xgrammar_backend, HERMES, "auto", True,
                    f'{{"name": "add", "arguments": {GOOD_ADD}}}')
    assert not _accepts(tokenizer, xgrammar_backend, HERMES, "auto", True,
                        '{"name": "add", "arguments": {"a": "two", "b": 3}}')


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, QWEN3_CODER, PYTHONIC, DEEPSEEK_V3])
def test_named_choice_calls_only_that_function(tokenizer, xgrammar_backend, fmt) -> None:
    def named(text: str) -> bool:
        return _accepts(tokenizer, xgrammar_backend, fmt, "named", True, text, [ADD])

    assert named(_calls(fmt, ("add", GOOD_ADD)))
    assert not named(_calls(fmt, ("get_weather", GOOD_WEATHER)))
    assert not named(_calls(fmt, ("add", GOOD_ADD), ("add", GOOD_ADD)))  # exactly one
    assert not named("I will add them.")
