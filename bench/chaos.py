"""Chaos soak: mixed requests at a fixed concurrency against a launched 2 prefill + 2 decode
cluster while a seeded schedule SIGKILLs (then restarts) or SIGSTOPs (then SIGCONTs) random
workers of both roles. Afterwards every request must have either succeeded with the reference
greedy output (computed before any fault) or ended with a clear error, none may hang, every
worker holds zero pages outside the prefix cache, and each process's RSS stays bounded.

Reports, per fault kind, how long after the fault its requests' errors came (p50/max, seconds),
how many requests were lost without an error (goal 0) and how many pages leaked (goal 0).

    python bench/chaos.py --requests 5000 --concurrency 32 --seed 1   # the long run
    python bench/chaos.py --requests 300 --faults 4                   # a short one

``tests/faults/test_cluster_faults.py`` runs a shortened soak with the same code
(:func:`run_soak`) on its own cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
SHARED_PREFIX = ("You are a terse assistant for a shipping company. Answer in one short line. "
                 "Policies: parcels under 2 kg ship standard; over 2 kg ship freight; "
                 "fragile items need a label; returns within 30 days. ") * 3


def request_bodies() -> list[dict]:
    """Twelve distinct requests: streaming or not x free, regex or choice x short prompt or a
    long one sharing a prefix (so the prefix cache is in play)."""
    bodies = []
    for i, (stream, kind, long) in enumerate(
            (s, k, lg) for s in (False, True) for k in ("free", "regex", "choice")
            for lg in (False, True)):
        prompt = (SHARED_PREFIX + f"Question {i}: how does a 3 kg vase ship?" if long
                  else f"Item {i}: the colour of the sky is")
        body = {"model": "default", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "stream": stream}
        if kind == "free":
            body["ignore_eos"] = True
        elif kind == "regex":
            body["regex"] = r"[a-z ]{4,20}\."
        else:
            body["choice"] = ["standard", "freight", "label"]
        bodies.append(body)
    return bodies


@dataclass
class Outcome:
    """One request's end: ``ok`` (text), ``error`` (message) or ``lost`` (no answer, no error
    body, or past its bound)."""

    index: int
    kind: str
    text: str = ""
    status: int = 0
    ended_at: float = 0.0


def send(url: str, body: dict, timeout_s: float) -> tuple[str, str, int]:
    """``(kind, text or message, status)`` of one request."""
    try:
        if not body.get("stream"):
            r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
            data = r.json()
            if r.status_code == 200:
                return "ok", data["choices"][0]["text"], 200
            msg = data.get("error", {}).get("message", "")
            return ("error" if msg else "lost"), msg, r.status_code
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                msg = r.json().get("error", {}).get("message", "")
                return ("error" if msg else "lost"), msg, r.status_code
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    msg = chunk["error"].get("message", "")
                    return ("error" if msg else "lost"), msg, chunk["error"].get("code") or 0
                if chunk.get("choices"):
                    text += chunk["choices"][0].get("text", "")
            return ("ok", text, 200) if done else ("lost", "stream ended without [DONE]", 200)
    except (httpx.HTTPError, ValueError) as exc:
        return "lost", repr(exc), 0


@dataclass
class Fault:
    kind: str  # "kill" | "stop"
    worker: str
    at: float  # monotonic
    healed_at: float = 0.0


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    faults: list[Fault]
    wrong: list[Outcome]
    lost: list[Outcome]
    error_delays: dict[str, list[float]]  # fault kind + role -> seconds from fault to error
    attributed: list[tuple[str, float, Outcome]]  # (fault kind + role, delay, the error)
    rss_mb: dict[str, tuple[float, float]]  # process -> (first sample, max)
    pages_held: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def summary(self) -> str:
        n_ok = sum(o.kind == "ok" for o in self.outcomes)
        n_err = sum(o.kind == "error" for o in self.outcomes)
        lines = [(f"{len(self.outcomes)} requests in {self.elapsed_s:.0f} s: {n_ok} ok, "
                  f"{n_err} clear errors, {len(self.lost)} lost, {len(self.wrong)} wrong "
                  f"output; {len(self.faults)} faults; pages held after: {self.pages_held}")]
        for key, delays in sorted(self.error_delays.items()):
            lines.append(f"  {key}: {len(delays)} errors, fault->error p50 "
                         f"{statistics.median(delays):.2f} s, max {max(delays):.2f} s")
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if o.kind == "error":
                errors[o.text] = errors.get(o.text, 0) + 1
        for msg, count in sorted(errors.items(), key=lambda kv: -kv[1])[:8]:
            lines.append(f"  {count} x {msg[:160]}")
        for name, (first, peak) in sorted(self.rss_mb.items()):
            lines.append(f"  RSS {name}: {first:.0f} MB at start, max {peak:.0f} MB")
        return "\n".join(lines)


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def healthy(url: str) -> bool:
    try:
        rows = httpx.get(url + "/workers", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return len(rows) == len(WORKERS) and all(r["healthy"] for r in rows)


def pages_held(url: str) -> dict[str, int]:
    rows = httpx.get(url + "/workers", timeout=10).json()
    return {r["worker_id"]: r.get("pages_used", 0) - r.get("cache_evictable_pages", 0)
            for r in rows}


def run_soak(cluster, num_requests: int, concurrency: int, num_faults: int, seed: int,
             request_timeout_s: float = 120.0, log: Callable[[str], None] = print) -> SoakReport:
    """Run the soak on ``cluster`` (a ``launch.local.Cluster`` of 2 prefill + 2 decode workers).

    The schedule (seeded): ``num_faults`` faults, one at a time and only while all four workers
    are healthy, alternating roles; each a SIGKILL (restarted 1-3 s later) or a SIGSTOP
    (SIGCONT after 2-8 s, so both sides of ``--dead-after`` are hit). Faults stop when the
    requests are done.
    """
    url = cluster.config.url
    rng = random.Random(seed)
    bodies = request_bodies()
    with ThreadPoolExecutor(len(bodies)) as pool:
        refs = list(pool.map(lambda b: send(url, b, request_timeout_s), bodies))
    for (kind, text, _), body in zip(refs, bodies):
        if kind != "ok":
            raise RuntimeError(f"reference request failed before any fault: {text} ({body})")
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    lock = threading.Lock()
    finished = threading.Event()
    rss: dict[str, tuple[float, float]] = {}

    def sample_rss() -> None:
        for name, proc in cluster.procs:
            mb = rss_mb(proc.pid)
            if mb:
                first, peak = rss.get(name, (mb, mb))
                rss[name] = (first, max(peak, mb))

    def one(i: int) -> Outcome:
        kind, text, status = send(url, bodies[i % len(bodies)], request_timeout_s)
        out = Outcome(i, kind, text, status, time.monotonic())
        with lock:
            outcomes.append(out)
        return out

    def chaos() -> None:
        roles = ["prefill", "decode"]
        rng.shuffle(roles)
        for n in range(num_faults):
            while not healthy(url):
                if finished.wait(0.5):
                    return
            if finished.wait(rng.uniform(1.0, 3.0)):
                return
            worker = f"{roles[n % 2]}-{rng.randrange(2)}"
            # kill A, stop B, stop A, kill B, ...: any two faults have both roles and both kinds
            kind = "kill" if (n + n // 2) % 2 == 0 else "stop"
            pid = cluster.proc(worker).pid
            fault = Fault(kind, worker, time.monotonic())
            log(f"fault {n}: {kind} {worker}")
            if kind == "kill":
                cluster.kill(worker)
                time.sleep(rng.uniform(1.0, 3.0))
                cluster.restart(worker)
            else:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(rng.uniform(2.0, 8.0))
                os.kill(pid, signal.SIGCONT)
            fault.healed_at = time.monotonic()
            faults.append(fault)
            log(f"fault {n} healed after {fault.healed_at - fault.at:.1f} s")
            sample_rss()

    sample_rss()
    t0 = time.monotonic()
    chaos_thread = threading.Thread(target=chaos, daemon=True)
    chaos_thread.start()
    next_index = [0]
    # With a bounded schedule, requests go on past num_requests until every fault has been
    # dealt (and healed), so each fault meets traffic; never past 10x num_requests.
    bounded = num_faults < 10**6

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                more = i < num_requests or (bounded and chaos_thread.is_alive())
                if not more or i >= 10 * num_requests:
                    return
                next_index[0] += 1
            one(i)
            if i % 50 == 0:
                sample_rss()

    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    finished.set()
    chaos_thread.join(60)
    elapsed = time.monotonic() - t0
    sample_rss()
    wrong = [o for o in outcomes if o.kind == "ok" and o.text != refs[o.index % len(bodies)][1]]
    lost = [o for o in outcomes if o.kind == "lost"]
    delays: dict[str, list[float]] = {}
    attributed = []
    for o in outcomes:
        if o.kind != "error":
            continue
        # The fault it came from: the latest one before it ended whose worker it names.
        named = [f for f in faults if f.at <= o.ended_at and f.worker in o.text]
        if named:
            f = named[-1]
            key = f"{f.kind} {f.worker.split('-')[0]}"
            delays.setdefault(key, []).append(o.ended_at - f.at)
            attributed.append((key, o.ended_at - f.at, o))
    return SoakReport(outcomes, faults, wrong, lost, delays, attributed, rss, elapsed_s=elapsed)


def main() -> None:
    from splitserve.config import ServeConfig
    from splitserve.default_model import ensure_default_model
    from splitserve.launch.local import Cluster

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--faults", type=int, default=0, help="0: as many as fit the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dead-after", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    spec = ServeConfig.from_fields(
        model=str(ensure_default_model()), dtype="float32", port=args.port, num_prefill=2,
        num_decode=2, kv_cache_mb=48, threads_per_worker=1, dead_after_s=args.dead_after,
        transfer_timeout_s=30)
    with Cluster(spec) as cluster:
        deadline = time.monotonic() + 300
        while not healthy(spec.url) and time.monotonic() < deadline:
            time.sleep(1)
        report = run_soak(cluster, args.requests, args.concurrency,
                          args.faults or 10**6, args.seed)
        deadline = time.monotonic() + 120
        while not healthy(spec.url) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)
        report.pages_held = pages_held(spec.url)
    print(report.summary())


if __name__ == "__main__":
    main()
