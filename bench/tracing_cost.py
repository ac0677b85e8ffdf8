"""What tracing costs: a disaggregated cluster (1 prefill + 1 decode) with tracing off and with
it on (every request sampled, spans exported over OTLP/HTTP to a receiver in this process),
at concurrency 1 and 32, in one run.

The two clusters are launched in turn, ``--rounds`` times (off, on, off, on...), so a machine
whose speed drifts disturbs both alike; each round sends the same prompts (``ignore_eos``,
greedy, ``--output-len`` tokens) at each concurrency and reads the output tokens/s and the
mean inter-token latency (the decode step time as a client sees it) from the answers'
timing breakdown. Printed: every round, then on/off ratios with their spread (min..max over
rounds).

Tracing off must cost nothing on the hot path: what still runs per step is the stage stamps
(``worker.tracing.stamp_step``), timed here directly on a step of 32 rows against the
measured step time. ``--waterfall FILE`` also writes one traced request's spans as an HTML
waterfall (the picture in docs/observability.md).

    python bench/tracing_cost.py                       # 2 rounds, c=1 and c=32, 32 tokens
    python bench/tracing_cost.py --rounds 3 --waterfall /tmp/trace.html
"""

from __future__ import annotations

import argparse
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


def one(url: str, prompt: str, output_len: int) -> tuple[float, int, float]:
    """``(seconds, output tokens, summed decode stage)`` of one non-streamed completion."""
    body = {"model": "default", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600,
                   headers={"x-splitserve-timing": "1"})
    r.raise_for_status()
    out = r.json()
    steps = out["splitserve_timing"].get("decode_steps", 0)
    decode_ms = out["splitserve_timing"]["stages_ms"].get("decode", 0.0)
    return time.perf_counter() - start, out["usage"]["completion_tokens"], \
        decode_ms / 1e3 / max(1, steps)


def measure(url: str, concurrency: int, output_len: int) -> dict[str, float]:
    prompts = PROMPTS[:max(concurrency, 4)]
    one(url, "warm up", 4)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(url, p, output_len), prompts))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--waterfall", default=None, help="write one trace's waterfall (HTML) here")
    args = ap.parse_args()
    model = resolve_model(args.model)
    dtype, why = default_dtype()
    print(f"CPU: {cpu_line()}; dtype {dtype} ({why}); {time.strftime('%Y-%m-%d %H:%M')}")
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    with OTLPReceiver() as receiver:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                fields = {"threads_per_worker": 1, "kv_cache_mb": 256}
                if mode == "on":
                    fields["otlp_traces_endpoint"] = receiver.endpoint
                with launch_cluster("disaggregated", model, dtype, **fields) as url:
                    for c in args.concurrency:
                        m = measure(url, c, args.output_len)
                        rows.setdefault((mode, c), []).append(m)
                        print(f"round {rnd} tracing {mode:3s} c={c:<3d} "
                              f"{m['tok_s']:7.1f} tok/s  step {m['step_ms']:6.1f} ms", flush=True)
                    if mode == "on" and args.waterfall and rnd == 0:
                        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                            "model": "default", "max_tokens": 16, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name three colors."}]})
                        trace_id = r.headers["x-trace-id"]
                        receiver.wait_for(lambda s, t=trace_id: {"prefill", "decode"} <= {
                            x.name for x in s if x.trace_id == t})
                        time.sleep(1.0)  # the prefill worker's last spans (kv_send) follow
                        Path(args.waterfall).write_text(waterfall_html(
                            receiver.trace(trace_id), "one disaggregated chat completion"))
        print(f"spans received: {len(receiver.spans)}")
    print("\ntracing on / off (mean over rounds; min..max of the per-round ratios):")
    for c in args.concurrency:
        for key, label in (("tok_s", "output tok/s"), ("step_ms", "decode step")):
            ratios = [on[key] / off[key] for on, off in zip(rows[("on", c)], rows[("off", c)])]
            off_mean = statistics.mean(x[key] for x in rows[("off", c)])
            on_mean = statistics.mean(x[key] for x in rows[("on", c)])
            print(f"c={c:<3d} {label:13s} off {off_mean:8.2f}  on {on_mean:8.2f}  "
                  f"ratio {statistics.mean(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    step_ms = statistics.mean(x["step_ms"] for x in rows[("off", max(args.concurrency))])
    cost = stamp_cost_us()
    print(f"\ntracing off, per step: stage stamps of 32 rows {cost:.1f} us = "
          f"{cost / 1e3 / step_ms:.4%} of the {step_ms:.1f} ms step at c={max(args.concurrency)}")


if __name__ == "__main__":
    main()
