"""``gen(tools=...)`` in a full agent loop against a launched cluster (default model): the call
is grammar-enforced (named / required choice), so its arguments validate against the schema,
the tool turn is accepted and the loop reaches a final answer."""

from __future__ import annotations

import jsonschema
import pytest

from splitserve import lang
from tests.lang.conftest import require
from tests.lang.weather_tools import TOOLS, weather_agent

pytestmark = pytest.mark.slow

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in map(lang.tool_spec, TOOLS)}


@pytest.fixture
def needs_tools(endpoint) -> None:
    require(endpoint, "tools", "a chat request naming a function returned no tool_calls")


def _check_loop(s: lang.ProgramState) -> list[lang.ToolCall]:
    calls = s.tool_calls("call")
    assert calls and s.meta("call")["finish_reason"] == "tool_calls"
    for call in calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant",
                                         *["tool"] * len(calls), "assistant"]
    assert msgs[2]["tool_calls"] == [c.as_openai() for c in calls]
    assert [m["tool_call_id"] for m in msgs[3:-1]] == [c.id for c in calls]
    assert msgs[-1]["content"] == s["answer"] and "tool_calls" not in msgs[-1]
    assert s.meta("answer")["finish_reason"] in ("stop", "length")
    return calls


def test_named_tool_choice_full_loop(endpoint, needs_tools) -> None:
    s = weather_agent.run("What is the weather in Paris?", backend=endpoint, temperature=0)
    calls = _check_loop(s)
    assert {c.name for c in calls} == {"get_weather"}
    assert s["answer"].strip()


def test_required_choice_without_parallel_calls_once(endpoint, needs_tools) -> None:
    s = weather_agent.run("What time is it in Rome?", tool_choice="required", parallel=False,
                          backend=endpoint, temperature=0)
    assert len(_check_loop(s)) == 1
