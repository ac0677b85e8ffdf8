"""The built-in web page in a real browser: headless Chromium (Debian's ``chromium``, driven by
playwright; never ``playwright install``) opens ``/`` on a launched disaggregated cluster, sends
a chat and sees the streamed answer appear, then the cluster view shows both workers, one of
them drained after its Drain button is pressed, and healthy again after Resume.

Set ``SPLITSERVE_UI_SCREENSHOTS`` to a folder to keep a screenshot of each view there (how
docs/ui_chat.png and docs/ui_cluster.png were made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory) -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (scripts/install.sh installs it as root)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            headless=True, args=FLAGS, viewport={"width": 1280, "height": 820})
        try:
            yield context
        finally:
            context.close()


def _shot(page, name: str) -> None:
    folder = os.environ.get("SPLITSERVE_UI_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / name))


def test_chat_streams_its_answer_into_the_page(disagg_cluster: Cluster, browser_context) -> None:
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(disagg_cluster.config.url + "/", timeout=TIMEOUT_MS)
    page.fill("#max-tokens", "96")
    page.fill("#temperature", "0")
    page.fill("#chat-input", "Write a short poem about the sea.")
    page.click("#send")
    # Part of the answer is on the page while it still streams...
    page.wait_for_function(
        "() => { const m = document.querySelector('.msg.assistant.streaming');"
        " return m && m.textContent.length > 0; }", timeout=TIMEOUT_MS)
    # ...then the whole of it, with the answer's usage and TTFT.
    page.wait_for_selector(".msg.assistant.done", timeout=TIMEOUT_MS)
    answer = page.text_content(".msg.assistant.done")
    assert answer and len(answer) > 20 and not answer.startswith("Error")
    stats = page.text_content("#answer-stats")
    assert "TTFT" in stats and "completion" in stats and "stages" in stats
    _shot(page, "ui_chat.png")
    assert errors == []
    page.close()


def test_cluster_view_shows_both_workers_and_a_drain(disagg_cluster: Cluster,
                                                     browser_context) -> None:
    url = disagg_cluster.config.url
    page = browser_context.new_page()
    page.goto(url + "/#cluster", timeout=TIMEOUT_MS)
    page.wait_for_selector(".worker[data-worker-id='decode-0']", timeout=TIMEOUT_MS)
    cards = page.query_selector_all(".worker")
    roles = sorted(c.query_selector(".role").text_content() for c in cards)
    assert roles == ["decode", "prefill"]
    state = ".worker[data-worker-id='decode-0'] .state"
    assert page.text_content(state) == "healthy"
    _shot(page, "ui_cluster.png")
    try:
        page.click(".worker[data-worker-id='decode-0'] button.drain")
        page.wait_for_function(f"() => document.querySelector(\"{state}\").textContent === "
                               "'draining'", timeout=TIMEOUT_MS)
        rows = {w["worker_id"]: w for w in httpx.get(url + "/workers", timeout=10).json()}
        assert rows["decode-0"]["draining"] is True
        page.click(".worker[data-worker-id='decode-0'] button.drain")  # now "Resume"
        page.wait_for_function(f"() => document.querySelector(\"{state}\").textContent === "
                               "'healthy'", timeout=TIMEOUT_MS)
    finally:
        httpx.post(url + "/workers/decode-0/resume", timeout=10)
    page.close()
