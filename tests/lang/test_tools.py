"""``gen(tools=...)`` without a model: tool specs, the request bodies the backends send to a
real (scripted) HTTP server, calls parsed into the state, and the tool history sent back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from splitserve import lang
from tests.lang.fake_backend import CHATML, FakeBackend
from tests.lang.fake_openai_server import chat_answer, completion_answer, fake_openai_server
from tests.lang.weather_tools import TOOLS, get_weather, weather_agent

CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def scripted(first: dict, answer: str = "It is sunny."):
    """Answers the first chat request with ``first``, later ones with ``answer``."""
    def respond(path: str, body: dict) -> dict:
        if path == "/v1/chat/completions":
            return first if "tools" in body else chat_answer(answer)
        return completion_answer("x")
    return respond


def test_python_function_becomes_a_spec_its_schema_validates_arguments() -> None:
    spec = lang.tool_spec(get_weather)
    fn = spec["function"]
    assert spec["type"] == "function" and fn["name"] == "get_weather"
    assert fn["description"] == "The current weather in a city."
    assert fn["parameters"]["required"] == ["city"]
    assert fn["parameters"]["properties"]["city"]["description"] == "the city's name, e.g. Paris."
    jsonschema.validate({"city": "Paris", "unit": "fahrenheit"}, fn["parameters"])
    for bad in ({}, {"city": "Paris", "unit": "kelvin"}, {"city": 3}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, fn["parameters"])
    as_dict = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert lang.tool_spec(as_dict) is as_dict


def test_bad_tools_and_choices_are_refused() -> None:
    def no_hint(city):
        """x"""

    def star(*cities: str) -> None:
        """x"""

    for tool, match in ((no_hint, "needs a type hint"), (star, r"\*cities"),
                        ({"name": "f"}, "must be"), (3, "not int"),
                        ({"type": "function", "function": {"name": "a b"}}, "must match")):
        with pytest.raises((ValueError, TypeError), match=match):
            lang.gen("x", tools=[tool])
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        lang.gen("x", tools=TOOLS, tool_choice="nope")
    with pytest.raises(ValueError, match="need tools"):
        lang.gen("x", tool_choice="required")
    with pytest.raises(ValueError, match="one constraint"):
        lang.gen("x", tools=TOOLS, regex="a")
    assert lang.gen("x", tools=TOOLS, tool_choice="get_time").tool_choice == {
        "type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("backend_kind", ["openai_compatible", "endpoint"])
def test_agent_loop_request_bodies_state_and_history(backend_kind: str) -> None:
    first = chat_answer("Let me check.", [CALL])
    with fake_openai_server(scripted(first), template=CHATML) as server:
        backend = (lang.OpenAICompatible(server.url + "/v1", "m") if backend_kind ==
                   "openai_compatible" else lang.Endpoint(server.url))
        if backend_kind == "endpoint":  # the probe's answer: it came back with a call
            assert backend.capabilities().tools
        s = weather_agent.run("Weather in Paris?", parallel=False, backend=backend,
                              temperature=0)
        assert s["call"] == "Let me check." and s["answer"] == "It is sunny."
        assert s.tool_calls("call") == [lang.ToolCall("call_7", "get_weather",
                                                      {"city": "Paris"}, '{"city": "Paris"}')]
        assert s.meta("call")["finish_reason"] == "tool_calls"
        if backend_kind == "endpoint":  # text(): the history through the model's template
            assert s.text().endswith("<|im_start|>tool\n" + get_weather("Paris") +
                                     "<|im_end|>\n<|im_start|>assistant\nIt is sunny.<|im_end|>\n")
        streamed = weather_agent.run("Weather in Paris?", parallel=False, backend=backend,
                                     temperature=0, stream=True)
        assert "".join(streamed.text_iter()) == s.text()
        chats = [b for b in server.bodies("/v1/chat/completions") if b["messages"][0]["role"]
                 == "system"]  # leave out the endpoint's capability probe
    unstreamed = [{k: v for k, v in b.items() if k not in ("stream", "stream_options")}
                  for b in chats[2:]]
    assert len(chats) == 4 and unstreamed == chats[:2]  # the streamed run sent the same
    ask, final = chats[:2]
    assert ask["tools"] == [lang.tool_spec(t) for t in TOOLS]
    assert ask["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert ask["parallel_tool_calls"] is False and ask["temperature"] == 0
    assert [m["role"] for m in ask["messages"]] == ["system", "user"]
    # The answer turn: the history as OpenAI clients send it, no tools offered.
    assert final["messages"][2:] == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
        {"role": "tool", "content": get_weather("Paris"), "tool_call_id": "call_7"},
    ]
    assert "tools" not in final and "tool_choice" not in final


def test_call_only_turn_is_sent_with_null_content_and_the_state_keeps_it() -> None:
    with fake_openai_server(scripted(chat_answer(None, [CALL]))) as server:
        s = weather_agent.run("Weather?", backend=lang.OpenAICompatible(server.url + "/v1", "m"))
        final = server.bodies("/v1/chat/completions")[-1]
    assert s["call"] == "" and final["messages"][2] == {
        "role": "assistant", "content": None, "tool_calls": [CALL]}
    assert s.messages()[2]["tool_calls"] == [CALL]
    assert "[call get_weather(" in s.text()


def test_required_call_that_does_not_come_back_is_an_error() -> None:
    with (fake_openai_server(scripted(chat_answer("No."))) as server,
          pytest.raises(lang.ProgramError, match="requires a call.*without tool_calls")):
        weather_agent.run("x", tool_choice="required",
                          backend=lang.OpenAICompatible(server.url + "/v1", "m"))


def test_arguments_that_are_not_json_are_an_error() -> None:
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    with (fake_openai_server(scripted(chat_answer(None, [bad]))) as server,
          pytest.raises(lang.ProgramError, match="arguments are not a JSON object")):
        weather_agent.run("x", backend=lang.OpenAICompatible(server.url + "/v1", "m"))


def test_endpoint_on_a_server_that_drops_tools_refuses() -> None:
    # A server from before tool calling: 200 and prose, tools ignored.
    with fake_openai_server(scripted(chat_answer("Prose."))) as server:
        with pytest.raises(lang.ProgramError, match=r"step \d+ \(gen 'call'\).*does not return "
                                                    "tool calls"):
            weather_agent.run("x", tool_choice="auto", backend=lang.Endpoint(server.url))
        assert not any("tools" in b and b["messages"][0]["role"] == "system"
                       for b in server.bodies("/v1/chat/completions"))


def test_backends_without_a_chat_endpoint_and_text_programs_refuse_tools() -> None:
    with pytest.raises(lang.ProgramError, match="FakeBackend has no tool calling"):
        weather_agent.run("x", backend=FakeBackend(template=True))
    plain = lang.function(lambda s: s.__iadd__("Q:" + lang.gen("a", tools=TOOLS)))
    with pytest.raises(lang.ProgramError, match="needs a role program"):
        plain.run(backend=FakeBackend())
    inside = lang.function(lambda s: s.__iadd__(lang.assistant("Sure: " + lang.gen(
        "a", tools=TOOLS))))
    with pytest.raises(lang.ProgramError, match="must come first in an assistant message"):
        inside.run(backend=FakeBackend(template=True))


def test_trace_stops_at_the_tool_calls() -> None:
    tr = weather_agent.trace("x")
    assert not tr.complete and "tool_calls" in tr.stopped_at
    assert [type(n).__name__ for n in tr.nodes][-3:] == ["RoleBegin", "Gen", "RoleEnd"]
    assert tr.nodes[-2].tools == [lang.tool_spec(t) for t in TOOLS]


def test_tool_results_that_are_not_text_are_sent_as_json() -> None:
    seq = lang.tool({"temp": 18, "sky": "clear"}, "call_1")
    assert seq.nodes[0].tool_call_id == "call_1"
    assert json.loads(seq.nodes[1].text) == {"temp": 18, "sky": "clear"}
    with pytest.raises(TypeError, match="answers a ToolCall"):
        lang.tool("x", 5)


def test_fork_branches_keep_the_tool_history() -> None:
    @lang.function
    def two_answers(s):
        s += lang.user("Weather in Paris?")
        s += lang.assistant(lang.gen("call", tools=TOOLS, tool_choice="required"))
        for call in s.tool_calls("call"):
            s += lang.tool(call.invoke(TOOLS), call)
        forks = s.fork(2)
        forks += lang.assistant(lang.gen("answer", max_tokens=8))
        return forks.join()

    with fake_openai_server(scripted(chat_answer(None, [CALL]))) as server:
        s = two_answers.run(backend=lang.OpenAICompatible(server.url + "/v1", "m"))
        branches = s.return_value
        bodies = server.bodies("/v1/chat/completions")
    assert [b["answer"] for b in branches] == ["It is sunny."] * 2
    assert all(b.tool_calls("call")[0].id == "call_7" for b in branches)
    # The warm-up and both branches sent the same history, call and tool turn included.
    histories = [b["messages"] for b in bodies[1:]]
    assert len(histories) == 3 and all(h == histories[0] for h in histories)
    assert [m["role"] for m in histories[0]] == ["user", "assistant", "tool"]


def test_a_name_generated_again_in_a_loop_reads_the_new_value() -> None:
    import time

    def slow(text: str) -> str:
        time.sleep(0.05)  # the read below comes before the step finishes
        return f"<{len(text)}>"

    @lang.function
    def loop(s):
        seen = []
        for _ in range(3):
            s += " step" + lang.gen("x", max_tokens=2)
            seen.append(s["x"])
        return seen

    s = loop.run(backend=FakeBackend(reply=slow))
    assert s.return_value == ["<5>", "<13>", "<22>"]  # prompt lengths 5, 13, 22


def test_agent_loop_stops_when_the_model_answers_in_text() -> None:
    @lang.function
    def agent(s):
        s += lang.user("Weather in Paris?")
        for _ in range(3):
            s += lang.assistant(lang.gen("reply", tools=TOOLS))
            calls = s.tool_calls("reply")
            if not calls:
                break
            for call in calls:
                s += lang.tool(call.invoke(TOOLS), call)

    with fake_openai_server(scripted(chat_answer(None, [CALL]))) as server:
        # The scripted server calls while the request has no tool turn yet, then answers.
        server.respond = lambda path, body: (
            chat_answer("Sunny.") if any(m["role"] == "tool" for m in body["messages"])
            else chat_answer(None, [CALL]))
        s = agent.run(backend=lang.OpenAICompatible(server.url + "/v1", "m"))
    assert [m["role"] for m in s.messages()] == ["user", "assistant", "tool", "assistant"]
    assert s["reply"] == "Sunny." and s.tool_calls("reply") == []
