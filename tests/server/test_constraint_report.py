"""The partial-constraint header and the violation metric's backend come from what the worker
reports it compiled (``TokenOutput.grammar_backend``), not from the server's own plan: here the
fake worker reports another backend than the plan predicts, and both follow the report."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.ipc.messages import Constraint, SamplingParams
from splitserve.server.constraint_check import partial_header, violating_backend
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.generation import record_grammar
from splitserve.server.job import Job
from splitserve.server.metrics import ServerMetrics
from splitserve.server.routes import create_app
from tests.http_api import CONTEXT_LEN, MODEL

# Planned sound on llguidance (it enforces maximum): the plan predicts no header.
SOUND = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
         "required": ["n"]}
# Planned partial (xgrammar ignores uniqueItems, llguidance refuses it): the plan predicts one.
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def _app(tokenizer, reply: str, report: tuple[str, list[str]] | None):
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    fake.grammar_report = report
    metrics = ServerMetrics()
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id],
                     metrics=metrics)
    return TestClient(app), metrics


def _chat(client: TestClient, schema: dict, stream: bool):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "t", "schema": schema}}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def _violations(metrics: ServerMetrics, backend: str) -> float:
    return metrics.registry.get_sample_value("splitserve_constraint_violations_total",
                                             {"backend": backend})


@pytest.mark.parametrize("stream", [False, True])
def test_header_and_metric_name_the_reported_backend(tokenizer, stream: bool) -> None:
    client, metrics = _app(tokenizer, '{"n": 12}', ("outlines", ["maximum at /properties/n"]))
    r = _chat(client, SOUND, stream)
    assert r.headers["x-splitserve-constraint"] == "partial; ignored=maximum@/properties/n"
    assert _violations(metrics, "outlines") == 1
    assert _violations(metrics, "llguidance") == 0  # the plan's prediction


@pytest.mark.parametrize("stream", [False, True])
def test_a_sound_report_sends_no_partial_header(tokenizer, stream: bool) -> None:
    client, metrics = _app(tokenizer, "[1, 1]", ("llguidance", []))
    r = _chat(client, UNIQUE, stream)
    assert "x-splitserve-constraint" not in r.headers
    assert _violations(metrics, "llguidance") == 1
    assert _violations(metrics, "xgrammar") == 0


def test_without_a_report_the_plan_speaks(tokenizer) -> None:
    client, metrics = _app(tokenizer, "[1, 1]", None)
    r = _chat(client, UNIQUE, False)
    assert r.headers["x-splitserve-constraint"] == "partial; ignored=uniqueItems@/"
    assert _violations(metrics, "xgrammar") == 1
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == [1, 1]


def test_the_decode_workers_report_follows_the_prefill_workers(tokenizer) -> None:
    """Disaggregated, each worker reports its own compile: the label is the later one's (it
    constrains every token but the first), the ignored keywords are both reports'."""
    sampling = SamplingParams(constraint=Constraint("json_schema", json.dumps(UNIQUE)))
    job = Job("r", [1], sampling, [], ResponseFormatter("r", 0, "m", True, False), Usage(1))
    record_grammar(job, "llguidance", [])
    assert partial_header(job) == {} and violating_backend(job) == "llguidance"
    record_grammar(job, "xgrammar", ["uniqueItems at /"])
    assert partial_header(job) == {"x-splitserve-constraint": "partial; ignored=uniqueItems@/"}
    assert violating_backend(job) == "xgrammar"


def _respond(client: TestClient, schema: dict, stream: bool):
    body = {"model": MODEL, "input": "hi", "stream": stream, "store": False,
            "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("stream", [False, True])
def test_responses_carry_the_reported_header(tokenizer, stream: bool) -> None:
    """``/v1/responses`` sends the same header as chat, from the same report."""
    client, metrics = _app(tokenizer, '{"n": 12}', ("outlines", ["maximum at /properties/n"]))
    r = _respond(client, SOUND, stream)
    assert r.headers["x-splitserve-constraint"] == "partial; ignored=maximum@/properties/n"
    assert _violations(metrics, "outlines") == 1
    client, _ = _app(tokenizer, "[1, 2]", ("llguidance", []))
    assert "x-splitserve-constraint" not in _respond(client, UNIQUE, stream).headers
