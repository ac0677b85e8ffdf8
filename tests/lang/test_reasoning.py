"""``gen(..., reasoning=True)`` without a model: the chat request it sends to a real (scripted)
OpenAI-compatible server, the thinking read from ``reasoning_content`` apart from the answer,
the history that carries only the answer, and what is refused."""

from __future__ import annotations

import json

import pytest

from splitserve import lang
from tests.lang.fake_backend import FakeBackend
from tests.lang.fake_openai_server import chat_answer, completion_answer, fake_openai_server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@lang.function
def think_twice(s, question: str, effort: str | None = None):
    s += lang.user(question)
    s += lang.assistant(lang.gen("answer", max_tokens=64, reasoning=True,
                                 reasoning_effort=effort))
    s += lang.user("Now as JSON.")
    s += lang.assistant(lang.gen("place", max_tokens=64, reasoning=True, json_schema=SCHEMA))


def _respond(path: str, body: dict) -> dict:
    if path != "/v1/chat/completions":
        return completion_answer("x")
    if "response_format" in body:
        answer = chat_answer('{"city": "Paris"}')
        answer["choices"][0]["message"]["reasoning_content"] = "JSON, then."
        return answer
    answer = chat_answer("Paris.")
    answer["choices"][0]["message"]["reasoning_content"] = "France's capital is Paris."
    return answer


def test_thinking_apart_from_the_answer() -> None:
    with fake_openai_server(_respond) as server:
        s = think_twice.run("Capital of France?", effort="low",
                            backend=lang.OpenAICompatible(server.url + "/v1", "m"),
                            temperature=0)
        assert s["answer"] == "Paris." and s.reasoning("answer") == "France's capital is Paris."
        assert json.loads(s["place"]) == {"city": "Paris"}
        assert s.reasoning("place") == "JSON, then."
        assert s.meta("answer")["reasoning"] == "France's capital is Paris."
        first, second = server.bodies("/v1/chat/completions")
    assert first["reasoning_effort"] == "low" and "reasoning_effort" not in second
    assert second["response_format"]["json_schema"]["schema"] == SCHEMA
    # The history carries the answer only, as reasoning models' templates keep it.
    assert second["messages"][-2] == {"role": "assistant", "content": "Paris."}
    assert "France's capital" not in json.dumps(second["messages"])


def test_a_server_that_splits_nothing_gives_none() -> None:
    with fake_openai_server(lambda path, body: chat_answer("Paris.")) as server:
        s = think_twice.run("Capital?", backend=lang.OpenAICompatible(server.url + "/v1", "m"))
        assert s["answer"] == "Paris." and s.reasoning("answer") is None


def test_refused_where_it_cannot_work() -> None:
    with pytest.raises(ValueError, match="reasoning_effort needs reasoning=True"):
        lang.gen("x", reasoning_effort="low")

    @lang.function
    def plain(s):
        s += "Q: " + lang.gen("a", reasoning=True)

    with fake_openai_server(_respond) as server, pytest.raises(lang.ProgramError,
                                                                match="role program"):
        plain.run(backend=lang.OpenAICompatible(server.url + "/v1", "m"))
    with pytest.raises(lang.ProgramError, match="reasoning_content"):
        think_twice.run("x", backend=FakeBackend())

    @lang.function
    def named(s):
        s += lang.user("x")
        s += lang.assistant(lang.gen("a", max_tokens=4))
        s.reasoning("a")

    with fake_openai_server(_respond) as server, pytest.raises(
            lang.ProgramError, match="not generated with reasoning=True"):
        named.run(backend=lang.OpenAICompatible(server.url + "/v1", "m"))
