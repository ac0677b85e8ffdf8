"""The web page's routes (``server.ui``) and ``GET /cluster`` behind the guard, on the fake
engine: the page's files are open and typed, with a CSP; the cluster view needs the key and says
who may drain; the timing breakdown comes back when asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from splitserve.server.cluster_view import ClusterView, install_cluster_view
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.metrics import ServerMetrics
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing
from splitserve.server.ui import install_ui

KEY, TENANT_KEY = "sk-operator", "sk-tenant"


def _worker(wid: str, role: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(worker_id=wid, role=role, ready=True, draining=False, in_flight=0,
                           failures=0, last_stats={"pages_used": 3, "pages_total": 100,
                                                   **stats})


@pytest.fixture
def pool() -> SimpleNamespace:
    return SimpleNamespace(workers=[_worker("prefill-0", "prefill"),
                                    _worker("decode-0", "decode")])


@pytest.fixture
def client(tokenizer, pool, tmp_path) -> TestClient:
    app = create_app(FakeEngineClient(tokenizer, tokenizer.eos_token_id), tokenizer, "m", 2048,
                     [tokenizer.eos_token_id])
    install_cluster_view(app, ClusterView(pool, ServerMetrics(), "m"))
    install_ui(app)
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{TENANT_KEY} alice\n")
    install_guard(app, KeyRing.from_config(KEY, str(keys_file)), max_body_bytes=10_000)
    return TestClient(app)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_page_and_its_files_are_open_and_typed(client) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/ui/app.js"' in r.text
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/style.css").headers["content-type"].startswith("text/css")
    assert client.get("/ui/secrets.txt").status_code == 404
    assert client.get("/ui/../pyproject.toml").status_code in (401, 404)  # never the file


def test_the_cluster_view_needs_the_key_and_says_who_may_drain(client) -> None:
    assert client.get("/cluster").status_code == 401
    view = client.get("/cluster", headers=_auth(KEY)).json()
    assert view["operator"] is True
    assert [(w["worker_id"], w["role"], w["pages_used"]) for w in view["workers"]] == [
        ("prefill-0", "prefill", 3), ("decode-0", "decode", 3)]
    assert client.get("/cluster", headers=_auth(TENANT_KEY)).json()["operator"] is False


def test_no_page_without_install_ui(tokenizer) -> None:
    app = create_app(FakeEngineClient(tokenizer, tokenizer.eos_token_id), tokenizer, "m", 2048,
                     [tokenizer.eos_token_id])
    assert TestClient(app).get("/").status_code == 404  # what --no-ui serves


def test_the_timing_breakdown_comes_back_when_asked_for(client) -> None:
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
    plain = client.post("/v1/completions", json=body, headers=_auth(KEY))
    assert "splitserve_timing" not in plain.json() and "x-splitserve-timing" not in plain.headers
    r = client.post("/v1/completions", json=body,
                    headers={**_auth(KEY), "x-splitserve-timing": "1"})
    timing = r.json()["splitserve_timing"]
    assert "respond" in timing["stages_ms"] and "tokenize" in timing["prepare_ms"]
    assert timing["total_ms"] == pytest.approx(sum(timing["stages_ms"].values()), abs=0.01)
    assert r.headers["x-splitserve-timing"].startswith(next(iter(timing["stages_ms"])))
