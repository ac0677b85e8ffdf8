"""A real browser on a page of another origin cannot drive the cluster (``server.browser_guard``,
``server.tenancy.require_operator``), and the server's own pages still can.

Headless Chromium (Debian's ``chromium``, installed by ``scripts/install.sh``; driven by
``playwright`` with ``executable_path``, never ``playwright install``) opens an attacker's page
served by a second HTTP server on another port. The page tries what a cross-site request forgery
would: "simple" ``fetch``es (``text/plain`` bodies, ``no-cors``, with and without credentials),
preflighted JSON ``fetch``es, form posts (``text/plain``, urlencoded, multipart), and a beacon,
against chat, ``/flush_cache`` and a worker's drain. Each attempt is one HTTP request; the test
waits until the server counted that many refusals, then checks through the API that the cache,
the workers and the request counters are as before. A page served at the API's own origin
(``page.route`` answers its HTML; its fetch goes to the real server) gets a chat completion.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster
from tests.e2e.conftest import free_port

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4, "temperature": 0}

# Every attempt is one request to the API (a preflighted one stops at its OPTIONS). ``API`` and
# ``WORKER`` are filled in; the page sets ``window.attacks`` to a promise of every outcome.
ATTACK_PAGE = """<!doctype html><html><body>
<iframe name="f1"></iframe><iframe name="f2"></iframe><iframe name="f3"></iframe>
<form id="chatform" method="POST" enctype="text/plain" target="f1" action="API/v1/chat/completions">
  <input name='{"model":"default","messages":[{"role":"user","content":"pwned"}],"x":"' value='"}'>
</form>
<form id="flushform" method="POST" target="f2" action="API/flush_cache">
  <input name="a" value="b"></form>
<form id="drainform" method="POST" enctype="multipart/form-data" target="f3"
      action="API/workers/WORKER/drain"><input name="a" value="b"></form>
<script>
const api = "API", chat = JSON.stringify(CHAT);
const tries = {
  chat_cors_text_plain: () => fetch(api + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "text/plain"}, body: chat}),
  chat_no_cors_credentials: () => fetch(api + "/v1/chat/completions", {method: "POST",
      mode: "no-cors", credentials: "include", body: chat}),
  chat_no_cors_omit: () => fetch(api + "/v1/chat/completions", {method: "POST",
      mode: "no-cors", credentials: "omit", headers: {"Content-Type": "text/plain"}, body: chat}),
  chat_preflighted_json: () => fetch(api + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: chat}),
  flush_no_cors_no_body: () => fetch(api + "/flush_cache", {method: "POST", mode: "no-cors"}),
  flush_no_cors_credentials: () => fetch(api + "/flush_cache", {method: "POST",
      mode: "no-cors", credentials: "include", headers: {"Content-Type": "text/plain"},
      body: "{}"}),
  drain_no_cors: () => fetch(api + "/workers/WORKER/drain", {method: "POST", mode: "no-cors"}),
  drain_preflighted_json: () => fetch(api + "/workers/WORKER/drain", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: "{}"}),
};
function submitted(form, frame) {
  return new Promise(done => {
    document.querySelector(`iframe[name=${frame}]`).onload = () => done("loaded");
    document.getElementById(form).submit();
  });
}
window.attacks = (async () => {
  const out = {};
  for (const [name, attempt] of Object.entries(tries)) {
    try { const r = await attempt(); out[name] = r.type + " " + r.status; }
    catch (e) { out[name] = "blocked: " + e.message; }
  }
  out.chat_form_text_plain = await submitted("chatform", "f1");
  out.flush_form_urlencoded = await submitted("flushform", "f2");
  out.drain_form_multipart = await submitted("drainform", "f3");
  out.flush_beacon = navigator.sendBeacon(api + "/flush_cache", "{}") ? "queued" : "refused";
  return out;
})();
</script></body></html>"""
NUM_ATTEMPTS = 12  # the eight fetches, three forms and the beacon above

OWN_PAGE = """<!doctype html><html><body><script>
window.answer = fetch("/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json"}, body: JSON.stringify(CHAT)})
  .then(async r => ({status: r.status, body: await r.json()}));
</script></body></html>"""


def _chromium_or_skip() -> None:
    """scripts/install.sh installs Debian's chromium when it runs as root: as root a missing
    browser is a failure; without root it may not have been able to."""
    if os.path.exists(CHROMIUM):
        return
    if os.geteuid() == 0:
        pytest.fail(f"{CHROMIUM} is missing: scripts/install.sh installs it (apt chromium)")
    pytest.skip(f"{CHROMIUM} is missing and installing it needs root (scripts/install.sh)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator:
    _chromium_or_skip()
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh user-data-dir
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield context
        finally:
            context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def attacker_site(colocated_cluster: Cluster) -> Iterator[str]:
    """The attacker's page on another origin: a second HTTP server, on another port."""
    html = (ATTACK_PAGE.replace("API", colocated_cluster.config.url)
            .replace("WORKER", "colocated-0").replace("CHAT", json.dumps(CHAT))).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(html)))
            self.end_headers()
            self.wfile.write(html)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? ([0-9.e+-]+)$" if want else \
        rf"^{re.escape(name)} ([0-9.e+-]+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


def _state(url: str) -> dict:
    """What an attack would change: each worker's cache and counters and whether it drains,
    and the router's request counters."""
    workers = {w["worker_id"]: {k: w.get(k) for k in (
        "cache_pages", "cache_prompt_tokens", "cache_hit_tokens", "draining", "in_flight",
        "num_running", "num_waiting")} for w in httpx.get(url + "/workers", timeout=10).json()}
    text = httpx.get(url + "/metrics", timeout=10).text
    counters = {outcome: _metric(text, "splitserve_requests_total", outcome=outcome)
                for outcome in ("finished", "error", "rejected")}
    return {"workers": workers, "requests": counters}


def _refused(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(_metric(text, "splitserve_requests_refused_total", reason=r)
               for r in ("origin", "content_type"))


def test_attacker_page_changes_nothing(colocated_cluster: Cluster, browser, attacker_site) -> None:
    url = colocated_cluster.config.url
    # Something in the prefix cache for a flush to throw away.
    warm = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert warm.status_code == 200, warm.text
    before, refused_before = _state(url), _refused(url)
    assert any(w["cache_pages"] for w in before["workers"].values()), before

    page = browser.new_page()
    try:
        page.goto(attacker_site)
        outcomes = page.evaluate("window.attacks")
    finally:
        page.close()
    # Each attempt reached the server once and was refused there (the beacon's may still be in
    # flight when the page is done): wait for the count, then look at everything else.
    deadline = time.monotonic() + 60
    while _refused(url) - refused_before < NUM_ATTEMPTS and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = _refused(url) - refused_before
    after = _state(url)
    print(f"\nattacker page outcomes (as the page saw them): {json.dumps(outcomes, indent=1)}"
          f"\nrefused by the server: {refused:g} of {NUM_ATTEMPTS} attempts")
    assert after == before, (before, after)
    assert refused == NUM_ATTEMPTS, (outcomes, refused)  # every attempt reached the server


def test_a_page_of_the_servers_own_origin_can_chat(colocated_cluster: Cluster, browser) -> None:
    url = colocated_cluster.config.url
    finished = _state(url)["requests"]["finished"]
    page = browser.new_page()
    try:
        # The document is the server's origin (the web UI will be served here); only this one
        # URL is answered by the browser, the fetch it makes goes to the real server.
        page.route(url + "/own-page", lambda route: route.fulfill(
            status=200, content_type="text/html",
            body=OWN_PAGE.replace("CHAT", json.dumps(CHAT))))
        page.goto(url + "/own-page")
        answer = page.evaluate("window.answer")
    finally:
        page.close()
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"], answer
    assert _state(url)["requests"]["finished"] == finished + 1


def test_chromium_is_the_debian_package() -> None:
    """The browser the tests drive is the system's, not a download (``playwright install``)."""
    _chromium_or_skip()
    assert Path(CHROMIUM).resolve().is_file()
