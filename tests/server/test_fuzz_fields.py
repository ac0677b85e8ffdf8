"""Bodies drawn from OpenAI's request schemas against the API on the fake engine: no 5xx and
OpenAI error bodies, fast. The same against a real cluster is tests/e2e/test_fuzz_openai.py."""

from __future__ import annotations

import json
import os

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.fields import FIELDS, PATHS
from splitserve.server.routes import create_app
from tests.openapi_bodies import SMALL, TOKEN_CAP, body_strategy, check_openai_answer

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = "SPLITSERVE_FUZZ_EXAMPLES" not in os.environ  # CI: the same bodies each run


@pytest.fixture(scope="module")
def client(tokenizer) -> TestClient:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    app = create_app(fake, tokenizer, "smol-test", 2048, [tokenizer.eos_token_id])
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("subset", ["spec", "implemented"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fuzzed_bodies_get_no_5xx(client, endpoint: str, subset: str) -> None:
    only = None if subset == "spec" else {
        n for n, r in FIELDS[endpoint].items() if r.status != "refused"}
    bodies = body_strategy(endpoint, PATHS[endpoint], only=only, caps=SMALL,
                           required=TOKEN_CAP[endpoint], ints=subset == "implemented")

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def run(body: dict) -> None:
        r = client.post(PATHS[endpoint], content=json.dumps(body),
                        headers={"content-type": "application/json"})
        check_openai_answer(r.status_code, r.text, r.headers.get("content-type", ""))

    run()
