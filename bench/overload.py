"""Overload with two tenants: one floods, one sends a trickle. What does the trickle wait?

Starts a small local splitserve cluster twice (colocated by default), with two API keys in an
``--api-key-file`` (tenants ``flood`` and ``trickle``), a low ``--max-inflight-per-worker`` and
``--max-queued-per-worker``: once with fair queueing (deficit round robin over tenants,
``server.fair_queue``) and once without it (first come, first served), the baseline of the
same run. In each, ``--flood-clients`` closed-loop clients of the flood tenant send requests
back to back (on a 429 each waits the ``Retry-After`` it was given, as the OpenAI client does),
keeping the router's queue full; once they are going, the trickle tenant sends
``--trickle-requests`` requests one after the other, ``--trickle-gap`` seconds apart, each
retried after the ``Retry-After`` of a 429 (up to ``--trickle-retries`` times, as a client
would), its TTFT counted from its first try.

Printed per mode: the trickle's TTFT p50/p99 (streamed ``/v1/completions``, ``--output-len``
tokens each with ``ignore_eos``; a request that never got through counts as infinite), and the
429s each tenant got, with the Retry-After values seen; then the ratio of the trickle's TTFT without fairness to with it. The CPU model and flags
head the output, as in the other benches. Wall-clock numbers: on a machine shared with other
work they move with its load.

    python bench/overload.py                                        # defaults: a few minutes
    python bench/overload.py --trickle-requests 6 --flood-clients 10 --output-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import cpu_line, resolve_bench_dtype, resolve_model, write_results

from splitserve.server.sse import DONE, aiter_events

KEYS = {"flood": "sk-bench-flood", "trickle": "sk-bench-trickle"}
PROMPT = "Write a short story about a lighthouse keeper and a storm."


async def one_request(client: httpx.AsyncClient, url: str, key: str, output_len: int,
                      since: float | None = None) -> tuple[int, float | None, float | None]:
    """One streamed completion: ``(status, ttft_s, retry_after_s)``; TTFT (from ``since``,
    default now) None unless 200."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0}
    start = time.perf_counter() if since is None else since
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            ms = r.headers.get("retry-after-ms")
            retry = float(ms) / 1000 if ms else float(r.headers.get("retry-after", "1"))
            return r.status_code, None, retry
        async for chunk in aiter_events(r.aiter_lines()):
            if chunk == DONE:
                break
            if "error" in chunk:
                return 500, None, None
            choices = chunk.get("choices") or []
            if ttft is None and choices and choices[0].get("text"):
                ttft = time.perf_counter() - start
    return 200, ttft, None


async def run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The flood and the trickle against ``url``; what each got."""
    stats: dict[str, Any] = {t: {"ok": 0, "429": 0, "other": 0, "retry_after": []} for t in KEYS}
    trickle_ttft: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.flood_clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        def note(tenant: str, status: int, retry: float | None) -> None:
            s = stats[tenant]
            key = "ok" if status == 200 else "429" if status == 429 else "other"
            s[key] += 1
            if retry is not None and status == 429:
                s["retry_after"].append(retry)

        async def flood() -> None:
            while not stop.is_set():
                status, _, retry = await one_request(client, url, KEYS["flood"], args.output_len)
                note("flood", status, retry)
                if status == 429:  # wait what we were told (or until the run ends)
                    try:
                        await asyncio.wait_for(stop.wait(), retry or 1.0)
                    except TimeoutError:
                        pass

        floods = [asyncio.create_task(flood()) for _ in range(args.flood_clients)]
        await asyncio.sleep(args.warmup)  # the flood fills the slots and the queue
        for _ in range(args.trickle_requests):
            first_try = time.perf_counter()
            for _ in range(args.trickle_retries + 1):
                status, ttft, retry = await one_request(client, url, KEYS["trickle"],
                                                        args.output_len, since=first_try)
                note("trickle", status, retry)
                if status != 429:
                    break
                await asyncio.sleep(retry or 1.0)
            trickle_ttft.append(float("inf") if ttft is None else ttft)  # inf: never got in
            await asyncio.sleep(args.trickle_gap)
        stop.set()
        await asyncio.gather(*floods)
    return {"trickle_ttft_s": trickle_ttft, "tenants": stats}


def run_mode(fair: bool, model_path: str, keyfile: str, args: argparse.Namespace) -> dict:
    """Launch a cluster with fair queueing on or off, run the load, and stop it."""
    from splitserve.config import ServeConfig
    from splitserve.ipc.sockets import free_tcp_addr
    from splitserve.launch.local import Cluster

    port = int(free_tcp_addr().rsplit(":", 1)[1])
    config = ServeConfig.from_fields(
        model=model_path, colocated=args.mode == "colocated", port=port, dtype=args.dtype,
        max_inflight_per_worker=args.max_inflight, max_queued_per_worker=args.max_queued,
        fair_queueing=fair, api_key_file=keyfile, kv_cache_mb=64,
        threads_per_worker=args.threads)
    print(f"starting a {args.mode} cluster, fair queueing {'on' if fair else 'off'} ...",
          flush=True)
    cluster = Cluster(config)
    try:
        cluster.start(timeout_s=args.start_timeout)  # a loaded machine starts slowly
        result = asyncio.run(run_load(config.url, args))
        cluster.check_alive()
    finally:
        cluster.stop()
    result["fair"] = fair
    print(summary(result), flush=True)
    return result


def rank_percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..100) of ``values``, which may hold ``inf`` (a
    request that never got in); NaN for none."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def ms(seconds: float) -> str:
    return "never" if seconds == float("inf") else f"{seconds * 1e3:.0f} ms"


def summary(result: dict) -> str:
    ttft = result["trickle_ttft_s"]
    t = result["tenants"]
    retry = t["flood"]["retry_after"]
    retry_text = (f"Retry-After {min(retry):.1f}..{max(retry):.1f} s" if retry else "none")
    return (f"{'fair (DRR)' if result['fair'] else 'FIFO      '} | trickle TTFT p50 "
            f"{ms(rank_percentile(ttft, 50))}, p99 {ms(rank_percentile(ttft, 99))} "
            f"({sum(x != float('inf') for x in ttft)} of {len(ttft)} got in) | 429s: flood {t['flood']['429']} of "
            f"{t['flood']['429'] + t['flood']['ok'] + t['flood']['other']} ({retry_text}), "
            f"trickle {t['trickle']['429']} | other errors {t['flood']['other'] + t['trickle']['other']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a cluster may "
                   "take to start")
    p.add_argument("--max-inflight", type=int, default=2, help="--max-inflight-per-worker")
    p.add_argument("--max-queued", type=int, default=8, help="--max-queued-per-worker")
    p.add_argument("--flood-clients", type=int, default=16)
    p.add_argument("--trickle-requests", type=int, default=10)
    p.add_argument("--trickle-gap", type=float, default=0.5, help="seconds between trickles")
    p.add_argument("--trickle-retries", type=int, default=5, help="tries after a 429")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of flood before the "
                   "trickle starts")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    model_path = resolve_model(args.model)
    args.dtype, why = resolve_bench_dtype(args.dtype)
    print(f"CPU: {cpu_line()} | load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{args.mode}, dtype {args.dtype} ({why}); {args.max_inflight} in flight + "
          f"{args.max_queued} queued per worker; flood: {args.flood_clients} clients; trickle: "
          f"{args.trickle_requests} requests {args.trickle_gap:g} s apart; "
          f"{args.output_len} tokens each", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = str(Path(tmp) / "keys")
        Path(keyfile).write_text("".join(f"{key} {t}\n" for t, key in KEYS.items()))
        results = [run_mode(fair, model_path, keyfile, args) for fair in (False, True)]
    fifo, fair = (r["trickle_ttft_s"] for r in results)
    print("trickle TTFT, FIFO / fair: " + ", ".join(
        f"p{q} {rank_percentile(fifo, q) / rank_percentile(fair, q):.1f}x" for q in (50, 99)))
    if args.out:
        write_results(args.out, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
