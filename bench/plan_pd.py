"""Capacity planner: how many prefill and decode workers (or colocated ones) serve a workload at
the most goodput under TTFT and ITL SLOs, from step costs measured on this machine (DistServe's
placement question, answered by simulation: ``pd_sim``).

    # 1. measure the engine's step costs here, at 1 and 2 threads per worker (~2 minutes, once)
    python bench/plan_pd.py measure --threads 1 2 --out bench/results/pd_profile.json
    # 2. plan: every split of 4 cores, ShareGPT-like requests, SLOs TTFT 2 s / ITL 200 ms
    python bench/plan_pd.py plan --profile bench/results/pd_profile.json --cores 4 \\
        --workload sharegpt --slo ttft:2000 itl:200
    # 3. calibrate the serving overhead (HTTP, streaming, handshake) on closed-loop runs of the
    #    real server at two concurrencies, per mode; it is written into the profile
    python bench/serving.py --launch colocated --concurrency 1 8 --num-prompts 32 \\
        --output-len 128 --out bench/results/calib
    python bench/plan_pd.py calibrate --profile bench/results/pd_profile.json \\
        --results bench/results/calib/results.json
    # 4. check the model against other runs of bench/serving.py (--request-rate or closed loop)
    python bench/plan_pd.py compare --profile bench/results/pd_profile.json \\
        --results bench/results/<run>/results.json

``plan`` reports, for each cluster shape, the largest Poisson request rate at which at least
``--attainment`` (default 90%) of requests meet every SLO (the goodput DistServe maximises),
per worker core; a shape of ``P`` prefill + ``D`` decode workers uses ``P + D`` cores at one
thread each, a colocated worker ``k`` cores at ``k`` threads. Each worker's step times come
from the profile measured at its thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

from common import (
    DATA_DIR,
    SEED,
    add_data_argument,
    cpu_line,
    load_prompts,
    resolve_bench_dtype,
    resolve_model,
)
from pd_sim import NO_OVERHEAD, ClusterShape, ServingOverhead, StepModel, simulate
from serving_metrics import meets_slos, parse_slos, summarize

WORKLOADS = ("sharegpt", "gsm8k", "long")


# ---- workloads ---------------------------------------------------------------------------------


def workload(kind: str, num: int, args: argparse.Namespace) -> list[tuple[int, int]]:
    """``num`` (prompt tokens, output tokens) pairs, seeded: ``sharegpt`` (first user turns,
    truncated to ``--max-input-len``, ``--output-len`` out), ``gsm8k`` (a 5-shot prefix of
    ~700 tokens plus a question, 128 out) or ``long`` (2k-4k tokens, 64 out)."""
    rng = random.Random(SEED)
    if kind == "sharegpt":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
        prompts = load_prompts(tok, num, args.max_input_len, data=args.data)
        return [(len(p), args.output_len) for p in prompts]
    if kind == "gsm8k":
        return [(700 + rng.randint(40, 120), 128) for _ in range(num)]
    return [(rng.randint(2000, 4000), 64) for _ in range(num)]


def arrivals(num: int, rate: float, seed: int = SEED) -> list[float]:
    """Poisson arrival times, as ``bench/serving.py`` draws them (same seed, same numbers)."""
    if math.isinf(rate):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- profiles ----------------------------------------------------------------------------------


def load_profile(path: Path) -> dict[int, StepModel]:
    data = json.loads(path.read_text())
    return {int(k): StepModel(**v["model"]) for k, v in data["threads"].items()}


def load_overheads(path: Path) -> dict[str, ServingOverhead]:
    """The profile's calibrated serving overheads by mode (``colocated``, ``disaggregated``);
    empty before ``calibrate`` ran on it."""
    data = json.loads(path.read_text())
    return {mode: ServingOverhead(o["request_s"], o["step_s"], o["token_s"],
                                  o.get("itl_tail_s", 0.0))
            for mode, o in data.get("overheads", {}).items()}


def cmd_measure(args: argparse.Namespace) -> int:
    import torch
    from pd_profile import profile

    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model

    dtype = resolve_bench_dtype(args.dtype)[0]
    out: dict = {"cpu": cpu_line(), "dtype": dtype, "threads": {}}
    for threads in args.threads:
        torch.set_num_threads(threads)
        # Load at this thread count: the kernel plan (engine.model.kernel_plan) depends on it.
        model, cfg = load_model(resolve_model(args.model), getattr(torch, dtype),
                                engine=EngineConfig(dtype=dtype))
        fitted, raw = profile(model, cfg, dtype, threads)
        out["threads"][str(threads)] = {"model": {k: getattr(fitted, k) for k in (
            "d0", "d_row", "d_ctx", "p0", "p_tok", "p_pair", "threads")}, "samples": raw}
        print(f"{threads} thread(s): decode {fitted.d0 * 1e3:.2f} ms + {fitted.d_row * 1e3:.3f} "
              f"ms/row + {fitted.d_ctx * 1e6:.3f} us/ctx token; prefill {fitted.p0 * 1e3:.2f} ms "
              f"+ {fitted.p_tok * 1e3:.3f} ms/token + {fitted.p_pair * 1e9:.3f} ns/pair "
              f"(fit max error: decode {raw['max_rel_error_decode']:.0%}, prefill "
              f"{raw['max_rel_error_prefill']:.0%})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"profile of {out['cpu']} in {args.out}")
    return 0


# ---- planning ----------------------------------------------------------------------------------


def shapes_for(cores: int, profiles: dict[int, StepModel]) -> list[tuple[ClusterShape, int, int]]:
    """``(shape, prefill threads, decode threads)`` for every way to spend ``cores``: P+D
    workers at one thread, colocated workers at every thread count the profile has."""
    out = []
    if 1 in profiles:
        for p in range(1, cores):
            out.append((ClusterShape(num_prefill=p, num_decode=cores - p), 1, 1))
    for t in sorted(profiles):
        if cores % t == 0:
            out.append((ClusterShape(num_colocated=cores // t), t, t))
    return out


def attainment(reqs: list[tuple[float, int, int]], shape: ClusterShape,
               profiles: dict[int, StepModel], pt: int, dt: int, slos: dict,
               overhead: ServingOverhead = NO_OVERHEAD) -> float:
    outs = simulate(reqs, shape, profiles[pt], profiles[dt], overhead)
    return sum(meets_slos(o, slos) for o in outs) / len(outs)


def max_rate(lengths: list[tuple[int, int]], shape: ClusterShape, profiles, pt: int, dt: int,
             slos: dict, target: float, overhead: ServingOverhead = NO_OVERHEAD) -> float:
    """The largest Poisson rate (req/s, to 2%) whose SLO attainment is at least ``target``."""
    def ok(rate: float) -> bool:
        starts = arrivals(len(lengths), rate)
        reqs = [(s, p, o) for s, (p, o) in zip(starts, lengths)]
        return attainment(reqs, shape, profiles, pt, dt, slos, overhead) >= target

    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    while hi - lo > 0.02 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def cmd_plan(args: argparse.Namespace) -> int:
    profiles = load_profile(args.profile)
    slos = parse_slos(args.slo)
    lengths = workload(args.workload, args.num_requests, args)
    print(f"{cpu_line()}; workload {args.workload}: {len(lengths)} requests, mean prompt "
          f"{sum(p for p, _ in lengths) / len(lengths):.0f} tokens; SLOs "
          f"{', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in slos.items())}; attainment "
          f">= {args.attainment:.0%}; {args.cores} cores")
    # The overhead calibrated for a mode stands in for every shape of that mode (it was measured
    # at one worker count and thread split).
    overheads = load_overheads(args.profile)
    print("  serving overhead: " + (", ".join(
        f"{m} {o.request_s * 1e3:.1f} ms/request + {o.step_s * 1e3:.2f} ms/step + "
        f"{o.token_s * 1e3:.3f} ms/token" for m, o in overheads.items())
        or "none calibrated (steps only: latency is under-predicted at light load)"))
    rows = []
    for shape, pt, dt in shapes_for(args.cores, profiles):
        shape = ClusterShape(shape.num_prefill, shape.num_decode, shape.num_colocated,
                             args.max_batch_tokens, args.max_running)
        mode = "colocated" if shape.num_colocated else "disaggregated"
        rate = max_rate(lengths, shape, profiles, pt, dt, slos, args.attainment,
                        overheads.get(mode, NO_OVERHEAD))
        rows.append((rate, shape.describe(), pt))
        print(f"  {shape.describe():>12} ({pt} thread(s) per worker): goodput {rate:6.2f} req/s, "
              f"{rate / args.cores:6.3f} req/s per core", flush=True)
    best = max(rows)
    print(f"best: {best[1]} at {best[0]:.2f} req/s")
    return 0


def parse_shape(text: str) -> tuple[int, int]:
    """``"2P1D"`` -> ``(2, 1)``."""
    m = re.fullmatch(r"(\d+)P(\d+)D", text.upper())
    if not m:
        raise SystemExit(f"bad --shape {text!r}: use e.g. 2P1D")
    return int(m[1]), int(m[2])


def _run_setup(run: dict, res: dict, cores: int,
               shape: str | None = None) -> tuple[str, ClusterShape, int]:
    """A serving.py run's mode (``colocated`` or ``disaggregated``, from its target name, or
    ``shape``, e.g. ``2P1D``, for a cluster started by hand), the cluster shape and the threads
    per worker (a launched 1P1D splits the cores; ``--threads-per-worker`` when the run set
    it). The workers share ``cores``."""
    words = run["target"].split()
    threads = res["config"].get("threads_per_worker") or 0
    if shape:
        p, d = parse_shape(shape)
        return "disaggregated", ClusterShape(p, d, cores=cores), threads or 1
    if "colocated" in words:
        return "colocated", ClusterShape(num_colocated=1, cores=cores), threads or cores
    return "disaggregated", ClusterShape(1, 1, cores=cores), threads or max(1, cores // 2)


def _lengths_of(res: dict) -> list[tuple[int, int]]:
    cfg = res["config"]
    ns = argparse.Namespace(model=cfg.get("model"), max_input_len=cfg["max_input_len"],
                            output_len=cfg["output_len"], data=Path(cfg.get("data") or DATA_DIR))
    return workload(cfg["dataset"], cfg["num_prompts"], ns)


def simulate_run(run: dict, lengths: list[tuple[int, int]], shape: ClusterShape, model: StepModel,
                 overhead: ServingOverhead, slos: dict) -> dict:
    """The ``serving_metrics.summarize`` of one serving.py run (Poisson or closed loop),
    simulated on the same prompts and arrivals."""
    closed = run["load_kind"] == "concurrency"
    starts = [0.0] * len(lengths) if closed else arrivals(len(lengths), float(run["load_value"]))
    outs = simulate([(s, p, o) for s, (p, o) in zip(starts, lengths)], shape, model, model,
                    overhead, concurrency=int(run["load_value"]) if closed else None)
    summary = summarize(outs, max(o.start + o.latency for o in outs), slos)
    if overhead.itl_tail_s and summary["itl_ms"]:
        summary["itl_ms"]["p99"] += overhead.itl_tail_s * 1e3
    return summary


def calibrate(runs: list[dict], lengths: list[tuple[int, int]], shape: ClusterShape,
              model: StepModel) -> ServingOverhead:
    """The serving overhead that makes the simulated closed-loop runs match the measured ones:
    ``step_s`` and ``token_s`` from the p50 ITL excess over the steps-only simulation at the
    lowest and highest concurrency (a step's excess is ``step_s + token_s * rows``), then
    ``request_s`` from the lowest concurrency's p50 TTFT excess with those two in place;
    ``itl_tail_s``, last, the mean p99 ITL excess of every closed-loop run with the rest in
    place. Negative estimates (noise) are clipped to 0.

    Raises:
        ValueError: fewer than two closed-loop concurrencies among ``runs``.
    """
    closed = sorted((r for r in runs if r["load_kind"] == "concurrency"),
                    key=lambda r: int(r["load_value"]))
    if len({int(r["load_value"]) for r in closed}) < 2:
        raise ValueError("calibrate needs closed-loop runs at two concurrencies (e.g. "
                         "bench/serving.py --concurrency 1 8)")
    lo, hi = closed[0], closed[-1]
    c_lo, c_hi = int(lo["load_value"]), int(hi["load_value"])

    def excess(run: dict, overhead: ServingOverhead, key: str, stat: str = "p50") -> float:
        sim = simulate_run(run, lengths, shape, model, overhead, {})
        return (run["summary"][key][stat] - sim[key][stat]) / 1e3

    a_lo, a_hi = excess(lo, NO_OVERHEAD, "itl_ms"), excess(hi, NO_OVERHEAD, "itl_ms")
    token_s = max(0.0, (a_hi - a_lo) / (c_hi - c_lo))
    step_s = max(0.0, a_lo - token_s * c_lo)
    steps = ServingOverhead(0.0, step_s, token_s)
    fitted = ServingOverhead(max(0.0, excess(lo, steps, "ttft_ms")), step_s, token_s)
    tails = [excess(r, fitted, "itl_ms", "p99") for r in closed]
    return replace(fitted, itl_tail_s=max(0.0, sum(tails) / len(tails)))


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit each mode's :class:`ServingOverhead` on the closed-loop runs of a serving.py
    results file and store it in the profile."""
    profiles = load_profile(args.profile)
    res = json.loads(args.results.read_text())
    lengths = _lengths_of(res)
    by_mode: dict[str, tuple[ClusterShape, int, list[dict]]] = {}
    for run in res["runs"]:
        mode, shape, threads = _run_setup(run, res, args.cores, args.shape)
        by_mode.setdefault(mode, (shape, threads, []))[2].append(run)
    data = json.loads(args.profile.read_text())
    for mode, (shape, threads, runs) in by_mode.items():
        o = calibrate(runs, lengths, shape, profiles[threads])
        data.setdefault("overheads", {})[mode] = {
            "request_s": o.request_s, "step_s": o.step_s, "token_s": o.token_s,
            "itl_tail_s": o.itl_tail_s, "threads": threads, "calibrated_on": str(args.results)}
        print(f"{mode} ({threads} thread(s) per worker): {o.request_s * 1e3:.1f} ms per request, "
              f"{o.step_s * 1e3:.2f} ms per step, {o.token_s * 1e3:.3f} ms per token, "
              f"p99 ITL tail {o.itl_tail_s * 1e3:.1f} ms")
    args.profile.write_text(json.dumps(data, indent=1))
    print(f"written into {args.profile}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Simulate each run of a ``bench/serving.py`` results file (``--request-rate`` or closed
    loop) on the same prompts and arrivals, with and without the calibrated serving overhead,
    and print simulated vs measured goodput, p99 ITL and p50 TTFT."""
    profiles = load_profile(args.profile)
    overheads = load_overheads(args.profile)
    res = json.loads(args.results.read_text())
    lengths = _lengths_of(res)
    slos = {k: v / 1e3 for k, v in (res["runs"][0]["summary"].get("slos_ms") or {}).items()}
    print(cpu_line())
    if not overheads:
        print("  (no calibrated serving overhead in the profile: steps only; see calibrate)")
    for run in res["runs"]:
        mode, shape, threads = _run_setup(run, res, args.cores, args.shape)
        bare = simulate_run(run, lengths, shape, profiles[threads], NO_OVERHEAD, slos)
        full = simulate_run(run, lengths, shape, profiles[threads],
                            overheads.get(mode, NO_OVERHEAD), slos) if overheads else bare
        real = run["summary"]
        for key, label, stat in (("goodput", "goodput req/s", None),
                                 ("itl_ms", "ITL p99 ms", "p99"), ("ttft_ms", "TTFT p50 ms", "p50")):
            s0, s1, r = ((d[key][stat] if stat else d[key]) for d in (bare, full, real))
            x0, x1 = (f"{s / r:.2f}x" if r else "nan" for s in (s0, s1))
            print(f"  {run['target']:>26} {run['load']:>8} {label:>14}: measured {r:9.2f}; "
                  f"steps only {s0:9.2f} ({x0}); with overhead {s1:9.2f} ({x1})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure step costs here and fit the step model")
    m.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    m.add_argument("--model", default=None)
    m.add_argument("--dtype", default="auto")
    m.add_argument("--out", type=Path, default=Path("bench/results/pd_profile.json"))
    p = sub.add_parser("plan", help="goodput of every cluster shape for a workload")
    c = sub.add_parser("compare", help="simulate the runs of a bench/serving.py results file")
    k = sub.add_parser("calibrate", help="fit the serving overhead on closed-loop serving runs")
    for q in (p, c, k):
        q.add_argument("--profile", type=Path, default=Path("bench/results/pd_profile.json"))
        q.add_argument("--cores", type=int, default=2)
    p.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--slo", nargs="*", default=["ttft:2000", "itl:200"], metavar="KIND:MS")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    add_data_argument(p)
    for q in (c, k):
        q.add_argument("--results", type=Path, required=True)
        q.add_argument("--shape", default=None,
                       help="the cluster's shape, e.g. 2P1D, for a run against --base-url "
                       "(default: from the target: a launched colocated worker or 1P1D)")
    args = ap.parse_args(argv)
    return {"measure": cmd_measure, "plan": cmd_plan, "compare": cmd_compare,
            "calibrate": cmd_calibrate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
