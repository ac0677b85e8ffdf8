"""A program's chat prompt as an Anthropic Messages request and the answer back
(``lang.anthropic_messages``), and the constraints ``AnthropicCompatible`` refuses, with no
server."""

from __future__ import annotations

import pytest

from splitserve import lang
from splitserve.lang.anthropic_compatible import _schema
from splitserve.lang.anthropic_messages import message_output, messages_body, tools_fields
from splitserve.lang.backend import ChatPrompt, SamplingArgs, TextPrompt, ToolsArgs

CALL = {"id": "toolu_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_history_becomes_blocks_and_turns() -> None:
    prompt = ChatPrompt([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "And so?"},
        {"role": "assistant", "content": "It is"},
    ])
    body = messages_body("m", prompt, SamplingArgs(max_tokens=7, stop=["\n"], temperature=0))
    assert body == {
        "model": "m", "max_tokens": 7, "system": "Be brief.", "stop_sequences": ["\n"],
        "temperature": 0,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                {"type": "text", "text": "And so?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}]},  # prefill
        ]}


def test_seed_is_refused() -> None:
    with pytest.raises(lang.BackendError, match="seed") as info:
        messages_body("m", ChatPrompt([{"role": "user", "content": "x"}]),
                      SamplingArgs(seed=1))
    assert info.value.unsupported


@pytest.mark.parametrize(("choice", "parallel", "want"), [
    (None, None, None),
    ("auto", None, {"type": "auto"}),
    ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ("none", None, {"type": "none"}),
    ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
    (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
])
def test_tool_fields(choice, parallel, want) -> None:
    spec = lang.tool_spec({"type": "function", "function": {
        "name": "f", "description": "F.", "parameters": {"type": "object"}}})
    out = tools_fields(ToolsArgs([spec], choice, parallel))
    assert out["tools"] == [{"name": "f", "description": "F.",
                             "input_schema": {"type": "object"}}]
    assert out.get("tool_choice") == want


def test_answer_blocks_become_text_calls_and_meta() -> None:
    out = message_output({
        "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"a": 1}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 9, "cache_read_input_tokens": 16}})
    assert out.text == "Checking."
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [("toolu_2", "f", {"a": 1})]
    assert out.meta == {"finish_reason": "tool_calls", "stop_reason": "tool_use",
                        "prompt_tokens": 19, "completion_tokens": 9, "cached_tokens": 16}


def test_what_messages_cannot_carry_is_refused_by_name() -> None:
    assert _schema("choices", ["a", "b"]) == {"type": "string", "enum": ["a", "b"]}
    assert _schema("json_schema", '{"type": "object"}') == {"type": "object"}
    with pytest.raises(lang.BackendError, match="regex constraint") as info:
        _schema("regex", "[0-9]+")
    assert info.value.unsupported
    backend = lang.AnthropicCompatible("http://127.0.0.1:9")  # never reached
    with pytest.raises(lang.BackendError, match="logprobs"):
        backend.select(ChatPrompt([]), ["a"])
    with pytest.raises(lang.BackendError, match="role program"):
        backend.generate(TextPrompt("Once upon"), SamplingArgs(), None)
