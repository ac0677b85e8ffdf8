"""``priority`` reaches the engine's SamplingParams on both endpoints (0 when absent), and the
fields whose size the client picks are bounded: a value past a bound is a 400 in OpenAI's error
shape naming the field, on chat and completions alike."""

from __future__ import annotations

import pytest

from splitserve.server.protocol import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)
from tests.http_api import CH, MODEL, USER, C


def _base(path: str) -> dict:
    return {"model": MODEL, "max_tokens": 2,
            **({"messages": USER} if path == CH else {"prompt": "hi"})}


@pytest.mark.parametrize("path", [C, CH])
def test_priority_reaches_the_engine(client, fake, path) -> None:
    assert client.post(path, json={**_base(path), "priority": -3}).status_code == 200
    assert fake.requests[-1][2].priority == -3
    assert client.post(path, json=_base(path)).status_code == 200
    assert fake.requests[-1][2].priority == 0  # absent: vLLM's default


@pytest.mark.parametrize("path", [C, CH])
@pytest.mark.parametrize("value", ["1", 1.5, True, 2**31, -(2**31) - 1])
def test_bad_priority_is_a_400_naming_it(client, path, value) -> None:
    r = client.post(path, json={**_base(path), "priority": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("path", [C, CH])
def test_logit_bias_at_most_300_entries(client, fake, path) -> None:
    ok = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS)}
    assert client.post(path, json={**_base(path), "logit_bias": ok}).status_code == 200
    assert len(fake.requests[-1][2].logit_bias) == MAX_LOGIT_BIAS
    over = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS + 1)}
    r = client.post(path, json={**_base(path), "logit_bias": over})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and "at most 300" in err["message"], err


@pytest.mark.parametrize("path", [C, CH])
@pytest.mark.parametrize("field,value", [
    ("stop", ["x" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("choice", ["a"] * (MAX_CHOICES + 1)),
    ("choice", ["a" * (MAX_CHOICE_CHARS + 1)]),
])
def test_sized_fields_are_bounded(client, path, field, value) -> None:
    r = client.post(path, json={**_base(path), field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0].split("[")[0] == field, r.json()


def test_tools_at_most_128(client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post(CH, json={**_base(CH), "tools": [tool] * (MAX_TOOLS + 1)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
