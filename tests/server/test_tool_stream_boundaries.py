"""Every tool-call format's reference outputs split at every position (and character by
character): the streamed deltas reassemble to exactly the non-streamed parse, no markup reaches a
content delta (vLLM #22975), and each call's arguments are the JSON the call means. Then the same
with a reasoning model's thinking in front (``server.answer_stream``): calls and content come
only from after the thinking, and markup inside the thinking is thinking."""

from __future__ import annotations

import json

import pytest

from splitserve.ipc.messages import SamplingParams
from splitserve.server.answer_stream import AnswerStream, answer_parts
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.job import Job
from splitserve.server.reasoning.formats import QWEN3, PromptThinking
from splitserve.server.reasoning.request import ReasoningRequest
from splitserve.server.tools.formats import (
    DEEPSEEK_V3,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    QWEN3_CODER,
)
from splitserve.server.tools.parsers import parse_tool_calls
from splitserve.server.tools.stream import ToolCallStream

FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}}},
    "add": {"type": "object", "properties": {"a": {"type": "number"},
                                             "tags": {"type": "array"}}},
}
WEATHER = {"city": "Paris <tool_call> ]", "days": 3, "metric": True}
ADD = {"a": 1.5, "tags": ["x", "y"]}
CALLS = [("get_weather", json.dumps(WEATHER)), ("add", json.dumps(ADD))]

XML_TEXT = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Paris <tool_call> ]\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=tags>\n"
            '["x", "y"]\n</parameter>\n</function>\n</tool_call>')
# (format, the model's text, content, the calls' (name, arguments as a value))
REFERENCES = [
    (HERMES, "Let me see. " + HERMES.render_calls(CALLS), "Let me see.",
     [("get_weather", WEATHER), ("add", ADD)]),
    (LLAMA3_JSON, LLAMA3_JSON.render_calls(CALLS), "", [("get_weather", WEATHER), ("add", ADD)]),
    (MISTRAL, "Sure " + MISTRAL.render_calls(CALLS), "Sure",
     [("get_weather", WEATHER), ("add", ADD)]),
    (QWEN3_CODER, XML_TEXT, "I will check.", [("get_weather", WEATHER), ("add", ADD)]),
    (QWEN3_CODER, QWEN3_CODER.render_calls(CALLS), "", [("get_weather", WEATHER), ("add", ADD)]),
    (QWEN3_CODER, "<function=add>\n<parameter=a>\n2\n</parameter>\n</function> done", " done",
     [("add", {"a": 2})]),
    (PYTHONIC, ('Calling: [get_weather(city="Paris <tool_call> ]", days=3, metric=True), '
               'add(a=1.5, tags=("x", "y"))] ok'), "Calling: ok",
     [("get_weather", WEATHER), ("add", ADD)]),
    (PYTHONIC, PYTHONIC.render_calls(CALLS), "", [("get_weather", WEATHER), ("add", ADD)]),
    (PYTHONIC, "See [1] and [add(1)] and [x(a=1)].", "See [1] and [add(1)] and [x(a=1)].", []),
    (DEEPSEEK_V3, "Checking. " + DEEPSEEK_V3.render_calls(CALLS), "Checking.",
     [("get_weather", WEATHER), ("add", ADD)]),
]
MARKUP = ("<tool_call", "</tool_call", "<function", "<parameter", "[TOOL_CALLS", '"name"',
          "get_weather(", "<｜tool", "```")


def _stream(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    stream = ToolCallStream(fmt, FUNCTIONS)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    return (*_gather(deltas), deltas)


def _gather(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [(name, args) for name, args in calls.values()]


def _splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), REFERENCES)
def test_whole_answer(fmt, text: str, content: str, calls: list) -> None:
    got_content, got_calls = parse_tool_calls(text, fmt, functions=FUNCTIONS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), REFERENCES)
def test_every_split_reassembles_to_the_whole_answer(fmt, text: str, content: str,
                                                     calls: list) -> None:
    whole_content, whole_calls = parse_tool_calls(text, fmt, functions=FUNCTIONS)
    whole = (whole_content, [(c.name, c.arguments) for c in whole_calls])
    for pieces in _splits(text):
        got_content, got_calls, deltas = _stream(fmt, pieces)
        assert (got_content, got_calls) == whole, pieces
        for d in deltas:
            for marker in MARKUP:
                if marker not in content:
                    assert marker not in (d.get("content") or ""), (pieces, d)


THOUGHT = 'I could call <tool_call>{"name": "add"} or [add(a=1)] here.\n'


def _job(fmt, thinking: PromptThinking) -> Job:
    fmt_ = ResponseFormatter("id", 0, "m", True)
    job = Job("id", [1], SamplingParams(), [], fmt_, Usage(1))
    job.tool_format, job.tool_functions = fmt, FUNCTIONS
    job.reasoning, job.splits_reasoning = ReasoningRequest(QWEN3, thinking, None), True
    return job


@pytest.mark.parametrize(("fmt", "text", "content", "calls"),
                         [r for r in REFERENCES if r[3]])
def test_thinking_first_at_every_split(fmt, text: str, content: str, calls: list) -> None:
    answer = THOUGHT + "</think>\n\n" + text
    job = _job(fmt, PromptThinking.OPEN)
    parts = answer_parts(job, answer, "stop")
    assert parts.reasoning == THOUGHT and parts.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parts.tool_calls] == calls
    assert parts.finish_reason == "tool_calls"
    for pieces in _splits(answer)[:: max(1, len(answer) // 60)] + [list(answer)]:
        stream = AnswerStream(job)
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
        got_content, got_calls = _gather(deltas)
        assert got_content == content
        assert [(n, json.loads(a)) for n, a in got_calls] == calls
        assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC,
                                 DEEPSEEK_V3], ids=lambda f: f.name)
def test_an_answer_cut_anywhere_by_max_tokens_leaks_no_markup(fmt) -> None:
    """``max_tokens`` may end an answer anywhere inside its calls: cut at every position of two
    rendered calls, the content is empty (the start of a call whose name never came is
    dropped, never given out as text), the calls made so far keep their names in order, and
    streamed equals whole."""
    full = fmt.render_calls(CALLS)
    for p in range(len(full) + 1):
        text = full[:p]
        content, calls = parse_tool_calls(text, fmt, functions=FUNCTIONS, cut=True)
        assert content.strip() == "", (text, content)
        assert [c.name for c in calls] == [name for name, _ in CALLS][:len(calls)], text
        stream = ToolCallStream(fmt, FUNCTIONS)
        deltas = stream.feed(text) + stream.finish(cut=True)
        assert _gather(deltas) == (content, [(c.name, c.arguments) for c in calls]), text
