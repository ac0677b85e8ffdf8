"""What tracing costs: a disaggregated cluster (1 prefill + 1 decode) serving the same batches
traced and untraced, at concurrency 1 and 32, in one run.

On a shared machine whose speed drifts by 2x from minute to minute, two clusters measured one
after the other compare the machine's load more than tracing. So the main figure comes from one
cluster launched with tracing configured (spans exported over OTLP/HTTP to a receiver in this
script) and ``--trace-sample-ratio 0``: a batch whose requests carry a sampled ``traceparent``
header is traced end to end (router, prefill and decode spans exported), a batch without one is
not; the two alternate, ``--rounds`` times per concurrency, so both see the same load. Read
from each batch: output tokens/s, and the decode step time (the answers' timing breakdown:
decode stage / decode steps). Printed: every batch, then traced/untraced ratios, mean and
min..max over the rounds.

Then ``--off-rounds`` more rounds alternate a cluster launched with tracing off (no endpoint:
nothing of the OpenTelemetry SDK loaded) with the traced one, launch by launch: the "off"
baseline itself, noisier. What tracing off still runs per step (the stage stamps,
``worker.tracing.stamp_step``) is timed directly on a step of 32 rows. ``--waterfall FILE``
writes one traced request's spans as an HTML waterfall (docs/trace.png is its screenshot).

    python bench/tracing_cost.py                       # 4 rounds, c=1 and c=32, 32 tokens
    python bench/tracing_cost.py --rounds 6 --off-rounds 1 --waterfall /tmp/trace.html
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import cpu_line, default_dtype, launch_cluster, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.otlp_receiver import OTLPReceiver, waterfall_html

PROMPTS = [f"Request {i}: write about the history of {topic}." for i, topic in enumerate(
    ["printing", "sailing", "bridges", "maps", "clocks", "bread", "glass", "paper"] * 4)]


def one(url: str, prompt: str, output_len: int, traced: bool) -> tuple[float, int, float]:
    """``(seconds, output tokens, decode seconds per step)`` of one non-streamed completion;
    ``traced``: sent with a sampled ``traceparent`` of its own."""
    body = {"model": "default", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True}
    headers = {"x-splitserve-timing": "1"}
    if traced:
        headers["traceparent"] = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600, headers=headers)
    r.raise_for_status()
    out = r.json()
    steps = out["splitserve_timing"].get("decode_steps", 0)
    decode_ms = out["splitserve_timing"]["stages_ms"].get("decode", 0.0)
    return time.perf_counter() - start, out["usage"]["completion_tokens"], \
        decode_ms / 1e3 / max(1, steps)


def measure(url: str, concurrency: int, output_len: int, traced: bool) -> dict[str, float]:
    """One batch: ``max(concurrency, 4)`` prompts, ``concurrency`` at a time."""
    prompts = PROMPTS[:max(concurrency, 4)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(url, p, output_len, traced), prompts))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n, _ in results)
    return {"tok_s": tokens / wall, "step_ms": 1e3 * statistics.mean(s for *_, s in results)}


def stamp_cost_us(rows: int = 32, repeat: int = 20000) -> float:
    """Microseconds one ``stamp_step`` takes on a decode step of ``rows`` rows (tracing off)."""
    from splitserve.engine.sched.batch import ScheduledBatch
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from splitserve.worker.tracing import stamp_step

    reqs = [Req(rid=str(i), input_ids=[1, 2, 3], sampling=SamplingParams()) for i in range(rows)]
    for r in reqs:
        r.stamps.first_token = 1.0
    batch = ScheduledBatch(reqs, [1] * rows, list(range(rows)))
    start = time.perf_counter()
    for _ in range(repeat):
        stamp_step(batch, 0.0, 0.0, None)
    return (time.perf_counter() - start) / repeat * 1e6


def report(rows: dict[tuple[str, int], list[dict[str, float]]], a: str, b: str,
           concurrency: list[int]) -> None:
    """``a`` / ``b`` ratios per concurrency: mean and min..max over the paired rounds."""
    for c in concurrency:
        for key, label in (("tok_s", "output tok/s"), ("step_ms", "decode step ms")):
            ratios = [x[key] / y[key] for x, y in zip(rows[(a, c)], rows[(b, c)])]
            mean_a = statistics.mean(x[key] for x in rows[(a, c)])
            mean_b = statistics.mean(x[key] for x in rows[(b, c)])
            print(f"c={c:<3d} {label:15s} {b} {mean_b:8.2f}  {a} {mean_a:8.2f}  ratio "
                  f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f}), "
                  f"{len(ratios)} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--off-rounds", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--waterfall", default=None, help="write one trace's waterfall (HTML) here")
    args = ap.parse_args()
    model = resolve_model(args.model)
    dtype, why = default_dtype()
    print(f"CPU: {cpu_line()}; dtype {dtype} ({why}); {time.strftime('%Y-%m-%d %H:%M')}")
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    base = {"threads_per_worker": 1, "kv_cache_mb": 256}

    def run(url: str, mode: str, c: int, rnd: int) -> None:
        m = measure(url, c, args.output_len, traced=mode != "untraced" and mode != "off")
        rows.setdefault((mode, c), []).append(m)
        print(f"round {rnd} {mode:9s} c={c:<3d} {m['tok_s']:7.1f} tok/s  "
              f"step {m['step_ms']:6.1f} ms", flush=True)

    with OTLPReceiver() as receiver:
        traced_cluster = {**base, "otlp_traces_endpoint": receiver.endpoint,
                          "sample_ratio": 0.0}
        with launch_cluster("disaggregated", model, dtype, **traced_cluster) as url:
            one(url, "warm up", 4, False)
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    order = ("traced", "untraced") if rnd % 2 else ("untraced", "traced")
                    for mode in order:
                        run(url, mode, c, rnd)
            if args.waterfall:
                r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                    "model": "default", "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": "Name three colors."}]},
                    headers={"traceparent": f"00-{secrets.token_hex(16)}-"
                                            f"{secrets.token_hex(8)}-01"})
                trace_id = r.headers["x-trace-id"]
                receiver.wait_for(lambda s, t=trace_id: {"prefill", "decode", "kv_send"} <= {
                    x.name for x in s if x.trace_id == t})
                Path(args.waterfall).write_text(waterfall_html(
                    receiver.trace(trace_id), "one disaggregated chat completion"))
        for rnd in range(args.off_rounds):
            for mode in ("off", "on"):
                fields = base if mode == "off" else {**traced_cluster, "sample_ratio": 1.0}
                with launch_cluster("disaggregated", model, dtype, **fields) as url:
                    one(url, "warm up", 4, False)
                    for c in args.concurrency:
                        run(url, mode, c, rnd)
        print(f"spans received: {len(receiver.spans)}")
    print("\ntraced / untraced batches, one cluster, alternating:")
    report(rows, "traced", "untraced", args.concurrency)
    if args.off_rounds:
        print("\ntracing on (every request) / off (no endpoint), one cluster each, in turn:")
        report(rows, "on", "off", args.concurrency)
    step_ms = statistics.mean(x["step_ms"] for x in rows[("untraced", max(args.concurrency))])
    cost = stamp_cost_us()
    print(f"\nper step with tracing off: the stage stamps of 32 rows take {cost:.1f} us, "
          f"{cost / 1e3 / step_ms:.4%} of the {step_ms:.1f} ms step at c={max(args.concurrency)}")


if __name__ == "__main__":
    main()
