"""``lang.AnthropicCompatible`` against our own server's ``/v1/messages`` (the launched cluster of
``tests/lang/conftest.py``, default model, float32): role programs run unchanged, greedy answers
equal the OpenAI-compatible backend's (both reach the same chat path), a gen continues text
inside an assistant message (prefill) as the splitserve backend continues it, constraints that
Messages carries are enforced, the tool loop runs, and what Messages cannot carry fails by
name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from splitserve import lang
from tests.lang.weather_tools import TOOLS, weather_agent

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def messages_backend(lang_cluster) -> lang.AnthropicCompatible:
    return lang.AnthropicCompatible(lang_cluster.config.url)


@lang.function
def qa(s, question: str):
    s += lang.system("Answer in one short sentence.")
    s += lang.user(question)
    s += lang.assistant(lang.gen("answer", max_tokens=16))
    s += lang.user("Say it again, shorter.")
    s += lang.assistant(lang.gen("again", max_tokens=8))


def test_role_program_equals_the_openai_compatible_backend(messages_backend, lang_cluster) -> None:
    openai_backend = lang.OpenAICompatible(lang_cluster.config.url + "/v1", "default")
    a = qa.run("What is the capital of France?", backend=messages_backend, temperature=0)
    b = qa.run("What is the capital of France?", backend=openai_backend, temperature=0)
    assert a["answer"] and (a["answer"], a["again"]) == (b["answer"], b["again"])
    assert a.messages() == b.messages()
    meta = a.meta("answer")
    assert meta["finish_reason"] in ("stop", "length") and meta["prompt_tokens"] > 0


def test_streamed_gen_yields_the_same_text(messages_backend) -> None:
    s = qa.run("What is the capital of France?", backend=messages_backend, temperature=0,
               stream=True)
    deltas = list(s.text_iter("answer"))
    full = qa.run("What is the capital of France?", backend=messages_backend, temperature=0)
    assert "".join(deltas) == full["answer"] and len(deltas) > 1


@lang.function
def prefilled(s):
    s += lang.user("Name a colour.")
    s += lang.assistant("My favourite colour is" + lang.gen("colour", max_tokens=6))


def test_gen_continues_an_assistant_message(messages_backend, endpoint) -> None:
    a = prefilled.run(backend=messages_backend, temperature=0)
    b = prefilled.run(backend=endpoint, temperature=0)  # template rendered client-side
    assert a["colour"] == b["colour"]
    assert a.messages()[-1]["content"] == "My favourite colour is" + a["colour"]


@lang.function
def constrained(s):
    s += lang.user("Where is the Eiffel Tower?")
    s += lang.assistant(lang.gen("place", json_schema=SCHEMA, max_tokens=40))
    s += lang.user("Is it in Europe?")
    s += lang.assistant(lang.gen("yes_no", choices=["yes", "no"], max_tokens=4))


def test_json_schema_and_choices_are_enforced(messages_backend) -> None:
    s = constrained.run(backend=messages_backend, temperature=0)
    jsonschema.validate(json.loads(s["place"]), SCHEMA)
    assert s["yes_no"] in ("yes", "no")
    assert s.messages()[-1]["content"] == s["yes_no"]


@pytest.mark.parametrize(("step", "words"), [
    (lang.gen("n", regex="[0-9]+", max_tokens=4), "cannot enforce a regex constraint"),
    (lang.gen("n", dtype=int, max_tokens=4), "cannot enforce a regex constraint"),
    (lang.select("c", ["yes", "no"]), "logprobs"),
])
def test_what_messages_cannot_carry_fails_by_name(messages_backend, step, words) -> None:
    @lang.function
    def program(s):
        s += lang.user("Pick.")
        s += lang.assistant(step)

    with pytest.raises(lang.ProgramError, match=words) as info:
        program.run(backend=messages_backend)
    assert isinstance(info.value.__cause__, lang.BackendError)
    assert info.value.__cause__.unsupported


def test_tool_loop(messages_backend) -> None:
    s = weather_agent.run("What is the weather in Paris?", backend=messages_backend,
                          temperature=0)
    calls = s.tool_calls("call")
    assert calls and {c.name for c in calls} == {"get_weather"}
    schemas = {t["function"]["name"]: t["function"]["parameters"]
               for t in map(lang.tool_spec, TOOLS)}
    for call in calls:
        jsonschema.validate(call.arguments, schemas[call.name])
    assert s.meta("call")["finish_reason"] == "tool_calls"
    roles = [m["role"] for m in s.messages()]
    assert roles == ["system", "user", "assistant", *["tool"] * len(calls), "assistant"]
    assert s["answer"].strip()
