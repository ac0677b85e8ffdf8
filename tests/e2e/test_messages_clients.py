"""Anthropic's Messages API with the real clients, unmodified, against launched clusters on the
default model (float32): the ``anthropic`` client (``messages.create``, ``messages.stream``, a
tool loop, ``tool_choice`` any and named, ``count_tokens``) on a disaggregated and a colocated
cluster, each answer equal to the chat path's for the same conversation (one generation path)
and the two deployments equal to each other; LangChain's ``ChatAnthropic.bind_tools`` and
pydantic-ai's Anthropic model on the disaggregated one. Each asserts the protocol: calls whose
input validates against the tool's schema, and the next turn (the tool result) accepted.

The default model is tiny (135M): what it writes is its own; that tool input is well-formed and
follows the schema is the server's doing (the call grammar). The anthropic client's request
types no longer carry ``temperature``: greedy requests send it as an extra body field.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import worker_pages_used

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
TIME_TOOL = {"name": "get_time", "description": "The time in a time zone.",
             "input_schema": {"type": "object", "properties": {
                 "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]},
                 "hours24": {"type": "boolean"}}, "required": ["zone", "hours24"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.config.url, api_key="none", max_retries=0,
                               timeout=300)


def _chat_content(cluster, messages: list[dict], max_tokens: int) -> dict:
    r = httpx.post(cluster.config.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.fixture(scope="module")
def answers() -> dict[str, str]:
    """Each deployment's greedy answer to one request, to compare the two."""
    return {}


def test_create_equals_the_chat_path(cluster, answers) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    m = _client(cluster).messages.create(model="default", max_tokens=24, messages=messages,
                                         system="Answer briefly.", extra_body=GREEDY)
    chat = _chat_content(cluster, [{"role": "system", "content": "Answer briefly."},
                                   *messages], 24)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert _text(m) == chat["choices"][0]["message"]["content"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    prompt_tokens = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt_tokens == chat["usage"]["prompt_tokens"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat["choices"][0]["finish_reason"]]
    count = _client(cluster).messages.count_tokens(model="default", messages=messages,
                                                   system="Answer briefly.")
    assert count.input_tokens == prompt_tokens
    answers[cluster.config.url] = _text(m)
    if len(answers) == 2:  # disaggregated == colocated
        assert len(set(answers.values())) == 1, answers


def test_stream_events_in_order_and_text_reassembled(cluster) -> None:
    messages = [{"role": "user", "content": "Count from one to ten."}]
    with _client(cluster).messages.stream(model="default", max_tokens=20, messages=messages,
                                          extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    full = _client(cluster).messages.create(model="default", max_tokens=20, messages=messages,
                                            extra_body=GREEDY)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in full.content]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens == 20


def test_tool_loop(cluster) -> None:
    client = _client(cluster)
    first = client.messages.create(model="default", max_tokens=48, messages=QUESTION,
                                   tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                   extra_body=GREEDY)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls and first.stop_reason in ("tool_use", "max_tokens")
    for call in calls:
        if first.stop_reason == "tool_use" or call is not calls[-1]:
            assert call.name == "get_weather" and call.id.startswith("toolu_")
            jsonschema.validate(call.input, WEATHER_TOOL["input_schema"])
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": '{"celsius": 21}'}
               for c in calls]
    history = [*QUESTION, {"role": "assistant", "content": first.content},
               {"role": "user", "content": results}]
    second = client.messages.create(model="default", max_tokens=24, messages=history,
                                    tools=[WEATHER_TOOL], extra_body=GREEDY)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time"}])
def test_tool_choice_any_and_named_give_valid_input(cluster, choice) -> None:
    m = _client(cluster).messages.create(
        model="default", max_tokens=48, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}], extra_body=GREEDY)
    (call,) = m.content
    assert m.stop_reason == "tool_use" and call.type == "tool_use"
    if choice["type"] == "tool":
        assert call.name == "get_time"
    schema = {t["name"]: t["input_schema"] for t in (WEATHER_TOOL, TIME_TOOL)}[call.name]
    jsonschema.validate(call.input, schema)


def _finished(cluster) -> float:
    metrics = httpx.get(cluster.config.url + "/metrics", timeout=10).text
    (line,) = [line for line in metrics.splitlines()
               if line.startswith('splitserve_requests_total{outcome="finished"}')]
    return float(line.split()[-1])


def test_counted_in_metrics_and_nothing_held(cluster) -> None:
    """Runs after the others on each cluster: a Messages request is counted as a chat request
    is, and every request freed its pages."""
    before = _finished(cluster)
    _client(cluster).messages.create(model="default", max_tokens=2, messages=QUESTION)
    assert _finished(cluster) == before + 1
    rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
    assert not any(r["in_flight"] for r in rows), rows
    assert not any(worker_pages_used(cluster).values())


# ---- LangChain and pydantic-ai (disaggregated) ------------------------------------------------


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(description="the city name")
    celsius: int = Field(description="temperature in degrees Celsius")


def test_langchain_chat_anthropic_bind_tools(disagg_cluster) -> None:
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"city": city, "celsius": 21})

    model = langchain_anthropic.ChatAnthropic(
        model="default", base_url=disagg_cluster.config.url, api_key="none", temperature=0,
        max_tokens=48, max_retries=0, timeout=300)
    question = HumanMessage("What is the weather in Paris?")
    ai = model.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and not ai.invalid_tool_calls
    jsonschema.validate(ai.tool_calls[0]["args"], WEATHER_TOOL["input_schema"])
    result = ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                         tool_call_id=ai.tool_calls[0]["id"])
    follow_up = model.bind_tools([get_weather]).invoke([question, ai, result])
    assert follow_up.content or follow_up.tool_calls  # the tool result turn was accepted


def test_pydantic_ai_anthropic_model(disagg_cluster) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.settings import ModelSettings

    model = AnthropicModel("default", provider=AnthropicProvider(
        base_url=disagg_cluster.config.url, api_key="none"))
    settings = ModelSettings(temperature=0, max_tokens=48)
    structured = Agent(model, output_type=Weather, model_settings=settings)
    result = structured.run_sync("It is 21 degrees Celsius in Paris today. Extract the weather.")
    assert isinstance(result.output, Weather)
    jsonschema.validate(result.output.model_dump(), Weather.model_json_schema())
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert calls and Weather(**calls[0].args_as_dict()) == result.output

    seen: list[str] = []
    agent = Agent(model, model_settings=settings)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "21 degrees Celsius"

    # The history of the structured run (its output tool call and return) goes back too.
    follow_up = agent.run_sync("Now call get_weather for Paris.",
                               message_history=result.all_messages())
    assert isinstance(follow_up.output, str)
