"""Shared helpers of the fault tests: streaming clients that record when and how they ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from splitserve.launch.local import Cluster
from splitserve.server.sse import DONE, iter_events


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None  # the OpenAI error body, in-stream or as the HTTP answer
    status: int = 0
    num_chunks: int = 0
    first_chunk_at: float = 0.0
    ended_at: float = 0.0
    headers: dict = field(default_factory=dict)


def stream_completion(url: str, body: dict, on_chunk=None, timeout_s: float = 120,
                      headers: dict | None = None) -> StreamResult:
    """POST a streaming completion; collect text until [DONE] or an error event."""
    res = StreamResult()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=timeout_s, headers=headers) as r:
        res.status, res.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            r.read()
            res.error = r.json().get("error")
            res.ended_at = time.monotonic()
            return res
        for chunk in iter_events(r.iter_lines()):
            if chunk == DONE:  # the last event; the body ends after it
                continue
            if "error" in chunk:
                res.error = chunk["error"]
                break
            res.num_chunks += 1
            if res.num_chunks == 1:
                res.first_chunk_at = time.monotonic()
            choice = chunk["choices"][0]
            res.text += choice["text"]
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if on_chunk is not None:
                on_chunk(res)
    res.ended_at = time.monotonic()
    return res


def complete(url: str, body: dict, timeout_s: float = 120, headers: dict | None = None):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout_s, headers=headers)


def workers(cluster: Cluster, headers: dict | None = None) -> dict[str, dict]:
    rows = httpx.get(cluster.config.url + "/workers", timeout=10, headers=headers).json()
    return {r["worker_id"]: r for r in rows}


def wait_until(cond, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)


def wait_all_healthy(cluster: Cluster, n: int, timeout_s: float = 180, headers=None) -> None:
    def ok():
        cluster.check_alive()
        rows = workers(cluster, headers)
        return len(rows) == n and all(r["healthy"] for r in rows.values())

    wait_until(ok, timeout_s, f"{n} healthy workers", interval_s=0.5)


def pages_held(cluster: Cluster, headers=None) -> dict[str, int]:
    """Pages each worker holds for requests: used pages minus the prefix cache's evictable ones
    (a cache, handed back on demand, not a leak)."""
    return {k: r.get("pages_used", 0) - r.get("cache_evictable_pages", 0)
            for k, r in workers(cluster, headers).items()}


def assert_no_pages(cluster: Cluster, timeout_s: float = 10, headers=None) -> None:
    def free():
        used = pages_held(cluster, headers)
        return used if all(v == 0 for v in used.values()) else None

    try:
        wait_until(free, timeout_s, "zero pages in use")
    except AssertionError:
        used = pages_held(cluster, headers)
        raise AssertionError(f"pages still held after {timeout_s:g} s: {used}") from None


def metric(cluster: Cluster, name: str, headers=None) -> float:
    """Sum of every sample of ``name`` on ``/metrics``."""
    text = httpx.get(cluster.config.url + "/metrics", timeout=10, headers=headers).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total
