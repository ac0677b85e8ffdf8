"""A running stream's largest inter-chunk gap while 4 MB request bodies arrive back to back
(issue 33, item 2), against the same stream with no bodies arriving, alternated in one run.

The API server is the real app (guard, 4 MiB body limit, request preparation on
``--prepare-threads`` threads) on a live uvicorn server with the default model's tokenizer; the
engine is the fake one paced at one token per ``--token-ms`` (the gap measured is the API
server's own, not a model's). Each round streams for a while idle, then while ``--bodies``
bodies of ~3.96 MB are posted back to back (each refused with 400 from its byte length).

    python bench/stream_gap.py --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import threading
import time

import httpx
from common import cpu_line, resolve_model

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.main import create_server
from splitserve.server.offload import Offload
from splitserve.server.routes import create_app

CONTEXT_LEN = 8192
BIG = "The quick brown fox jumps over the lazy dog. " * 88_000  # 3.96 MB


def serve(tokenizer, token_ms: float, threads: int) -> tuple[str, object]:
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id, reply="tick " * 50,
                            tokens_per_event=1, delay_s=token_ms / 1000)
    app = create_app(fake, tokenizer, "bench", CONTEXT_LEN, [tokenizer.eos_token_id],
                     offload=Offload(threads, 16 * threads))
    install_guard(app, None, 4 * 2**20)
    server = create_server(app, "127.0.0.1", 0, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def largest_gap(url: str, bodies: int, idle_s: float) -> float:
    """Stream; post ``bodies`` big bodies meanwhile (0: wait ``idle_s``); the largest gap
    between chunks while that went on."""
    arrivals: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}],
                "stream": True, "ignore_eos": True, "max_tokens": CONTEXT_LEN - 64}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    started.wait(60)
    begin = time.monotonic()
    if bodies:
        with httpx.Client(timeout=60) as client:
            for _ in range(bodies):
                r = client.post(url + "/v1/chat/completions", json={
                    "model": "bench", "messages": [{"role": "user", "content": BIG}]})
                assert r.status_code == 400, r.text[:200]
    else:
        time.sleep(idle_s)
    end = time.monotonic()
    stop.set()
    thread.join(60)
    window = [t for t in arrivals if t <= end]
    before = [t for t in window if t < begin]
    during = ([before[-1]] if before else []) + [t for t in window if t >= begin] + [end]
    return max(b - a for a, b in itertools.pairwise(during))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bodies", type=int, default=4)
    parser.add_argument("--token-ms", type=float, default=20.0)
    parser.add_argument("--prepare-threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    print(cpu_line(), f"| one token per {args.token_ms:g} ms, "
          f"{args.prepare_threads} prepare threads")
    url, server = serve(tokenizer, args.token_ms, args.prepare_threads)
    idle, loaded = [], []
    for _ in range(args.rounds):
        start = time.monotonic()
        loaded.append(largest_gap(url, args.bodies, 0))
        idle.append(largest_gap(url, 0, time.monotonic() - start))
    server.should_exit = True
    ms = [f"{g * 1000:.0f}" for g in loaded]
    print(f"largest gap idle: median {statistics.median(idle) * 1000:.0f} ms, max "
          f"{max(idle) * 1000:.0f} ms; with {args.bodies} x {len(BIG) / 1e6:.2f} MB bodies: "
          f"median {statistics.median(loaded) * 1000:.0f} ms, max {max(loaded) * 1000:.0f} ms "
          f"(rounds: {', '.join(ms)}); ratio of medians "
          f"{statistics.median(loaded) / statistics.median(idle):.2f}x")


if __name__ == "__main__":
    main()
