"""Tenant isolation on a launched 1 prefill + 1 decode cluster with an ``--api-key-file`` of
three keys and per-key rate limits: the same prompt from another key, or with another
``cache_salt``, reports ``cached_tokens == 0`` (the radix cache on the prefill worker keeps
namespaces apart) while the greedy output stays the same; a key past its rate limit gets 429
with ``Retry-After`` and an OpenAI error body, other keys do not, and after waiting it is served;
a key's stored responses (``/v1/responses``) are its own: another key's id is a 404 and cannot
be continued; no page is held afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.faults.helpers import assert_no_pages, wait_all_healthy

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "carol": "sk-carol-3"}
OPERATOR = {"Authorization": "Bearer sk-operator-0"}  # --api-key: flushes, manages workers
RATE = 1.0  # requests per second per key: a burst of one
BURST = 4  # requests sent at once by one key
PROMPT = ("You are a careful assistant. Here is a long shared system prompt that sets the scene "
          "for every answer and is long enough to fill several KV pages. Question: what is two "
          "plus two?")


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "api.keys"
    keyfile.write_text("".join(f"{key} {name}\n" for name, key in KEYS.items()))
    spec = serve_config(model_path, kv_cache_mb=32, threads_per_worker=1,
                        api_key="sk-operator-0", api_key_file=str(keyfile), rate_limit_rps=RATE,
                        rate_limit_tps=100_000,
                        responses_store=str(keyfile.parent / "responses.sqlite3"))
    with Cluster(spec) as c:
        wait_all_healthy(c, 2, headers=auth("alice"))
        yield c


def post(url: str, path: str, body: dict, headers: dict) -> httpx.Response:
    """POST, waiting out 429s as a client should (by their ``Retry-After``)."""
    for _ in range(20):
        r = httpx.post(url + path, json=body, headers=headers, timeout=120)
        if r.status_code != 429:
            return r
        time.sleep(float(r.headers["retry-after"]))
    raise AssertionError("still rate limited after 20 waits")


def ask(url: str, name: str, salt: str | None = None, chat: bool = False) -> tuple[int, str]:
    """(cached_tokens, text) of a greedy request for ``PROMPT`` from ``name``."""
    body = {"model": "default", "max_tokens": 6, "temperature": 0,
            **({"cache_salt": salt} if salt else {})}
    if chat:
        r = post(url, "/v1/chat/completions",
                 {**body, "messages": [{"role": "user", "content": PROMPT}]}, auth(name))
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
    else:
        r = post(url, "/v1/completions", {**body, "prompt": PROMPT}, auth(name))
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else ""
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_keys_and_salts_never_share_cached_prompts(cluster, chat) -> None:
    url = cluster.config.url
    assert httpx.post(url + "/flush_cache", json={}, headers=OPERATOR, timeout=30).status_code == 200
    first, ref = ask(url, "alice", chat=chat)
    assert first == 0
    again, text = ask(url, "alice", chat=chat)
    assert again > 0 and text == ref  # the cache works within one key
    for name, salt in [("bob", None), ("alice", "salt-1"), ("bob", "salt-1"), ("carol", None)]:
        cached, text = ask(url, name, salt, chat=chat)
        assert cached == 0, (name, salt, cached)  # never another tenant's prompt
        assert text == ref  # and the same greedy output
    cached, _ = ask(url, "alice", "salt-1", chat=chat)
    assert cached > 0  # a salt is a namespace of its own, reusable with the same salt
    assert_no_pages(cluster, headers=auth("alice"))


def test_a_keys_stored_responses_are_its_own(cluster) -> None:
    url = cluster.config.url
    # Earlier tests sent the same prompt under bob's key: start from an empty cache.
    assert httpx.post(url + "/flush_cache", json={}, headers=OPERATOR, timeout=30).status_code == 200
    body = {"model": "default", "input": PROMPT, "max_output_tokens": 16, "temperature": 0}
    made = post(url, "/v1/responses", body, auth("alice"))
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    at = f"/v1/responses/{rid}"
    for method, path in (("GET", at), ("GET", f"{at}/input_items"), ("POST", f"{at}/cancel"),
                         ("DELETE", at)):
        r = httpx.request(method, url + path, headers=auth("bob"), timeout=30)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "response_not_found"
    r = post(url, "/v1/responses", {**body, "previous_response_id": rid}, auth("bob"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    kept = httpx.get(f"{url}/v1/responses/{rid}", headers=auth("alice"), timeout=30)
    assert kept.status_code == 200 and kept.json() == made.json()
    # Nor does one key's Responses prompt serve another's from the cache.
    other = post(url, "/v1/responses", body, auth("bob")).json()
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert other["output"][0]["content"][0]["text"] == made.json()["output"][0]["content"][0][
        "text"]
    assert_no_pages(cluster, headers=auth("alice"))


def test_tenants_may_not_flush_or_manage_workers(cluster) -> None:
    """Flushing empties every tenant's cache, and a registered worker would receive every
    tenant's prompts: both are the operator's (``--api-key``), 403 for a tenant's key."""
    url = cluster.config.url
    reg = {"role": "decode", "worker_id": "rogue", "addr": "tcp://127.0.0.1:1"}
    for method, path, body in [("POST", "/flush_cache", None),
                               ("POST", "/workers/register", reg),
                               ("POST", "/workers/decode-0/drain", None)]:
        r = httpx.request(method, url + path, json=body or {}, headers=auth("bob"), timeout=30)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "permission_denied"
    assert all(not w["draining"] for w in httpx.get(url + "/workers", headers=OPERATOR,
                                                     timeout=10).json())
    assert "rogue" not in {w["worker_id"] for w in httpx.get(url + "/workers", headers=OPERATOR,
                                                             timeout=10).json()}
    assert httpx.post(url + "/flush_cache", json={}, headers=OPERATOR, timeout=30).status_code == 200


def test_rate_limit_per_key(cluster) -> None:
    url = cluster.config.url
    time.sleep(1.0 / RATE)  # let every bucket refill after the other test
    body = {"model": "default", "prompt": "Hi", "max_tokens": 1}

    def send(name: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=body, headers=auth(name), timeout=60)

    # A burst of BURST at once: a bucket of one second's worth, refilled at RATE, admits at
    # most 1 + RATE * (the burst's span) of them. The span is measured around the burst on the
    # client (it contains the server's), so the bound holds however loaded the machine is,
    # and a limiter that let more through fails it; a burst spread so wide by load that all
    # of it passed is retried (the 429's shape is checked on a refusal).
    for _ in range(3):
        started = time.monotonic()
        with ThreadPoolExecutor(BURST) as pool:
            rs = list(pool.map(send, ["carol"] * BURST))
        span_s = time.monotonic() - started
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 429}, codes
        assert 1 <= codes.count(200) <= 1 + int(RATE * span_s), (codes, span_s)
        if 429 in codes:
            break
        time.sleep(1.0 / RATE)
    refused = next(r for r in rs if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "requests/s" in err["message"], err
    assert send("bob").status_code == 200  # another key's bucket is its own
    time.sleep(float(refused.headers["retry-after"]))
    assert send("carol").status_code == 200
    r = httpx.post(url + "/v1/completions", json=body, timeout=10,
                   headers={"Authorization": "Bearer sk-nobody"})
    assert r.status_code == 401
    assert_no_pages(cluster, headers=auth("alice"))
