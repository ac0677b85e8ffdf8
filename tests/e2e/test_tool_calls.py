"""Tool calling with the ``openai`` client against the launched disaggregated cluster on the
default model (SmolLM2, whose template ignores tools: the built-in tool prompt): required, named
and auto choices, parallel calls off, a streamed call reassembled from its deltas, the tool-result
turn; every returned call's arguments validate against its function's ``parameters``. The call
grammar's first token is sampled on the prefill worker and the rest on the decode worker, so a
required call that validates here was enforced on both."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.test_openai_api import wait_for_no_pages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
MAX_TOKENS = 64
MARKUP = ("<tool_call", "</tool_call", '"name"', '"arguments"')


@pytest.fixture(scope="module")
def client(disagg_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=disagg_cluster.config.url + "/v1", api_key="none",
                         max_retries=0, timeout=300)


def _create(client: openai.OpenAI, **kw: Any):
    body = {"model": "default", "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS,
            "temperature": 0, **kw}
    return client.chat.completions.create(**body)


def _validated(choice) -> list[tuple[str, dict]]:
    """The choice's calls as (name, arguments), each validated against its function; at
    ``finish_reason: length`` the last call may be cut off (its arguments truncated, as OpenAI's
    are), so the complete ones before it are checked."""
    calls = choice.message.tool_calls or []
    if choice.finish_reason == "length":
        calls = calls[:-1]
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


@pytest.fixture(scope="module")
def answers(client) -> dict[str, Any]:
    """The non-streaming requests, sent together (one batch on the workers)."""
    requests = {
        "required": {"tool_choice": "required"},
        "named": {"tool_choice": {"type": "function", "function": {"name": "add"}},
                  "messages": [{"role": "user", "content": "What is 17 plus 25?"}]},
        "auto": {"tool_choice": "auto"},
        "default": {},  # tools without tool_choice: auto
        "single": {"tool_choice": "required", "parallel_tool_calls": False},
        "none": {"tool_choice": "none", "max_tokens": 8},
    }
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {k: pool.submit(_create, client, **kw) for k, kw in requests.items()}
        return {k: f.result() for k, f in futures.items()}


def test_required_calls_validate(answers) -> None:
    choice = answers["required"].choices[0]
    # SmolLM2 tends to repeat its call until max_tokens: a cut-off last call is allowed.
    calls = _validated(choice)
    assert calls and choice.finish_reason in ("tool_calls", "length")
    assert {name for name, _ in calls} <= set(PARAMETERS)
    assert choice.message.content is None  # calls only


def test_named_choice_calls_that_function(answers) -> None:
    choice = answers["named"].choices[0]
    calls = _validated(choice)
    assert [name for name, _ in calls] == ["add"]  # exactly one call, of the named function
    assert choice.finish_reason == "tool_calls"


def test_parallel_off_gives_one_call(answers) -> None:
    choice = answers["single"].choices[0]
    assert len(_validated(choice)) == 1 and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("key", ["auto", "default"])
def test_auto_is_text_or_valid_calls(answers, key: str) -> None:
    choice = answers[key].choices[0]
    calls = _validated(choice)
    if calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
        assert not any(m in choice.message.content for m in MARKUP)


def test_none_answers_in_text_without_the_tools(answers) -> None:
    choice = answers["none"].choices[0]
    assert not choice.message.tool_calls and choice.message.content
    # "none" leaves the tools out of the prompt: shorter than the same request with tools.
    assert answers["none"].usage.prompt_tokens < answers["auto"].usage.prompt_tokens


def test_streamed_call_reassembles_to_the_full_answer(client, answers) -> None:
    stream = _create(client, tool_choice="required", stream=True,
                     stream_options={"include_usage": True})
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert not any(m in (delta.content or "") for m in MARKUP)
        for call in delta.tool_calls or []:
            if call.id is not None:  # the call's first delta: id, type, name
                assert call.index == len(calls) and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    full = answers["required"].choices[0].message
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.tool_calls]  # greedy: the same
    assert finish == answers["required"].choices[0].finish_reason
    assert usage.completion_tokens == answers["required"].usage.completion_tokens


def test_tool_result_turn_is_accepted(client, answers) -> None:
    first = answers["single"].choices[0].message  # one complete call
    history = [*ASK, first.model_dump(exclude_none=True)]  # content omitted (null), tool_calls
    assert history[-1].get("content") is None and history[-1]["tool_calls"]
    for call in first.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id,
                        "content": json.dumps({"temperature": 21, "sky": "clear"})})
    explicit_null = {**history[1], "content": None}
    for messages in (history, [history[0], explicit_null, *history[2:]]):
        reply = _create(client, messages=messages, tool_choice="none", max_tokens=12)
        assert reply.choices[0].message.content
    # The next turn may call again (auto): those calls validate too.
    _validated(_create(client, messages=history).choices[0])


def test_bad_tool_request_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"


def test_colocated_gives_the_same_call(answers, colocated_cluster) -> None:
    colocated = openai.OpenAI(base_url=colocated_cluster.config.url + "/v1", api_key="none",
                              max_retries=0, timeout=300)
    got = _create(colocated, tool_choice="required").choices[0].message
    want = answers["required"].choices[0].message
    assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [
        (c.function.name, c.function.arguments) for c in want.tool_calls]


def test_no_pages_held_afterwards(disagg_cluster, answers) -> None:
    wait_for_no_pages(disagg_cluster)
