"""Grammar compile isolation (issue 33, item 1), with ratios from one run.

1. Scan: compile every MaskBench schema of the named subsets with xgrammar in the compile pool
   (``engine.grammar.compile_pool``) under ``--scan-deadline``; those killed at the deadline are
   the pathological ones (the pool is the tool that makes such a scan possible: a thread could
   not be stopped). Printed: each subset's compile p50/max and the schemas killed.
2. Isolation: ordinary json_schema compiles (small, distinct schemas) timed idle, then with 4
   pathological compiles in flight, alternating for ``--rounds`` rounds on one pool of
   ``--procs`` processes (the pathological ones are killed at ``--deadline`` between rounds).
   Printed: p50/p99 idle and loaded, and their ratio.
3. Baseline, last: the same with compile threads (``--grammar-compile-procs 0``): ordinary
   compiles wait behind the pathological ones (which cannot be stopped; the process exits
   without waiting for them).

The figure is compile latency on the worker's grammar service, which is what a constrained
request's TTFT adds on top of its prefill; an end-to-end TTFT run is not in this script.

    python bench/grammar_isolation.py --subsets Github_hard,Github_ultra,JsonSchemaStore --rounds 3

Measured 2026-12-07 (AMD EPYC Zen 3, 2 cores, quiet): the scan of the 200 non-BFCL schemas on 5
processes took 215 s, 18 killed at 20 s (Github_hard, Github_ultra, Handwritten, JsonSchemaStore,
Kubernetes); over those five subsets (``--subsets Github_hard,Github_ultra,Handwritten,
JsonSchemaStore,Kubernetes --scan-deadline 20 --deadline 20``), with 4 of them in flight in
every round, ordinary compiles p99 160 -> 467 ms (2.9x) on processes. The threads baseline is
not a comparison yet: there the same 4 compiles had ended before the loaded ones did (not
explained: in-process xgrammar, no nice, a fresh compiler). Unlike the test hook's sleeping child, a real pathological compile burns a core, and
two cores shared by five compiles slow the ordinary one; demoting a compile to nice 19 after
1 s did not change it (2.77x). The goal's 1.2x holds for waiting, not for a CPU this small.
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


def _maskbench(subsets: list[str]) -> list[tuple[str, str]]:
    root = DATA_DIR / "jsonschemabench" / "maskbench"
    out = []
    for subset in subsets:
        for path in sorted((root / subset).glob("*.json")):
            if path.name != "MANIFEST.json":
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
    pool = CompilePool(BackendSpec(("xgrammar",), tokenizer), procs, deadline, len(schemas))
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
        idle += [_timed(service, _ordinary(f"idle{r}_{i}")) for i in range(per_round)]
        # Distinct texts every round: a constraint that timed out is remembered and would
        # fail at once the next round, leaving nothing in flight.
        inflight = [service.submit("json_schema", slow[(4 * r + i) % len(slow)] + " " * (4 * r + i))
                    for i in range(4)]
        if procs:  # until the child processes hold them (or they ended: then not pathological)
            while pool.running() < min(4, procs - 1) and not all(f.done() for f in inflight):
                time.sleep(0.01)
        loaded += [_timed(service, _ordinary(f"busy{r}_{i}")) for i in range(per_round)]
        print(f"  round {r}: {sum(not f.done() for f in inflight)} of 4 pathological compiles "
              "still in flight after the loaded compiles", flush=True)
        if not procs:
            break  # threads: the pathological compiles never stop; one round is the baseline
        for future in inflight:  # killed at the deadline
            future.exception()
    return idle, loaded


def _line(label: str, idle: list[float], loaded: list[float]) -> None:
    p = {k: percentile(v, 0.99) for k, v in (("idle", idle), ("loaded", loaded))}
    print(f"{label}: ordinary compile p50/p99 idle {percentile(idle, 0.5) * 1e3:.0f}/"
          f"{p['idle'] * 1e3:.0f} ms, with 4 pathological in flight "
          f"{percentile(loaded, 0.5) * 1e3:.0f}/{p['loaded'] * 1e3:.0f} ms: p99 ratio "
          f"{p['loaded'] / p['idle']:.2f}x (n={len(idle)}+{len(loaded)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--subsets", default="BFCL_simple,BFCL_multiple,Github_hard")
    parser.add_argument("--scan-deadline", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    print(cpu_line())
    killed = scan(tokenizer, _maskbench(args.subsets.split(",")), args.procs, args.scan_deadline)
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
