"""DeepSeek-V3's tool calls where their markers are special tokens, as in DeepSeek's tokenizer:
the template picks the format, the answer's text keeps the markers for the parser (full and
streamed), and the call grammar writes each marker as its token (xgrammar ``token`` elements),
refusing a call whose arguments break the schema. The default model's tokenizer with the five
markers added as special tokens stands in for DeepSeek's."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events
from splitserve.server.tools.formats import DEEPSEEK_V3
from splitserve.server.tools.grammar import FunctionSpec, tool_call_constraint

MODEL = "smol-test"
TEMPLATE = ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
            "{% if tools %}{{ tools | tojson }}{% endif %}<｜Assistant｜>"
            "{# calls: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>... #}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
REPLY = "Checking. " + DEEPSEEK_V3.render_calls([("get_weather", '{"city": "Rome"}')])
USER = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def deepseek_style(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.add_special_tokens({"additional_special_tokens": list(DEEPSEEK_V3.markers)})
    return tok


def _client(tokenizer) -> TestClient:
    renderer = ChatRenderer(tokenizer, TEMPLATE)
    assert renderer.tool_format is DEEPSEEK_V3
    assert set(renderer.special_markers) == set(DEEPSEEK_V3.markers)
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=REPLY)
    return TestClient(create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id],
                                 renderer))


def test_call_parsed_full_and_streamed(deepseek_style) -> None:
    client = _client(deepseek_style)
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER]}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in iter_events(r.text.splitlines())
              if isinstance(e, dict) and e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert json.loads(args) == {"city": "Rome"}


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_grammar_writes_the_markers_as_tokens(deepseek_style, mode: str) -> None:
    renderer = ChatRenderer(deepseek_style, TEMPLATE)
    backend = XGrammarBackend(deepseek_style)
    constraint = tool_call_constraint(DEEPSEEK_V3, [FunctionSpec("get_weather", SCHEMA)],
                                      mode, True, special=renderer.special_markers)
    assert '"type": "token"' in constraint.text
    compiled = backend.compile(constraint.kind, constraint.text)
    eos = deepseek_style.eos_token_id

    def accepts(text: str) -> bool:
        matcher = compiled.create_matcher()
        ids = deepseek_style.encode(text, add_special_tokens=False)
        return (all(matcher.accept_token(t) for t in ids) and matcher.can_end()
                and matcher.accept_token(eos))

    good = DEEPSEEK_V3.render_calls([("get_weather", '{"city": "Rome"}')])
    assert accepts(good)
    assert not accepts(DEEPSEEK_V3.render_calls([("get_weather", '{"city": 3}')]))
    assert not accepts(DEEPSEEK_V3.render_calls([("get_wether", '{"city": "Rome"}')]))
    assert accepts("Plain text.") == (mode == "auto")
