"""Twice the cluster's capacity: do urgent requests stay fast and does each tenant get its share?

Starts a small local cluster (colocated by default) with three API keys in an
``--api-key-file``: tenants ``a`` and ``b`` (weights from ``--weights``, default 2 and 1) and
``ops``, then, in one run:

1. **capacity**: ``--max-inflight`` closed-loop clients for ``--capacity-s`` seconds; C is the
   requests completed per second (each ``--output-len`` tokens, ``ignore_eos``).
2. **idle**: ``--probes`` urgent requests (``priority`` -1) one after another on the idle
   cluster: their TTFT is the reference.
3. **overload**: open-loop Poisson arrivals for ``--duration`` seconds, tenant ``a`` and ``b``
   each offering ``--offered`` times C (default 1.0 each: 2x the capacity in all), plus an
   urgent ``ops`` request every ``--probe-gap`` seconds, sent from a process of its own (the
   flood's client tasks would otherwise delay it in the bench's event loop). A 429 is an answer
   (with ``Retry-After``), not retried: open loop.

Printed: the urgent TTFT p50/p99 idle and under overload (ratio; the issue's goal 1.5x), each
tenant's goodput (requests completed per second inside the measured window, from
``--warmup`` s after the start to its end) against its **weighted max-min fair share** of C
(water-filling over the tenants' offered rates; goal within 20%), and the 5xx and lost
requests (a stream that ends without its tokens, a status other than 200/429; goal 0).

With ``--baseline`` (default on) the same overload runs a second time on a cluster started
with ``--no-fair-queueing`` and the probes at priority 0: what fair queueing and priority
change, measured in the same run. Request lengths are short (the prompt is one sentence and a
half with a number in front, so no two share a cached prefix beyond a few tokens).

    python bench/overload_priority.py                       # defaults: about 6 minutes
    python bench/overload_priority.py --duration 40 --no-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import multiprocessing
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import cpu_line, percentile, resolve_bench_dtype, resolve_model, write_results

from splitserve.server.sse import DONE, aiter_events

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b", "ops": "sk-bench-ops"}
# Ends mid-sentence, so the first token is text (" there"). Ending at the instruction, SmolLM2's
# first token is <|im_end|>, which a completion does not show: the first text came one decode
# step later, and under load that step counted in every "TTFT" (40-90 ms of it here).
PROMPT = "Write a short story about a lighthouse keeper and a storm. Once upon a time,"


@dataclass
class Outcome:
    """One request: ``status`` (200, 429, other; 0: the connection failed), its TTFT and end
    (seconds since the phase's start; None unless it streamed), whether every token came."""

    tenant: str
    sent_s: float
    status: int = 0
    ttft_s: float | None = None
    end_s: float | None = None
    complete: bool = False
    stages_ms: dict[str, float] | None = None  # the server's timing breakdown (urgent ones)


@dataclass
class Phase:
    outcomes: list[Outcome] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, tenant: str, n: int,
                      output_len: int, priority: int, t0: float) -> Outcome:
    """A streamed completion of ``output_len`` tokens for ``tenant``; times from ``t0``."""
    out = Outcome(tenant, time.monotonic() - t0)
    body = {"model": "default", "prompt": f"{n}. {PROMPT}", "max_tokens": output_len,
            "stream": True, "ignore_eos": True, "temperature": 0, "priority": priority}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if tenant == "ops":  # where an urgent request's time goes (docs/observability.md)
        headers["x-splitserve-timing"] = "1"
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return out
            async for chunk in aiter_events(r.aiter_lines()):
                if chunk == DONE:
                    break
                if "error" in chunk:
                    out.status = 500
                    return out
                if "splitserve_timing" in chunk:
                    timing = chunk["splitserve_timing"]
                    out.stages_ms = {**timing.get("stages_ms", {}),
                                     "ttft": timing.get("ttft_ms", 0.0)}
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text") and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0 - out.sent_s
                if choices and choices[0].get("finish_reason"):
                    out.complete = choices[0]["finish_reason"] == "length"
    except httpx.HTTPError:
        out.status = 0
    out.end_s = time.monotonic() - t0
    return out


def client(n: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n))


async def capacity(url: str, args: argparse.Namespace) -> float:
    """Requests per second completed by ``max_inflight`` closed-loop clients of tenant a (the
    first 20% of the time is warmup and not counted)."""
    t0 = time.monotonic()
    done: list[float] = []
    counter = iter(range(10**9))

    async def loop(c: httpx.AsyncClient) -> None:
        while time.monotonic() - t0 < args.capacity_s:
            o = await one_request(c, url, "a", next(counter), args.output_len, 0, t0)
            if o.complete and o.end_s is not None:
                done.append(o.end_s)

    async with client(args.max_inflight + 4) as c:
        await asyncio.gather(*(loop(c) for _ in range(args.max_inflight)))
    start = 0.2 * args.capacity_s
    counted = [t for t in done if start <= t <= args.capacity_s]
    return len(counted) / (args.capacity_s - start)


async def idle_probes(url: str, args: argparse.Namespace) -> list[Outcome]:
    """``--probes`` urgent requests sent one after another on the idle cluster."""
    outs = []
    async with client(4) as c:
        t0 = time.monotonic()
        for i in range(args.probes):
            outs.append(await one_request(c, url, "ops", 10**6 + i, args.output_len, -1, t0))
    return outs


def median_stages(outs: list[Outcome]) -> str:
    """The median of each timing stage up to the first token over ``outs``, in ms."""
    rows = [o.stages_ms for o in outs if o.stages_ms]
    names = ("server", "queue", "prefill", "ttft")
    return " ".join(f"{n} {percentile([r.get(n, 0.0) for r in rows], 50):.0f}" for n in names)


async def overload(url: str, rates: dict[str, float], start_at: float,
                   args: argparse.Namespace) -> Phase:
    """Open-loop Poisson arrivals at ``rates`` (requests/s per tenant) for ``--duration`` s
    from ``start_at`` (``time.monotonic``, the system's clock: the probes' process shares
    it)."""
    rng = random.Random(args.seed)
    phase = Phase()
    tasks: list[asyncio.Task] = []
    counter = iter(range(2 * 10**6, 10**9))
    async with client(4096) as c:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        t0 = start_at

        async def arrivals(tenant: str, rate: float) -> None:
            at = 0.0
            while True:
                at += rng.expovariate(rate)
                if at >= args.duration:
                    return
                await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
                tasks.append(asyncio.create_task(one_request(
                    c, url, tenant, next(counter), args.output_len, 0, t0)))

        await asyncio.gather(*(arrivals(t, r) for t, r in rates.items()))
        phase.outcomes = list(await asyncio.gather(*tasks))
    return phase


def niced_overload(url: str, rates: dict[str, float], start_at: float,
                   args: argparse.Namespace) -> Phase:
    """:func:`overload` in a process of its own at ``--client-nice`` (the load generator's
    CPU is not the cluster's: on a small host it competes with the workers for the cores)."""
    os.nice(args.client_nice)
    return asyncio.run(overload(url, rates, start_at, args))


def probes(url: str, start_at: float, priority: int, args: argparse.Namespace) -> list[Outcome]:
    """The ``ops`` probes, one every ``--probe-gap`` s from ``start_at`` for ``--duration`` s,
    each waited for; a turn that passes while the one before waits is skipped. Run in a process
    of its own: the flood's thousands of client tasks in the bench's event loop would delay the
    probes' own reads and count as server time."""

    async def run() -> list[Outcome]:
        outs = []
        async with client(8) as c:
            for k in range(int(args.duration / args.probe_gap)):
                at = start_at + k * args.probe_gap
                if time.monotonic() > at + args.probe_gap:
                    continue  # the last one took past this one's turn: no late probes
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                outs.append(await one_request(c, url, "ops", 10**8 + k, args.output_len,
                                              priority, start_at))
        return outs

    return asyncio.run(run())


def fair_shares(capacity: float, offered: dict[str, float],
                weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` (water-filling): a tenant offering less
    than its weighted part gets what it offers, the rest is shared by the others by weight."""
    share: dict[str, float] = {}
    left, active = capacity, dict(offered)
    while active:
        unit = left / sum(weights[t] for t in active)
        capped = {t: r for t, r in active.items() if r <= unit * weights[t]}
        if not capped:
            share.update({t: unit * weights[t] for t in active})
            break
        for t, r in capped.items():
            share[t] = r
            left -= r
            del active[t]
    return share


def summarize(name: str, phase: Phase, idle: list[Outcome], offered: dict[str, float],
              shares: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """Print and return the phase's figures against the goals."""
    window = (args.warmup, args.duration)
    span = window[1] - window[0]
    outs = phase.outcomes
    idle_ttft = [o.ttft_s for o in idle if o.ttft_s is not None]
    probes = [o for o in outs if o.tenant == "ops" and o.ttft_s is not None
              and window[0] <= o.sent_s <= window[1]]
    urgent = [o.ttft_s for o in probes if o.ttft_s is not None]
    idle99, load99 = percentile(idle_ttft, 99), percentile(urgent, 99)
    errors_5xx = sum(1 for o in outs if o.status >= 500)
    lost = sum(1 for o in outs if o.status not in (200, 429) or (o.status == 200
                                                                   and not o.complete))
    refused = {t: sum(1 for o in outs if o.tenant == t and o.status == 429) for t in KEYS}
    goodput = {t: sum(1 for o in outs if o.tenant == t and o.complete and o.end_s is not None
                      and window[0] <= o.end_s <= window[1]) / span for t in shares}
    ratio = {t: goodput[t] / shares[t] for t in shares}
    # The same shares of what the cluster delivered under overload (its HTTP work for the
    # refused requests takes CPU from the worker on a small host): fairness alone.
    delivered = fair_shares(sum(goodput.values()), offered,
                            {t: args.weights[t] for t in shares})
    ops_missing = collections.Counter(o.status for o in outs
                                      if o.tenant == "ops" and not o.complete)
    print(f"{name}: urgent TTFT p50/p99 {percentile(urgent, 50) * 1e3:.0f}/{load99 * 1e3:.0f} "
          f"ms (idle {percentile(idle_ttft, 50) * 1e3:.0f}/{idle99 * 1e3:.0f}): p99 "
          f"{load99 / idle99:.2f}x idle (goal <= 1.5x); {len(urgent)} urgent, "
          f"not served: {sum(ops_missing.values())} {dict(ops_missing)}", flush=True)
    slow = sorted(probes, key=lambda o: o.ttft_s or 0.0)[-max(1, len(probes) // 10):]
    print(f"  urgent stages to the first token, median ms: idle {median_stages(idle)}; "
          f"loaded {median_stages(probes)}; loaded, slowest tenth {median_stages(slow)}",
          flush=True)
    for t, share in shares.items():
        print(f"  tenant {t} (weight {args.weights[t]:g}): goodput {goodput[t]:.2f} req/s, "
              f"fair share {share:.2f}: {ratio[t]:.2f}x (goal 0.8..1.2x); of the delivered "
              f"{sum(goodput.values()):.2f} req/s: {goodput[t] / delivered[t]:.2f}x; "
              f"429s {refused[t]}", flush=True)
    print(f"  5xx {errors_5xx}, lost {lost} (goal 0, 0); requests {len(outs)}", flush=True)
    return {"urgent_ttft_s": urgent, "urgent_p99_ratio": load99 / idle99,
            "urgent_probes": [{"sent_s": o.sent_s, "ttft_s": o.ttft_s, "stages_ms": o.stages_ms}
                              for o in probes],
            "goodput": goodput, "fair_share": shares, "goodput_ratio": ratio,
            "refused": refused, "errors_5xx": errors_5xx, "lost": lost,
            "requests": len(outs)}


def run_cluster(fair: bool, model_path: str, keyfile: str,
                args: argparse.Namespace, c_req_s: float | None) -> dict[str, Any]:
    """Start a cluster (fair queueing on or off), measure what is asked, stop it."""
    from splitserve.config import ServeConfig
    from splitserve.ipc.sockets import free_tcp_addr
    from splitserve.launch.local import Cluster

    port = int(free_tcp_addr().rsplit(":", 1)[1])
    config = ServeConfig.from_fields(
        model=model_path, colocated=args.mode == "colocated", port=port, dtype=args.dtype,
        max_inflight_per_worker=args.max_inflight, max_queued_per_worker=args.max_queued,
        fair_queueing=fair, api_key_file=keyfile, chunked_prefill_size=args.chunked_prefill_size,
        threads_per_worker=args.threads_per_worker, interrupt_steps=args.interrupt_steps,
        **({"max_batch_tokens": args.max_batch_tokens} if args.max_batch_tokens else {}))
    print(f"starting a {args.mode} cluster, fair queueing {'on' if fair else 'off'} ...",
          flush=True)
    result: dict[str, Any] = {"fair": fair}
    cluster = Cluster(config)
    try:
        cluster.start(timeout_s=args.start_timeout)
        url = config.url
        if c_req_s is None:
            asyncio.run(idle_probes(url, args))  # warm the kernels and the compile cache
            c_req_s = asyncio.run(capacity(url, args))
            print(f"capacity: {c_req_s:.2f} req/s with {args.max_inflight} in flight",
                  flush=True)
        result["capacity_req_s"] = c_req_s
        idle = asyncio.run(idle_probes(url, args))
        result["idle_ttft_s"] = [o.ttft_s for o in idle]
        rates = {t: args.offered[t] * c_req_s for t in ("a", "b")}
        probe_priority = -1 if fair else 0
        start_at = time.monotonic() + 5.0  # the probes' process is started by then
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:
            probed = pool.submit(probes, url, start_at, probe_priority, args)
            if args.client_nice:
                phase = pool.submit(niced_overload, url, rates, start_at, args).result()
            else:
                phase = asyncio.run(overload(url, rates, start_at, args))
            phase.outcomes += probed.result()
        cluster.check_alive()
    finally:
        cluster.stop()
    shares = fair_shares(c_req_s - 1 / args.probe_gap, rates,
                         {t: args.weights[t] for t in rates})
    name = ("fair queueing + priority" if fair else
            "baseline (first come, first served; probes at priority 0)")
    result.update(summarize(name, phase, idle, rates, shares, args))
    return result


def parse_pairs(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (p.split("=") for p in text.split(","))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--max-inflight", type=int, default=16, help="--max-inflight-per-worker")
    p.add_argument("--max-queued", type=int, default=32, help="--max-queued-per-worker")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--chunked-prefill-size", type=int, default=0, help="the workers' "
                   "--chunked-prefill-size (0: their default)")
    p.add_argument("--max-batch-tokens", type=int, default=0, help="the workers' "
                   "--max-batch-tokens (0: their default); bounds steps with no decode row too")
    p.add_argument("--threads-per-worker", type=int, default=0, help="the workers' "
                   "--threads-per-worker (0: split the cores)")
    p.add_argument("--interrupt-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="the workers' --no-interrupt-steps when off")
    p.add_argument("--client-nice", type=int, default=0, help="run the flood's client in a "
                   "process of its own at this niceness (0: in the bench's own process)")
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--probe-gap", type=float, default=1.0, help="seconds between urgent probes")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of overload")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of overload before the "
                   "measured window")
    p.add_argument("--offered", type=parse_pairs, default=parse_pairs("a=1.0,b=1.0"),
                   help="each tenant's offered rate, in multiples of the capacity")
    p.add_argument("--weights", type=parse_pairs, default=parse_pairs("a=2,b=1"))
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.weights.setdefault("ops", 1.0)
    model_path = resolve_model(args.model)
    args.dtype, why = resolve_bench_dtype(args.dtype)
    print(f"CPU: {cpu_line()} | load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{args.mode}, dtype {args.dtype} ({why}); {args.max_inflight} in flight + "
          f"{args.max_queued} queued per worker; {args.output_len} tokens each; "
          f"--chunked-prefill-size {args.chunked_prefill_size}; offered "
          f"{args.offered} x capacity, weights {args.weights}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = str(Path(tmp) / "keys")
        Path(keyfile).write_text("".join(
            f"{key} {t} {args.weights[t]:g}\n" for t, key in KEYS.items()))
        results = [run_cluster(True, model_path, keyfile, args, None)]
        if args.baseline:
            results.append(run_cluster(False, model_path, keyfile, args,
                                       results[0]["capacity_req_s"]))
    if args.out:
        write_results(args.out, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
