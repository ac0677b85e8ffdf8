"""Messages request bodies drawn from the ``anthropic`` SDK's request types
(``tests/messages_bodies.py``) against a launched disaggregated cluster on the default model:
no 5xx, every error in Anthropic's error shape, every 200 a whole message or event stream, and
afterwards the server healthy, nothing in flight and no KV page held.

Two draws: over every field and block the SDK can send (most bodies meet a refused or malformed
field), and over the served ones (bodies that reach the engine). ``SPLITSERVE_FUZZ_EXAMPLES``
sets the examples per draw (default 12, the same bodies each run); set, it also draws new
bodies each run.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.e2e.conftest import worker_pages_used
from tests.messages_bodies import body_strategy, check_messages_answer

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "12"))
DERANDOMIZE = "SPLITSERVE_FUZZ_EXAMPLES" not in os.environ  # CI: the same bodies each run
SETTLE_S = 30.0  # how long aborted requests may take to free their pages (only a failure waits)


@pytest.mark.parametrize("subset", ["sdk", "served"])
def test_fuzzed_messages_get_no_5xx_and_hold_no_pages(disagg_cluster, subset: str) -> None:
    base = disagg_cluster.config.url
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(body_strategy(served_only=subset == "served"))
    def run(body: dict) -> None:
        r = httpx.post(base + "/v1/messages", content=json.dumps(body), timeout=120,
                       headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_messages_answer(r.status_code, r.text, r.headers.get("content-type", ""))

    run()
    if subset == "served":
        assert statuses.get(200), statuses  # the draw reaches the engine
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + SETTLE_S
    while True:
        rows = httpx.get(base + "/workers", timeout=10).json()
        held = worker_pages_used(disagg_cluster)
        in_flight = {r["worker_id"]: r["in_flight"] for r in rows}
        if not any(held.values()) and not any(in_flight.values()):
            break
        assert time.monotonic() < deadline, f"pages held {held}, in flight {in_flight}"
        time.sleep(0.2)
