"""Tenants on the fake engine (``server.tenancy``, ``server.guard``): each key of an
``--api-key-file`` and each ``cache_salt`` gets its own prefix-cache namespace, so
``cached_tokens`` never counts another tenant's prompt; rate limits answer 429 with
``Retry-After`` and an OpenAI error body; the key file's format and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.rate_limit import RateLimiter
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing, Tenancy, cache_namespace

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture
def keyfile(tmp_path: Path) -> str:
    path = tmp_path / "keys"
    path.write_text("# tenants\nsk-alice alice\n\nsk-bob\n")
    return str(path)


@pytest.fixture
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, tokenizer.eos_token_id)


def make_client(fake, tokenizer, keyfile, limiter=None) -> TestClient:
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id],
                     tenancy=Tenancy(limiter))
    install_guard(app, KeyRing.from_config("sk-admin", keyfile), max_body_bytes=0)
    return TestClient(app)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def cached(client: TestClient, key: str, salt: str | None = None, chat: bool = False) -> int:
    body = {"model": "default", "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
        r = client.post("/v1/chat/completions", json=body, headers=auth(key))
    else:
        r = client.post("/v1/completions", json={**body, "prompt": PROMPT}, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_keys_and_salts_never_share_the_cache(fake, tokenizer, keyfile, chat) -> None:
    client = make_client(fake, tokenizer, keyfile)
    assert cached(client, "sk-alice", chat=chat) == 0
    assert cached(client, "sk-alice", chat=chat) > 0  # the cache works within a tenant
    assert cached(client, "sk-bob", chat=chat) == 0  # another key
    assert cached(client, "sk-admin", chat=chat) == 0  # the shared tenant
    assert cached(client, "sk-alice", "s1", chat=chat) == 0  # a salt after the unsalted one
    assert cached(client, "sk-alice", "s1", chat=chat) > 0
    assert cached(client, "sk-bob", "s1", chat=chat) == 0  # same salt, another key
    namespaces = {ns for ns in fake.namespaces}
    assert len(namespaces) == 5


def test_cache_namespace_is_a_hash_of_tenant_and_salt() -> None:
    assert cache_namespace(None, None) is None
    seen = {cache_namespace(t, s) for t in (None, "", "a", "ab") for s in (None, "", "c", "bc")}
    # 16 distinct, only (None, None) the shared None: ("a","bc") vs ("ab","c"), None vs "" differ.
    assert len(seen) == 16 and None in seen
    ns = cache_namespace("alice", "secret-salt")
    assert "alice" not in ns and "secret" not in ns and len(ns) == 32
    assert ns == cache_namespace("alice", "secret-salt")


@pytest.mark.parametrize("salt", ["", 7, "x" * 257])
def test_bad_cache_salt_is_400(fake, tokenizer, keyfile, salt) -> None:
    client = make_client(fake, tokenizer, keyfile)
    r = client.post("/v1/completions", headers=auth("sk-bob"),
                    json={"model": "default", "prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_rate_limit_is_429_per_key(fake, tokenizer, keyfile) -> None:
    now = [0.0]
    client = make_client(fake, tokenizer, keyfile,
                         RateLimiter(requests_per_s=1, tokens_per_s=1000, clock=lambda: now[0]))
    body = {"model": "default", "prompt": "hi", "max_tokens": 4}
    assert client.post("/v1/completions", json=body, headers=auth("sk-alice")).status_code == 200
    r = client.post("/v1/completions", json=body, headers=auth("sk-alice"))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "1 requests/s" in err["message"]
    assert len(fake.requests) == 1  # a refused request never reaches the engine
    r = client.post("/v1/chat/completions", headers=auth("sk-alice"),
                    json={"model": "default", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429  # both endpoints
    assert client.post("/v1/completions", json=body, headers=auth("sk-bob")).status_code == 200
    now[0] += 1.0
    assert client.post("/v1/completions", json=body, headers=auth("sk-alice")).status_code == 200


def test_generated_tokens_are_charged(fake, tokenizer, keyfile) -> None:
    now = [0.0]
    client = make_client(fake, tokenizer, keyfile,
                         RateLimiter(tokens_per_s=20, clock=lambda: now[0]))
    body = {"model": "default", "prompt": "hi", "max_tokens": 30, "ignore_eos": True}
    r = client.post("/v1/completions", json=body, headers=auth("sk-alice"))
    assert r.status_code == 200
    used = r.json()["usage"]["total_tokens"]
    assert used > 20  # the prompt alone would leave the bucket in credit
    r = client.post("/v1/completions", json=body, headers=auth("sk-alice"))
    assert r.status_code == 429 and "tokens/s" in r.json()["error"]["message"]
    # Retry-After covers the debt (used - 20 tokens at 20/s) plus a token.
    assert int(r.headers["retry-after"]) >= (used - 20) / 20


def test_key_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No such file"):
        KeyRing.from_config(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no key"):
        KeyRing.from_config(None, str(tmp_path / "empty"))
    (tmp_path / "dup").write_text("k1 a\nk1 b\n")
    with pytest.raises(ValueError, match="twice"):
        KeyRing.from_config(None, str(tmp_path / "dup"))
    assert KeyRing.from_config(None, None) is None
    ring = KeyRing.from_config("main", None)
    assert ring.match(b"Bearer main").tenant is None and ring.match(b"Bearer x") is None


def test_wrong_key_still_401(fake, tokenizer, keyfile) -> None:
    client = make_client(fake, tokenizer, keyfile)
    r = client.post("/v1/completions", json={"model": "default", "prompt": "hi"},
                    headers=auth("sk-eve"))
    assert r.status_code == 401


def test_flush_cache_is_the_operators_only(fake, tokenizer, keyfile) -> None:
    """A tenant's key may not flush every tenant's cache (403 naming the operator's key); the
    operator's ``--api-key`` may, from anywhere; with no key configured, a client on loopback
    may and any other gets 403."""
    client = make_client(fake, tokenizer, keyfile)
    for tenant_key in ("sk-alice", "sk-bob"):
        r = client.post("/flush_cache", json={}, headers=auth(tenant_key))
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "permission_denied" and "--api-key" in err["message"], err
    assert client.post("/flush_cache", json={}, headers=auth("sk-admin")).status_code == 200
    assert client.post("/flush_cache", json={}).status_code == 401  # no key at all
    open_app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id])
    local = TestClient(open_app, client=("127.0.0.1", 50000))
    assert local.post("/flush_cache", json={}).status_code == 200
    r = TestClient(open_app, client=("10.1.2.3", 50000)).post("/flush_cache", json={})
    assert r.status_code == 403 and "loopback" in r.json()["error"]["message"], r.text
