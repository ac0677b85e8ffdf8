"""Grammar compile isolation (issue 33, item 1), with ratios from one run.

1. Scan: compile every MaskBench schema of the named subsets (``--only`` names some) with
   xgrammar in the compile pool (``engine.grammar.compile_pool``, no long-compile demotion,
   ``--scan-procs`` processes) under ``--scan-deadline``; those killed at the deadline are the
   pathological ones (the pool is the tool that makes such a scan possible: a thread could not
   be stopped). Printed: the schemas killed.
2. Isolation: ordinary json_schema compiles (small, distinct schemas) timed idle, then with 4
   pathological compiles in flight, alternating for ``--rounds`` rounds on one pool of
   ``--procs`` ordinary processes (the worker's default 2; each compile past 1 s runs demoted
   and lends its slot to a further child, up to 4). Loaded compiles start once all 4 run long
   and every child has started; idle ones once the children killed last round are replaced.
   Printed per round: each latency; then p50/p99/max idle and loaded, and the p99 ratio.
3. Baseline, last: the same with compile threads (``--grammar-compile-procs 0``): ordinary
   compiles wait behind the pathological ones (which cannot be stopped; the process exits
   without waiting for them).

The figure is compile latency on the worker's grammar service, which is what a constrained
request's TTFT adds on top of its prefill. In a served cluster these schemas do not reach
xgrammar (llguidance comes first in their chain and compiles them in well under a second), so
the served check is ``tests/e2e/test_compile_isolation_e2e.py`` with a compile made slow on
purpose.

    python bench/grammar_isolation.py --subsets Github_ultra --only Github_ultra/o34345,\
        Github_ultra/o39532,Github_ultra/o53885,Github_ultra/o7578 --scan-deadline 20 \
        --deadline 20 --rounds 3

Measured 2026-12-07 on AMD EPYC Zen 3, 2 cores, quiet. Earlier that day, the scan of the 200
non-BFCL schemas on 5 processes took 215 s, 18 killed at 20 s (Github_hard, Github_ultra,
Handwritten, JsonSchemaStore, Kubernetes); with 4 of them in flight on 5 processes at equal
priority, ordinary compiles went from 160 to 467 ms (2.9x; this script's percentiles were
about the minimum then: it passed q as a fraction). Each xgrammar compile runs on 2 threads, so
4 of them took the two cores from the ordinary one as equals. With long compiles moved to
``SCHED_IDLE`` thread by thread and lending their slot (the command above: the 4 Github_ultra
schemas of those 18 that were still killed with one process per core), four runs of 3 rounds
(n=30+30): p99 idle/loaded 446/263, 370/459, 322/360, 328/292 ms, ratios **0.59x, 1.24x, 1.12x,
0.89x** (p50 217/197, 210/262, 221/258, 220/227 ms; the first three started a sixth child, the
last, after the pool stopped starting children while one is free, five). Single compiles here vary from 150 to 490 ms idle, about as much
as the goal's margin, so the goal's 1.2x holds within this machine's noise, not with room. The
threads baseline of the same run as the first: one ordinary compile waited 77 s (p99 180x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import Future

from common import DATA_DIR, cpu_line, percentile, resolve_model

from splitserve.engine.grammar import GrammarError, GrammarService
from splitserve.engine.grammar.compile_pool import BackendSpec, CompilePool
from splitserve.engine.grammar.registry import create_backend


def _ordinary(tag: str) -> str:
    return json.dumps({"type": "object", "properties": {
        tag: {"type": "string"}, "count": {"type": "integer"}}, "required": [tag]})


def _maskbench(subsets: list[str], only: set[str]) -> list[tuple[str, str]]:
    root = DATA_DIR / "jsonschemabench" / "maskbench"
    out = []
    for subset in subsets:
        for path in sorted((root / subset).glob("*.json")):
            short = path.stem.split("---")[-1]  # files are named <subset>---<name>.json
            if path.name != "MANIFEST.json" and (not only or f"{subset}/{short}" in only):
                out.append((f"{subset}/{path.stem}",
                            json.dumps(json.loads(path.read_text())["schema"])))
    return out


def _timed(service: GrammarService, text: str) -> float:
    start = time.perf_counter()
    try:
        service.compile("json_schema", text)
    except GrammarError as exc:
        print(f"  ordinary compile failed: {exc}")
        return float("inf")
    return time.perf_counter() - start


def scan(tokenizer, schemas, procs: int, deadline: float) -> list[tuple[str, str]]:
    # No long compiles here (never demoted, no further children): one process per core by
    # default, so "killed" means slower than the deadline with about a core to itself.
    pool = CompilePool(BackendSpec(("xgrammar",), tokenizer), procs, deadline, len(schemas),
                       long_after_s=deadline * 2, max_long=0)
    service = GrammarService([create_backend("xgrammar", tokenizer)], pool=pool)
    start = time.perf_counter()
    futures: list[tuple[str, str, Future, float]] = []
    for name, text in schemas:
        futures.append((name, text, service.submit("json_schema", text), time.perf_counter()))
    killed, times = [], []
    for name, text, future, _ in futures:
        try:
            future.result()
            times.append(name)
        except GrammarError as exc:
            if "timed out" in str(exc):
                killed.append((name, text))
    service.shutdown()
    print(f"scan: {len(schemas)} schemas on {procs} processes in "
          f"{time.perf_counter() - start:.1f}s; {len(times)} compiled, {len(killed)} killed at "
          f"{deadline:g}s: {', '.join(n for n, _ in killed) or 'none'}")
    return killed


def isolation(tokenizer, slow: list[str], procs: int, deadline: float, rounds: int,
              per_round: int) -> tuple[list[float], list[float]]:
    if procs:
        pool = CompilePool(BackendSpec(("xgrammar",), tokenizer), procs, deadline, 8)
        service = GrammarService([create_backend("xgrammar", tokenizer)], pool=pool)
    else:
        service = GrammarService([create_backend("xgrammar", tokenizer)], timeout_s=deadline)
    service.compile("json_schema", _ordinary("warm"))
    idle, loaded = [], []
    for r in range(rounds):
        if procs:  # idle is idle: the children killed last round have been replaced
            while pool.ready < pool.children() or pool.running():
                time.sleep(0.01)
        idle += [_timed(service, _ordinary(f"idle{r}_{i}")) for i in range(per_round)]
        # Distinct texts every round: a constraint that timed out is remembered and would
        # fail at once the next round, leaving nothing in flight.
        inflight = [service.submit("json_schema", slow[(4 * r + i) % len(slow)] + " " * (4 * r + i))
                    for i in range(4)]
        if procs:  # until all 4 run long and every child has started (none is importing)
            while not all(f.done() for f in inflight) and (
                    pool.running_long() < 4 or pool.ready < pool.children()):
                time.sleep(0.01)
        loaded += [_timed(service, _ordinary(f"busy{r}_{i}")) for i in range(per_round)]
        lanes = f", {pool.children()} children" if procs else ""
        ms = " ".join(f"{t * 1e3:.0f}" for t in idle[-per_round:]) + " | " + " ".join(
            f"{t * 1e3:.0f}" for t in loaded[-per_round:])
        print(f"  round {r}: {sum(not f.done() for f in inflight)} of 4 pathological compiles "
              f"still in flight after the loaded compiles{lanes}; idle | loaded ms: {ms}",
              flush=True)
        for future in inflight:
            if future.done():
                print(f"    one ended first: {str(future.exception())[:160]}")
        if not procs:
            break  # threads: the pathological compiles never stop; one round is the baseline
        for future in inflight:  # killed at the deadline
            future.exception()
    return idle, loaded


def _line(label: str, idle: list[float], loaded: list[float]) -> None:
    # percentile() takes q in [0, 100]; this script passed 0.99 and 0.5 before 2026-12-07, so
    # its earlier "p99" and "p50" were about the minimum.
    p = {k: percentile(v, 99) for k, v in (("idle", idle), ("loaded", loaded))}
    print(f"{label}: ordinary compile p50/p99/max idle {percentile(idle, 50) * 1e3:.0f}/"
          f"{p['idle'] * 1e3:.0f}/{max(idle) * 1e3:.0f} ms, with 4 pathological in flight "
          f"{percentile(loaded, 50) * 1e3:.0f}/{p['loaded'] * 1e3:.0f}/{max(loaded) * 1e3:.0f} "
          f"ms: p99 ratio {p['loaded'] / p['idle']:.2f}x (n={len(idle)}+{len(loaded)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--subsets", default="BFCL_simple,BFCL_multiple,Github_hard")
    parser.add_argument("--scan-deadline", type=float, default=10.0)
    parser.add_argument("--scan-procs", type=int, default=os.cpu_count() or 2,
                        help="processes for the scan (default: one per core, so a schema "
                        "killed at the deadline had a core of its own)")
    parser.add_argument("--only", default="",
                        help="comma-separated subset/name of the schemas to scan (default all)")
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=2,
                        help="ordinary compile processes (the worker's default 2); each long "
                        "compile lends its slot to a further child, up to 4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    print(cpu_line())
    only = {n for n in args.only.split(",") if n}
    killed = scan(tokenizer, _maskbench(args.subsets.split(","), only), args.scan_procs,
                  args.scan_deadline)
    if not killed:
        print("no pathological schema in these subsets at this deadline; try others")
        return
    slow = [text for _, text in killed]
    _line(f"processes ({args.procs})", *isolation(tokenizer, slow, args.procs, args.deadline,
                                                  args.rounds, args.per_round))
    if not args.skip_baseline:
        _line("threads (2), baseline", *isolation(tokenizer, slow, 0, args.deadline, 1,
                                                   args.per_round))
    sys.stdout.flush()
    os._exit(0)  # compile threads still run the pathological schemas; do not wait for them


if __name__ == "__main__":
    main()
