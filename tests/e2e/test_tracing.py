"""Traces, the timing breakdown and the dashboard against a launched disaggregated cluster (2
prefill + 1 decode workers, tracing on) exporting to an OTLP/HTTP receiver in this test
(``tests.otlp_receiver``, decoding with ``opentelemetry-proto``).

One request is one trace across the three processes, its spans in the right parent/child
order; a request re-run after losing its prefill worker shows its ``retry`` span; an aborted
request's trace ends on every process; the timing breakdown's stages add up to the end-to-end
time the client measured (within 5%); every query of the Grafana dashboard names a metric that
``/metrics`` exposes. The re-run test SIGSTOPs a worker: it runs last.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.otlp_receiver import OTLPReceiver, Span

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEAD_AFTER_S = 2.0
ROOT_SPAN = "POST /v1/chat/completions"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(model_path: Path, receiver: OTLPReceiver) -> Iterator[Cluster]:
    config = serve_config(model_path, num_prefill=2, num_decode=1, kv_cache_mb=128,
                          threads_per_worker=1, dead_after_s=DEAD_AFTER_S,
                          otlp_traces_endpoint=receiver.endpoint)
    with Cluster(config) as c:
        yield c


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _chat(cluster: Cluster, content: str, max_tokens: int = 8, headers=None, **kw) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(cluster.config.url + "/v1/chat/completions", json=body, headers=headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r


def _by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _complete(names: set[str]):
    """A predicate: the spans of a trace include every name of ``names`` (as sets go)."""
    return lambda trace_id: lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}


def _within(child: Span, parent: Span, slack_ns: int = 2_000_000) -> bool:
    return parent.start_ns - slack_ns <= child.start_ns and child.end_ns <= parent.end_ns + slack_ns


def test_one_request_is_one_trace_across_the_three_processes(cluster, receiver) -> None:
    header, trace_id, caller_span = _traceparent()
    r = _chat(cluster, "Name a color.", headers={"traceparent": header})
    assert r.headers["x-trace-id"] == trace_id  # the caller's trace, honoured and returned
    names = {ROOT_SPAN, "receive", "template", "tokenize", "attempt", "route", "prefill",
             "queue", "prefill_chunk", "kv_send", "decode", "wait_for_pages", "wait_for_kv",
             "first_decode_step", "decode_steps", "finish"}
    receiver.wait_for(_complete(names)(trace_id))
    spans = receiver.trace(trace_id)
    by = _by_name(spans)
    assert {n for n, group in by.items() if len(group) != 1} <= {"prefill_chunk"}
    one = {n: group[0] for n, group in by.items()}
    root, attempt = one[ROOT_SPAN], one["attempt"]
    assert root.parent_id == caller_span and root.service == "splitserve-api"
    for name in ("receive", "template", "tokenize", "attempt"):
        assert one[name].parent_id == root.span_id and one[name].service == "splitserve-api"
    assert one["route"].parent_id == attempt.span_id
    prefill, decode = one["prefill"], one["decode"]
    assert (prefill.parent_id, prefill.service) == (attempt.span_id, "splitserve-prefill")
    assert (decode.parent_id, decode.service) == (attempt.span_id, "splitserve-decode")
    for name in ("queue", "prefill_chunk", "kv_send"):
        for s in by[name]:
            assert s.parent_id == prefill.span_id and _within(s, prefill), name
    for name in ("wait_for_pages", "wait_for_kv", "first_decode_step", "decode_steps", "finish"):
        assert one[name].parent_id == decode.span_id and _within(one[name], decode), name
    # The stages follow each other on one time line (one host: one clock).
    order = [one["receive"], one["template"], one["tokenize"], one["route"], one["queue"],
             by["prefill_chunk"][0]]
    for a, b in itertools.pairwise(order):
        if (a.name, b.name) == ("route", "queue"):
            # The task reaches prefill while "route" still sends it to decode: the prefill
            # queue starts inside the route span (causality), not necessarily after its end.
            assert a.start_ns <= b.start_ns + 2_000_000, (a.name, b.name)
            continue
        assert a.end_ns <= b.start_ns + 2_000_000, (a.name, b.name)
    assert one["wait_for_kv"].end_ns <= one["first_decode_step"].start_ns + 1_000_000
    assert one["decode_steps"].attributes["splitserve.steps"] >= 1
    assert sum(s.attributes["splitserve.tokens"] for s in by["prefill_chunk"]) > 0
    assert one["decode"].attributes["splitserve.outcome"] == "finished"
    assert {s.service for s in spans} == {"splitserve-api", "splitserve-prefill",
                                          "splitserve-decode"}
    assert all(_within(s, root, 50_000_000) for s in spans if s.service == "splitserve-api")


def test_grammar_compile_and_tool_parsing_are_spans(cluster, receiver) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}}}]
    r = _chat(cluster, "Weather in Paris?", max_tokens=48, tools=tools, tool_choice="required")
    trace_id = r.headers["x-trace-id"]  # sampled by the ratio (1.0): a trace of its own
    names = {"tool_parse", "grammar_compile", "prefill", "decode"}
    receiver.wait_for(_complete(names)(trace_id))
    by = _by_name(receiver.trace(trace_id))
    assert {s.service for s in by["grammar_compile"]} == {"splitserve-prefill",
                                                          "splitserve-decode"}
    assert by["tool_parse"][0].attributes["splitserve.calls"] == 1


def test_an_aborted_request_ends_its_trace_on_every_process(cluster, receiver) -> None:
    header, trace_id, _ = _traceparent()
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.config.url + "/v1/chat/completions", json=body,
                      headers={"traceparent": header}, timeout=120) as r:
        assert r.status_code == 200
        for i, _line in enumerate(r.iter_lines()):
            if i >= 8:
                break  # the client leaves mid-stream
    spans = receiver.wait_for(lambda s: {"decode", "prefill", ROOT_SPAN} <= {
        x.name for x in s if x.trace_id == trace_id} and receiver.trace(trace_id))
    by = _by_name(spans)
    assert by[ROOT_SPAN][0].attributes.get("splitserve.aborted") is True
    assert by["attempt"][0].attributes["splitserve.outcome"] == "closed"
    assert by["decode"][0].attributes["splitserve.outcome"] == "aborted"
    assert by["decode"][0].end_ns > by["decode"][0].start_ns


@pytest.mark.parametrize("stream", [False, True])
def test_the_timing_breakdown_adds_up_to_the_end_to_end_time(cluster, stream) -> None:
    body = {"model": "default", "prompt": "The history of the printing press",
            "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": stream}
    start = time.perf_counter()
    with httpx.stream("POST", cluster.config.url + "/v1/completions", json=body, timeout=120,
                      headers={"x-splitserve-timing": "1"}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    e2e = time.perf_counter() - start
    if stream:
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        summary = chunks[-1]["splitserve_timing"]
        assert chunks[-1]["choices"] == []
    else:
        summary = json.loads("".join(lines))["splitserve_timing"]
        header = r.headers["x-splitserve-timing"]
        assert header.startswith("server;dur=") and "transfer;dur=" in header
    stages = summary["stages_ms"]
    assert list(stages) == ["server", "queue", "prefill", "transfer", "decode", "deliver",
                            "respond"]
    assert all(v >= 0 for v in stages.values())
    total_s = sum(stages.values()) / 1e3
    assert abs(total_s - e2e) / e2e < 0.05, (stages, e2e)
    assert summary["decode_steps"] >= 40
    assert 0 < summary["ttft_ms"] / 1e3 < e2e


def _exposed(cluster: Cluster) -> set[str]:
    text = httpx.get(cluster.config.url + "/metrics", timeout=10).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_dashboard_query_names_an_exposed_metric(cluster) -> None:
    import re

    _chat(cluster, "Hello")  # every histogram has samples
    exposed = _exposed(cluster)
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "splitserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        names = set(re.findall(r"\bsplitserve_[a-z0-9_]+", expr))
        assert names, expr
        assert names <= exposed, (expr, names - exposed)
    # The stage histogram is there per stage, and the cluster view's document.
    stages = {s.labels["stage"] for f in text_string_to_metric_families(
        httpx.get(cluster.config.url + "/metrics", timeout=10).text)
        for s in f.samples if s.name == "splitserve_request_stage_seconds_count"}
    assert {"server", "queue", "prefill", "transfer", "decode", "deliver"} <= stages
    view = httpx.get(cluster.config.url + "/cluster", timeout=10).json()
    assert sorted(w["role"] for w in view["workers"]) == ["decode", "prefill", "prefill"]


def test_a_request_re_run_after_losing_its_prefill_worker_shows_a_retry_span(
        cluster, receiver) -> None:
    """prefill-1 drained, prefill-0 stopped: the request goes to prefill-0 and waits there;
    prefill-1 resumed; prefill-0 declared dead after DEAD_AFTER_S; the request re-runs on
    prefill-1 under a ``retry`` span. Runs last: it stops a worker."""
    url = cluster.config.url
    header, trace_id, _ = _traceparent()
    assert httpx.post(url + "/workers/prefill-1/drain", timeout=10).status_code == 200
    pid = cluster.proc("prefill-0").pid
    os.kill(pid, signal.SIGSTOP)
    result: dict = {}
    try:
        thread = threading.Thread(target=lambda: result.update(r=_chat(
            cluster, "Count to three.", headers={"traceparent": header})))
        thread.start()
        receiver.wait_for(lambda s: any(x.name == "route" and x.trace_id == trace_id
                                        for x in s), timeout_s=30)
        assert httpx.post(url + "/workers/prefill-1/resume", timeout=10).status_code == 200
        thread.join(120)
    finally:
        os.kill(pid, signal.SIGCONT)
        httpx.post(url + "/workers/prefill-1/resume", timeout=10)
    assert result["r"].json()["choices"][0]["message"]["content"]
    def finished(spans: list[Span]) -> list[Span] | None:
        mine = [x for x in spans if x.trace_id == trace_id]
        done = any(x.name == "decode" and x.attributes.get("splitserve.outcome") == "finished"
                   for x in mine)
        return mine if done and any(x.name == "retry" for x in mine) else None

    spans = receiver.wait_for(finished)
    by = _by_name(spans)
    first, retry = by["attempt"][0], by["retry"][0]
    assert first.attributes["splitserve.outcome"] == "retried" and first.status == 2
    assert "prefill worker prefill-0" in retry.attributes["splitserve.retry_reason"]
    assert retry.attributes["splitserve.rid"].endswith(".retry1")
    assert first.end_ns <= retry.start_ns
    served = [s for s in by["prefill"] if s.parent_id == retry.span_id]
    assert [s.instance for s in served] == ["prefill-1"]
    assert any(s.parent_id == retry.span_id for s in by["decode"])
    wait = time.monotonic() + 30
    while time.monotonic() < wait:  # prefill-0 taken back after SIGCONT
        rows = httpx.get(url + "/workers", timeout=10).json()
        if all(w["healthy"] for w in rows):
            break
        time.sleep(0.5)
