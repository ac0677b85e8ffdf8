"""The agent client libraries, unmodified, against the launched disaggregated cluster on the
default model: LangChain (``bind_tools``, ``with_structured_output`` by json_schema and by
function calling), instructor (``Mode.TOOLS``, ``Mode.JSON_SCHEMA``), the openai-agents SDK
(``OpenAIChatCompletionsModel`` with a ``function_tool``; its default model,
``OpenAIResponsesModel`` over ``/v1/responses``, with a ``function_tool`` and with an
``output_type``) and pydantic-ai (a structured ``output_type``). Each asserts the protocol: the
function was called with arguments that validate against its schema, and the next turn (the
tool result sent back) was accepted.

The default model is tiny (135M): what it writes inside the arguments is its own; that the
arguments are well-formed and follow the schema is the server's doing (the call grammar).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MAX_TOKENS = 48


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(description="the city name")
    celsius: int = Field(description="temperature in degrees Celsius")


WEATHER_SCHEMA = Weather.model_json_schema()
PROMPT = "It is 21 degrees Celsius in Paris today. Extract the weather."


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return json.dumps({"city": city, "celsius": 21})


GET_WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}


@pytest.fixture(scope="module")
def base_url(disagg_cluster) -> str:
    return disagg_cluster.config.url + "/v1"


def _check_weather(obj: Weather) -> None:
    assert isinstance(obj, Weather)
    jsonschema.validate(obj.model_dump(), WEATHER_SCHEMA)


# ---- LangChain -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=base_url, api_key="none", model="default",
                                       temperature=0, max_tokens=MAX_TOKENS, max_retries=0,
                                       timeout=300)


def test_langchain_bind_tools_and_tool_result_turn(chat_model) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather_tool = tool(get_weather)
    bound = chat_model.bind_tools([weather_tool], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    ai = bound.invoke([question])
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and not ai.invalid_tool_calls
    jsonschema.validate(ai.tool_calls[0]["args"], GET_WEATHER_SCHEMA)
    result = ToolMessage(weather_tool.invoke(ai.tool_calls[0]["args"]),
                         tool_call_id=ai.tool_calls[0]["id"])
    follow_up = chat_model.bind_tools([weather_tool]).invoke([question, ai, result])
    assert follow_up.content or follow_up.tool_calls  # the next turn was accepted


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method: str) -> None:
    structured = chat_model.with_structured_output(Weather, method=method, include_raw=True)
    out = structured.invoke(PROMPT)
    assert out["parsing_error"] is None
    _check_weather(out["parsed"])
    if method == "function_calling":
        assert out["raw"].tool_calls[0]["name"] == "Weather"


# ---- instructor ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base_url, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300),
        mode=getattr(instructor.Mode, mode))
    weather, completion = client.chat.completions.create_with_completion(
        model="default", response_model=Weather, max_retries=0, temperature=0,
        max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}])
    _check_weather(weather)
    message = completion.choices[0].message
    if mode == "TOOLS":
        (call,) = message.tool_calls
        assert call.function.name == "Weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    else:
        jsonschema.validate(json.loads(message.content), WEATHER_SCHEMA)


# ---- openai-agents ---------------------------------------------------------------------------


def test_openai_agents_function_tool(base_url) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[dict] = []

    @agents.function_tool
    def lookup_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city})
        return get_weather(city)

    model = agents.OpenAIChatCompletionsModel(
        model="default",
        openai_client=openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                         timeout=300))
    # tool_choice required for the first turn; the SDK resets it to auto once the tool ran
    # (reset_tool_choice), so the second turn answers with the tool's result in its history.
    agent = agents.Agent(
        name="weather", instructions="Answer questions about the weather.", model=model,
        tools=[lookup_weather],
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=MAX_TOKENS, parallel_tool_calls=False),
        tool_use_behavior="run_llm_again")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls, "the function tool was never called"
    for args in calls:
        jsonschema.validate(args, lookup_weather.params_json_schema)
    items = [type(i).__name__ for i in result.new_items]
    assert "ToolCallItem" in items and "ToolCallOutputItem" in items
    assert len(result.raw_responses) >= 2  # the turn after the tool output was answered


def _responses_run_config(base_url: str):
    """A run config whose model provider is the SDK's default one (``OpenAIProvider``: the
    Responses API) over the cluster."""
    agents = pytest.importorskip("agents")
    provider = agents.OpenAIProvider(openai_client=openai.AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=300))
    assert isinstance(provider.get_model("default"), agents.OpenAIResponsesModel)
    return agents.RunConfig(model_provider=provider, tracing_disabled=True)


def test_openai_agents_default_model_function_tool(base_url) -> None:
    agents = pytest.importorskip("agents")
    calls: list[dict] = []

    @agents.function_tool
    def lookup_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city})
        return get_weather(city)

    agent = agents.Agent(
        name="weather", instructions="Answer questions about the weather.", model="default",
        tools=[lookup_weather],
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=MAX_TOKENS, parallel_tool_calls=False),
        tool_use_behavior="run_llm_again")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                           run_config=_responses_run_config(base_url)))
    assert calls, "the function tool was never called"
    for args in calls:
        jsonschema.validate(args, lookup_weather.params_json_schema)
    items = [type(i).__name__ for i in result.new_items]
    assert "ToolCallItem" in items and "ToolCallOutputItem" in items
    assert len(result.raw_responses) >= 2  # the turn after the tool output was answered
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)


def test_openai_agents_default_model_output_type(base_url) -> None:
    agents = pytest.importorskip("agents")
    agent = agents.Agent(name="extract", instructions="Extract the weather.", model="default",
                         output_type=Weather,
                         model_settings=agents.ModelSettings(temperature=0,
                                                             max_tokens=MAX_TOKENS))
    result = asyncio.run(agents.Runner.run(agent, PROMPT,
                                           run_config=_responses_run_config(base_url)))
    _check_weather(result.final_output)


# ---- pydantic-ai -----------------------------------------------------------------------------


def test_pydantic_ai_structured_output(base_url) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import RetryPromptPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=base_url,
                                                               api_key="none"))
    agent = Agent(model, output_type=Weather,
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    result = agent.run_sync(PROMPT)
    _check_weather(result.output)
    # The output came as a call of pydantic-ai's output tool, its arguments valid, with no
    # retry. (SmolLM2 repeats the call until max_tokens, parallel calls being allowed; the
    # last, cut-off one is not the one pydantic-ai used: the first is.)
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert calls and not any(isinstance(p, RetryPromptPart)
                             for m in result.all_messages() for p in m.parts)
    jsonschema.validate(calls[0].args_as_dict(), WEATHER_SCHEMA)
    assert Weather(**calls[0].args_as_dict()) == result.output
    # The call and its tool return go back as the next turn's history.
    follow_up = agent.run_sync("And in degrees Fahrenheit?",
                               message_history=result.all_messages())
    _check_weather(follow_up.output)


def test_pydantic_ai_native_output_sends_and_gets_its_description_used(base_url) -> None:
    # NativeOutput asks for response_format json_schema with the model's docstring as
    # json_schema.description: shown to the model here (server.format_prompt), not refused.
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=300)
    model = OpenAIChatModel("default", provider=OpenAIProvider(
        base_url=base_url, api_key="none", http_client=http))
    agent = Agent(model, output_type=NativeOutput(Weather),
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    result = agent.run_sync(PROMPT)
    _check_weather(result.output)
    assert sent[0]["response_format"]["json_schema"]["description"] == Weather.__doc__
