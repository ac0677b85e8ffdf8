"""Prefill/decode interference: steady decode streams while long prompts keep arriving, through a
colocated worker and through 1 prefill + 1 decode worker pinned to separate cores.

Each mode runs two phases of ``--duration`` seconds: *decode-only* (``--streams`` closed-loop
clients, each sending short ShareGPT prompts for ``--stream-output-len`` tokens, one after the
other) and *mixed* (the same streams plus long random prompts of ``--long-input-len`` tokens
arriving as a Poisson process at ``--long-rate`` per second, ``--long-output-len`` tokens each).
Reported per mode: the streams' ITL p50/p99 in both phases, the long prompts' TTFT, and goodput
(requests per second of the mixed phase that met every ``--slo``; ``itl`` is a request's largest
gap). Goals (issue 8): disaggregated mixed ITL p99 <= 1.5x its decode-only ITL p99, and
disaggregated goodput >= 2x colocated.

    python bench/interference.py                                  # 2 x 2 phases of 60 s
    python bench/interference.py --duration 30 --out bench/results/interference
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import (
    add_data_argument,
    launch_cluster,
    load_prompts,
    percentile,
    random_prompts,
    resolve_bench_dtype,
    resolve_model,
)
from serving import Target, Workload, first_model, poisson_starts, send_request
from serving_metrics import RequestOutput, meets_slos, parse_slos

MODES = {
    # name: (cluster mode, CPU affinity, threads per worker)
    "colocated": ("colocated", "colocated=0-1", 2),
    "disaggregated": ("disaggregated", "prefill=0 decode=1", 1),
}


async def run_phase(
    target: Target,
    streams: list[Workload],
    longs: list[Workload],
    num_streams: int,
    long_rate: float,
    duration: float,
    seed: int,
) -> tuple[list[RequestOutput], list[RequestOutput], float]:
    """Closed-loop streams (and Poisson long prompts when ``long_rate`` > 0) until ``duration``
    has passed; requests in flight then still finish. Returns stream outputs, long outputs and
    the wall time."""
    limits = httpx.Limits(max_connections=num_streams + 64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + duration

        async def stream_loop(i: int) -> list[RequestOutput]:
            outs, j = [], i
            while time.perf_counter() < deadline:
                outs.append(await send_request(client, target, streams[j % len(streams)], t0))
                j += num_streams
            return outs

        async def long_arrivals() -> list[RequestOutput]:
            if long_rate <= 0:
                return []
            starts = [s for s in poisson_starts(100_000, long_rate, seed) if s < duration]
            tasks = []
            for k, at in enumerate(starts):
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                work = longs[k % len(longs)]
                tasks.append(asyncio.create_task(send_request(client, target, work, t0)))
            return list(await asyncio.gather(*tasks))

        results = await asyncio.gather(
            *(stream_loop(i) for i in range(num_streams)), long_arrivals()
        )
        wall = time.perf_counter() - t0
    stream_outs = [o for outs in results[:-1] for o in outs]
    return stream_outs, results[-1], wall


# (TTFT ms, largest-gap ITL ms) pairs whose goodput is reported besides --slo's: the goodput
# ratio depends on the SLO (a loose TTFT favours the disaggregated cluster, whose one prefill
# core queues long prompts; a tight ITL favours it too, as its decode steps never wait on a
# prefill chunk), so one pair alone says little.
SLO_GRID = [(t, i) for t in (2000, 5000, 10000) for i in (100, 200, 500)]


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3 if values else float("nan")


def phase_summary(
    streams: list[RequestOutput], longs: list[RequestOutput], wall: float, slos: dict[str, float]
) -> dict[str, Any]:
    everything = streams + longs
    itls = [x for o in streams if o.ok for x in o.itls]
    long_ttft = [o.ttft for o in longs if o.ok]
    good = sum(meets_slos(o, slos) for o in everything)
    return {
        "duration_s": wall,
        "stream_requests": len(streams),
        "long_requests": len(longs),
        "failed": sum(not o.ok for o in everything),
        "errors": sorted({o.error for o in everything if o.error})[:3],
        "stream_itl_p50_ms": ms(itls, 50),
        "stream_itl_p99_ms": ms(itls, 99),
        "stream_itl_max_ms": max(itls, default=float("nan")) * 1e3,
        "stream_output_tok_s": sum(o.output_tokens for o in streams if o.ok) / wall,
        "long_ttft_p50_ms": ms(long_ttft, 50),
        "long_ttft_p99_ms": ms(long_ttft, 99),
        "goodput": good / wall,
        "good_fraction": good / len(everything) if everything else 0.0,
        # Goodput under every SLO pair of the grid, from the same requests.
        "goodput_grid": {
            f"ttft:{t:g} itl:{i:g}": sum(
                meets_slos(o, {"ttft": t / 1e3, "itl": i / 1e3}) for o in everything
            ) / wall
            for t, i in SLO_GRID
        },
    }


def run_mode(
    name: str,
    args: argparse.Namespace,
    streams: list[Workload],
    longs: list[Workload],
    slos: dict[str, float],
) -> dict[str, Any]:
    mode, affinity, threads = MODES[name]
    if name == "colocated" and args.colocated_threads:
        threads = args.colocated_threads
    kw = {
        "cpu_affinity": args.cpu_affinity.get(name, affinity),
        "threads_per_worker": threads,
        "max_batch_tokens": args.max_batch_tokens,
        "max_running": 64,
    }
    result: dict[str, Any] = {"mode": name, "cpu_affinity": kw["cpu_affinity"]}
    with launch_cluster(mode, args.model_path, args.dtype, **kw) as url:
        target = Target(f"splitserve {name}", url, first_model(url))
        short = [Workload(w.prompt, w.prompt_len, 8, "warm-up") for w in streams[:2]]
        warm, _, _ = asyncio.run(run_phase(target, short, [], 2, 0, 0.1, 0))
        if any(not o.ok for o in warm):
            raise SystemExit(f"{name}: warm-up failed: {[o.error for o in warm if o.error]}")
        for phase, rate in (("decode_only", 0.0), ("mixed", args.long_rate)):
            print(f"  {name}: {phase} phase, {args.duration:g} s ...", flush=True)
            s_outs, l_outs, wall = asyncio.run(
                run_phase(target, streams, longs, args.streams, rate, args.duration, args.seed)
            )
            result[phase] = phase_summary(s_outs, l_outs, wall, slos)
            p = result[phase]
            print(
                f"    stream ITL p50 {p['stream_itl_p50_ms']:.1f} ms p99 "
                f"{p['stream_itl_p99_ms']:.1f} ms max {p['stream_itl_max_ms']:.0f} ms; "
                f"{p['stream_output_tok_s']:.1f} stream tok/s; long prompts "
                f"{p['long_requests']} (TTFT p50 {p['long_ttft_p50_ms']:.0f} ms); goodput "
                f"{p['goodput']:.3f} req/s ({p['good_fraction']:.0%} good)"
                + (f"; {p['failed']} FAILED {p['errors']}" if p["failed"] else ""),
                flush=True,
            )
    d, m = result["decode_only"], result["mixed"]
    result["itl_p99_ratio"] = m["stream_itl_p99_ms"] / d["stream_itl_p99_ms"]
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    header = (
        f"{'mode':<15}{'ITL p99 dec-only':>18}{'ITL p99 mixed':>15}{'ratio':>7}"
        f"{'long TTFT p50':>15}{'goodput req/s':>15}{'good %':>8}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        d, m = r["decode_only"], r["mixed"]
        print(
            f"{r['mode']:<15}{d['stream_itl_p99_ms']:>18.1f}{m['stream_itl_p99_ms']:>15.1f}"
            f"{r['itl_p99_ratio']:>6.2f}x{m['long_ttft_p50_ms']:>15.0f}{m['goodput']:>15.3f}"
            f"{m['good_fraction']:>8.0%}"
        )
    by = {r["mode"]: r for r in results}
    if "disaggregated" in by:
        ratio = by["disaggregated"]["itl_p99_ratio"]
        print(f"disaggregated ITL p99 mixed / decode-only: {ratio:.2f}x (goal <= 1.5x)")
    if "disaggregated" in by and "colocated" in by:
        g_d, g_c = by["disaggregated"]["mixed"]["goodput"], by["colocated"]["mixed"]["goodput"]
        print(
            f"goodput disaggregated / colocated: "
            f"{g_d / g_c if g_c else float('inf'):.2f}x (goal >= 2x)"
        )
        grid_d = by["disaggregated"]["mixed"]["goodput_grid"]
        grid_c = by["colocated"]["mixed"]["goodput_grid"]
        print("goodput (req/s) disaggregated / colocated under other SLOs:")
        for key, g_d in grid_d.items():
            g_c = grid_c[key]
            ratio = f"{g_d / g_c:.2f}x" if g_c else ("inf" if g_d else "-")
            print(f"  {key:<22} {g_d:6.3f} / {g_c:6.3f}  {ratio}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument(
        "--cpu-affinity",
        nargs="*",
        default=[],
        metavar="MODE=SPEC",
        help="override a mode's pinning, e.g. 'disaggregated=prefill=0 decode=1'",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="token budget per step (the colocated worker's prefill chunk size)",
    )
    p.add_argument(
        "--colocated-threads",
        type=int,
        default=0,
        help="threads of the colocated worker (default 2; on a machine loaded by "
        "other work, 2 spinning OpenMP threads stall badly: try 1)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-input-len", type=int, default=128)
    p.add_argument("--stream-output-len", type=int, default=256)
    p.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second")
    p.add_argument("--long-input-len", type=int, default=1536)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--slo", nargs="*", default=["ttft:5000", "itl:500"], metavar="KIND:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    add_data_argument(p)
    args = p.parse_args(argv)
    args.cpu_affinity = dict(item.split("=", 1) for item in args.cpu_affinity)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    args.model_path = resolve_model(args.model)
    args.dtype, why = resolve_bench_dtype(args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    slos = parse_slos(args.slo)
    streams = [
        Workload(ids, len(ids), args.stream_output_len, "stream")
        for ids in load_prompts(tok, 64, args.stream_input_len, data=args.data)
    ]
    longs = [
        Workload(ids, len(ids), args.long_output_len, "long")
        for ids in random_prompts(tok, 16, args.long_input_len, args.seed)
    ]
    print(
        f"dtype {args.dtype} ({why}); {args.streams} streams x {args.stream_output_len} tokens; "
        f"long prompts {args.long_input_len} tokens at {args.long_rate:g}/s; SLOs {args.slo}",
        flush=True,
    )
    results = [run_mode(m, args, streams, longs, slos) for m in args.modes]
    print_table(results)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out / "interference.json").write_text(
            json.dumps({"config": config, "results": results}, indent=2)
        )
        print(f"results in {args.out / 'interference.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
