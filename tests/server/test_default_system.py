"""A system message we add (the built-in tool prompt, a ``response_format`` description) keeps
the chat template's default system prompt in front of it (``ChatRenderer.default_system``):
SmolLM2's template writes "You are a helpful AI assistant named SmolLM, ..." only when the
conversation has no system message of its own."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app

SMOL_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CITY = {"type": "json_schema", "json_schema": {
    "name": "City", "description": "A city and its country.",
    "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}}
# Mistral-style: the system text goes into the first user turn, and nothing without one.
MISTRAL_LIKE = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {% if loop.index0 == 1 "
                "and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
                "{{ m.content }} [/INST]{% endif %}{% endfor %}")
NO_SYSTEM_ROLE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception("
                  "'no system role') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def test_default_system_prompt_is_found(tokenizer) -> None:
    assert ChatRenderer(tokenizer).default_system == SMOL_DEFAULT
    assert ChatRenderer(tokenizer, template=MISTRAL_LIKE).default_system == ""
    assert ChatRenderer(tokenizer, template=NO_SYSTEM_ROLE).default_system == ""


def _prompt(tokenizer, **body) -> str:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply="{}")
    renderer = ChatRenderer(tokenizer)
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id], renderer)
    r = TestClient(app).post("/v1/chat/completions", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return tokenizer.decode(fake.requests[-1][1])


@pytest.mark.parametrize("extra", [{"tools": [WEATHER]}, {"response_format": CITY}])
def test_added_system_text_keeps_the_default_in_front(tokenizer, extra) -> None:
    prompt = _prompt(tokenizer, messages=USER, **extra)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith(f"<|im_start|>system\n{SMOL_DEFAULT}\n\n"), system
    for key, text in (("tools", "get_weather"), ("response_format", "A city and its country.")):
        assert (text in system) == (key in extra), (key, system)
    assert prompt.count("<|im_start|>system") == 1


def test_the_clients_own_system_message_replaces_the_default(tokenizer) -> None:
    own = [{"role": "system", "content": "Be terse."}, *USER]
    for extra in ({"tools": [WEATHER]}, {"response_format": CITY}):
        system = _prompt(tokenizer, messages=own, **extra).split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\nBe terse.\n\n"), system
        assert SMOL_DEFAULT not in system


def test_an_empty_client_system_message_gets_the_tool_prompt_alone(tokenizer) -> None:
    empty = [{"role": "system", "content": ""}, *USER]
    system = _prompt(tokenizer, messages=empty, tools=[WEATHER]).split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# "), system  # no stray blank lines
    assert SMOL_DEFAULT not in system
