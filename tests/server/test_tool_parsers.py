"""Tool-call parsing (``server.tools.extract``): each format, text around calls, several calls,
malformed envelopes left as text, and streaming that reassembles to the full parse with no markup
in any content piece."""

from __future__ import annotations

import json

import pytest

from splitserve.server.tools.extract import ToolCallExtractor
from splitserve.server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, detect_format
from splitserve.server.tools.parsers import parse_tool_calls
from splitserve.server.tools.stream import ToolCallStream

WEATHER = '{"city": "Paris", "unit": "c"}'
NESTED = '{"q": {"a": [1, "}\\"]"]}, "s": "<tool_call>"}'  # braces and markup inside strings


def _parse(text: str, fmt=HERMES) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, fmt, call_ids=lambda: "id")
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    # Hermes, as Qwen2.5 writes it: text before, one block per call.
    (HERMES, (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
             "</tool_call>"),
     "Let me check.", [("get_weather", WEATHER)]),
    (HERMES, (f'<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n'
             f'{{"name": "b", "arguments": {NESTED}}}\n</tool_call>'),
     "", [("a", "{}"), ("b", NESTED)]),
    # Qwen2.5-Coder writes the object without the tags.
    (HERMES, '{"name": "a", "arguments": {"x": 1}}', "", [("a", '{"x": 1}')]),
    # Text after a call stays content.
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone.',
     "\nDone.", [("a", "{}")]),
    # Llama 3 JSON: "parameters", calls separated by "; ".
    (LLAMA3_JSON, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     "", [("a", '{"x": 1}'), ("b", "{}")]),
    # Mistral: one list after the marker.
    (MISTRAL, (f'[TOOL_CALLS][{{"name": "a", "arguments": {WEATHER}}}, '
              '{"name": "b", "arguments": {}}]'),
     "", [("a", WEATHER), ("b", "{}")]),
    (MISTRAL, 'Sure [TOOL_CALLS][{"name": "a", "arguments": {}}]', "Sure", [("a", "{}")]),
])
def test_formats(fmt, text: str, content: str, calls: list) -> None:
    assert _parse(text, fmt) == (content, calls)
    for _, arguments in calls:
        json.loads(arguments)  # exactly the JSON the model wrote


@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, "Plain answer, no tools."),
    (HERMES, "  spaced  \n"),
    (HERMES, 'x < y and {"a": 1} and <tool'),  # marker prefixes and JSON that is no call
    (HERMES, "<tool_call>\n{\"nam"),  # cut before the name completed
    (HERMES, "<tool_call>oops</tool_call> done"),  # not a call object
    (HERMES, '<tool_call>\n{"name": "a", "arguments": nope}\n</tool_call>'),  # not an object
    (HERMES, '{"name": "a", "arguments": "s"}'),
    (HERMES, '{"name": 3, "arguments": {}}'),  # the name is no string
    (LLAMA3_JSON, '{"name": "a", "arguments": {}}'),  # the wrong key for the format
    (MISTRAL, "Hi [TOOL_CALLS] nope"),
])
def test_no_call_is_all_content(fmt, text: str) -> None:
    assert _parse(text, fmt) == (text, [])


def test_call_cut_off_keeps_its_partial_arguments() -> None:
    # finish_reason "length" inside the arguments: OpenAI returns them truncated too.
    assert _parse('<tool_call>\n{"name": "a", "arguments": {"q": 1') == ("", [("a", '{"q": 1')])


CALL_TEXTS = [
    (HERMES, ('Checking the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
             f'{WEATHER}}}\n</tool_call>\n<tool_call>\n{{"name": "b", "arguments": {NESTED}}}\n'
             "</tool_call>")),
    (MISTRAL, (f'[TOOL_CALLS][{{"name": "a", "arguments": {NESTED}}}, '
              '{"name": "b", "arguments": {}}]')),
    (LLAMA3_JSON, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'),
]


@pytest.mark.parametrize(("fmt", "text"), CALL_TEXTS)
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streaming_reassembles_to_the_full_parse(fmt, text: str, piece: int) -> None:
    stream = ToolCallStream(fmt)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.feed(text[i: i + piece])
    deltas += stream.finish()
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:  # the first delta of a call: its id, type and name
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                assert call["index"] not in calls and call["index"] == len(calls)
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            else:
                assert set(call) == {"index", "function"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    full_content, full_calls = _parse(text, fmt)
    assert content == full_content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == full_calls
    assert len(full_calls) == 2
    for d in deltas:  # no markup in any content piece
        for marker in ("<tool_call", "</tool_call", "[TOOL_CALLS", '"name"', "{"):
            assert marker not in (d.get("content") or "")
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"


def test_ids_are_openai_shaped_and_mistral_nine_chars() -> None:
    _, calls = parse_tool_calls('{"name": "a", "arguments": {}}', HERMES)
    assert calls[0].id.startswith("call_") and calls[0].as_openai()["type"] == "function"
    _, calls = parse_tool_calls('[TOOL_CALLS][{"name": "a", "arguments": {}}]', MISTRAL)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_extractor_holds_back_a_possible_marker() -> None:
    ex = ToolCallExtractor(HERMES)
    assert [e.content for e in ex.feed("Hello <tool")] == ["Hello"]  # "<tool" is held
    assert [e.content for e in ex.feed("box>")] == [" <toolbox>"]  # it was no marker


def test_detect_format_from_template_text() -> None:
    assert detect_format("... <tool_call>\\n{{ tool_call | tojson }} ...") is HERMES
    assert detect_format("{{ '[TOOL_CALLS]' }} ... parameters") is MISTRAL
    assert detect_format('<|python_tag|>{"name": ..., "parameters": ...}') is LLAMA3_JSON
    assert detect_format("{{ message.content }}") is None
    assert detect_format(None) is None


def test_every_format_is_a_tool_call_parser_flag() -> None:
    from splitserve.config.registry import TOOL_CALL_PARSER
    from splitserve.server.tools.formats import FORMATS

    assert set(TOOL_CALL_PARSER.names) == set(FORMATS)
    for name, fmt in FORMATS.items():
        assert TOOL_CALL_PARSER.load(name) is fmt
