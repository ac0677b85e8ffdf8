"""What a web page can make a browser send (``server.browser_guard``), and who may call the
operator routes (``server.tenancy.require_operator``), on the fake engine: every ``POST`` that
is not JSON is a 415 and an ``Origin`` not allowed a 403, on every route, including one added to
the app after it was built; none of them reaches the engine. The real browser's attempts are
``tests/e2e/test_browser_csrf.py``."""

from __future__ import annotations

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from splitserve.server.browser_guard import is_json, is_literal_host
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.main import exposure_warning
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing

LOOPBACK = ("127.0.0.1", 50000)
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SIMPLE_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x", None]


class CountingEngine(FakeEngineClient):
    """The fake engine, counting cache flushes (generations are in ``requests``)."""

    flushes = 0

    async def flush_cache(self) -> list[dict]:
        self.flushes += 1
        return await super().flush_cache()


@pytest.fixture
def engine(tokenizer) -> CountingEngine:
    return CountingEngine(tokenizer, tokenizer.eos_token_id)


def make_client(engine, tokenizer, origins=(), client=LOOPBACK, base="http://127.0.0.1:8000",
                keys=None) -> TestClient:
    app = create_app(engine, tokenizer, "m", 2048, [tokenizer.eos_token_id],
                     allowed_origins=origins)

    @app.post("/added-later")  # a route another part adds after create_app
    async def added_later(request: Request) -> dict:
        return {"body": (await request.body()).decode()}

    if keys is not None:
        install_guard(app, keys, 0)
    return TestClient(app, client=client, base_url=base)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/flush_cache",
                                  "/tokenize", "/added-later"])
@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
def test_a_post_that_is_not_json_is_415(engine, tokenizer, path, content_type) -> None:
    client = make_client(engine, tokenizer)
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post(path, content=b'{"model": "default"}', headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert not engine.requests and engine.flushes == 0


def test_json_posts_pass_with_any_parameters(engine, tokenizer) -> None:
    client = make_client(engine, tokenizer)
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        r = client.post("/v1/chat/completions", content=b'{"model": "default", "messages": '
                        b'[{"role": "user", "content": "hi"}], "max_tokens": 2}',
                        headers={"content-type": content_type})
        assert r.status_code == 200, r.text
    assert client.post("/flush_cache", json={}).status_code == 200 and engine.flushes == 1
    assert client.post("/added-later", json={"a": 1}).json() == {"body": '{"a":1}'}


@pytest.mark.parametrize("origin", ["http://evil.test", "http://127.0.0.1:9999", "null",
                                    "http://localhost:8000"])
def test_an_origin_not_allowed_is_403_on_every_method(engine, tokenizer, origin) -> None:
    client = make_client(engine, tokenizer)
    for method, path, kw in [("post", "/v1/chat/completions", {"json": CHAT}),
                             ("post", "/flush_cache", {"json": {}}),
                             ("post", "/added-later", {"json": {}}),
                             ("get", "/v1/models", {}), ("get", "/workers", {}),
                             ("options", "/v1/chat/completions", {})]:
        r = getattr(client, method)(path, headers={"Origin": origin}, **kw)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "origin_not_allowed"
    assert not engine.requests and engine.flushes == 0


def test_the_servers_own_origin_and_listed_ones_pass(engine, tokenizer) -> None:
    own = make_client(engine, tokenizer)  # Host: 127.0.0.1:8000
    r = own.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://127.0.0.1:8000"})
    assert r.status_code == 200, r.text
    by_name = make_client(engine, tokenizer, base="http://localhost:8000")
    assert by_name.post("/v1/chat/completions", json=CHAT,
                        headers={"Origin": "http://localhost:8000"}).status_code == 200
    listed = make_client(engine, tokenizer, origins=["http://app.test:3000/"])
    assert listed.post("/v1/chat/completions", json=CHAT,
                       headers={"Origin": "http://app.test:3000"}).status_code == 200
    anyone = make_client(engine, tokenizer, origins=["*"])
    assert anyone.post("/v1/chat/completions", json=CHAT,
                       headers={"Origin": "http://evil.test"}).status_code == 200


def test_dns_rebinding_is_not_the_servers_own_origin(engine, tokenizer) -> None:
    """A name resolved to this machine by an attacker's DNS makes its page look same-origin
    (``Host`` equals ``Origin``); only IP literals and ``localhost`` count as the server's own."""
    client = make_client(engine, tokenizer, base="http://evil.test:8000")
    r = client.post("/flush_cache", json={}, headers={"Origin": "http://evil.test:8000"})
    assert r.status_code == 403 and engine.flushes == 0
    listed = make_client(engine, tokenizer, origins=["http://llm.example"],
                         base="http://llm.example")
    assert listed.post("/flush_cache", json={},
                       headers={"Origin": "http://llm.example"}).status_code == 200


def test_a_cross_site_post_without_origin_is_403(engine, tokenizer) -> None:
    client = make_client(engine, tokenizer)
    for site in ("cross-site", "same-site"):
        r = client.post("/flush_cache", json={}, headers={"Sec-Fetch-Site": site})
        assert r.status_code == 403, r.text
    for site in ("same-origin", "none"):  # the server's own page; a typed URL or a bookmark
        assert client.post("/flush_cache", json={},
                           headers={"Sec-Fetch-Site": site}).status_code == 200


def test_operator_routes_answer_loopback_only_without_a_key(engine, tokenizer) -> None:
    remote = make_client(engine, tokenizer, client=("192.0.2.7", 40000))
    r = remote.post("/flush_cache", json={})
    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    assert engine.flushes == 0
    # Generation is not an operator route: the network may use it (the start-up warning says so).
    assert remote.post("/v1/chat/completions", json=CHAT).status_code == 200
    for client in (LOOPBACK, ("::1", 1), ("::ffff:127.0.0.1", 1)):
        assert make_client(engine, tokenizer, client=client).post(
            "/flush_cache", json={}).status_code == 200
    keyed = make_client(engine, tokenizer, client=("192.0.2.7", 40000),
                        keys=KeyRing.from_config("sk-op", None))
    assert keyed.post("/flush_cache", json={}).status_code == 401
    assert keyed.post("/flush_cache", json={},
                      headers={"Authorization": "Bearer sk-op"}).status_code == 200


def test_start_up_warning_beyond_loopback_without_a_key() -> None:
    keys = KeyRing.from_config("sk-op", None)
    for host in ("0.0.0.0", "::", "10.0.0.5", "llm.example"):
        warning = exposure_warning(host, None)
        assert warning is not None and "API key" in warning, host
        assert exposure_warning(host, keys) is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, None) is None


def test_header_helpers() -> None:
    assert is_json(b"application/json") and is_json(b"application/json ; charset=utf-8")
    assert not is_json(b"application/jsonp") and not is_json(b"text/json") and not is_json(None)
    assert all(is_literal_host(h) for h in ("127.0.0.1:8000", "[::1]:8000", "localhost:1",
                                            "10.0.0.5", "::1"))
    assert not any(is_literal_host(h) for h in ("evil.test:8000", "localhost.evil.test"))
