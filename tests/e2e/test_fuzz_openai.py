"""Request bodies drawn from OpenAI's request schemas (``tests/openapi_bodies.py``) against a
launched disaggregated cluster on the default model: no 5xx, every error an OpenAI error body,
and afterwards the server healthy, nothing in flight and no KV page held.

Two draws per endpoint (chat, completions, responses): over the spec's every field (most bodies
meet a refused field), and over the fields we serve (bodies that reach the engine). Responses
bodies draw their input items from the spec's every kind, a group of kinds per draw
(``input_item_groups``). ``SPLITSERVE_FUZZ_EXAMPLES`` sets the
examples per draw (default 10, about a minute in all on 2 cores, the same bodies each run);
set, it also draws new bodies each run.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.server.fields import FIELDS, PATHS
from splitserve.server.responses_api.fields import RESPONSES_FIELDS
from tests.e2e.conftest import worker_pages_used
from tests.openapi_bodies import (
    SMALL,
    TOKEN_CAP,
    body_strategy,
    check_openai_answer,
    input_item_groups,
)

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "10"))
DERANDOMIZE = "SPLITSERVE_FUZZ_EXAMPLES" not in os.environ  # CI: the same bodies each run
SETTLE_S = 30.0  # how long aborted requests may take to free their pages (only a failure waits)


@pytest.mark.parametrize("subset", ["spec", "implemented"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fuzzed_bodies_get_no_5xx(disagg_cluster, endpoint: str, subset: str) -> None:
    url = disagg_cluster.config.url + PATHS[endpoint]
    only = None if subset == "spec" else {
        n for n, r in FIELDS[endpoint].items() if r.status != "refused"}
    bodies = body_strategy(endpoint, PATHS[endpoint], only=only, caps=SMALL,
                           required=TOKEN_CAP[endpoint], ints=subset == "implemented")

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def run(body: dict) -> None:
        r = httpx.post(url, content=json.dumps(body), timeout=120,
                       headers={"content-type": "application/json"})
        check_openai_answer(r.status_code, r.text, r.headers.get("content-type", ""))

    run()
    assert_settled(disagg_cluster)


@pytest.mark.parametrize("subset", ["spec", "implemented"])
def test_fuzzed_responses_bodies_get_no_5xx(disagg_cluster, subset: str) -> None:
    url = disagg_cluster.config.url + "/v1/responses"
    only = None if subset == "spec" else {
        n for n, r in RESPONSES_FIELDS.items() if r.status != "refused"}
    bodies = st.one_of(*(body_strategy("responses", "/v1/responses", only=only,
                                       caps={**SMALL, "input": group},
                                       required=TOKEN_CAP["responses"],
                                       ints=subset == "implemented")
                         for group in input_item_groups()))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def run(body: dict) -> None:
        r = httpx.post(url, content=json.dumps(body), timeout=120,
                       headers={"content-type": "application/json"})
        check_openai_answer(r.status_code, r.text, r.headers.get("content-type", ""))

    run()
    assert_settled(disagg_cluster)


def assert_settled(cluster) -> None:
    """The server is healthy, nothing is in flight, no KV page is held, and it still serves."""
    base = cluster.config.url
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + SETTLE_S
    while True:
        rows = httpx.get(base + "/workers", timeout=10).json()
        held = worker_pages_used(cluster)
        in_flight = {r["worker_id"]: r["in_flight"] for r in rows}
        if not any(held.values()) and not any(in_flight.values()):
            break
        assert time.monotonic() < deadline, f"pages held {held}, in flight {in_flight}"
        time.sleep(0.2)
    # And it still serves.
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": "The capital of France is", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_out_of_64_bit_seeds_leave_in_flight_counts_at_zero(disagg_cluster) -> None:
    """Six requests with a seed past 64 bits were six 500s and left the prefill worker at -6."""
    base = disagg_cluster.config.url
    for seed in (2**64, 2**70, -(2**64), 2**63, 10**30, -(2**63) - 1):
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    rows = httpx.get(base + "/workers", timeout=10).json()
    assert {r["role"]: r["in_flight"] for r in rows} == {"prefill": 0, "decode": 0}
