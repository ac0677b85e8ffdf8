"""Speculative decoding, measured: plain vs ``--speculative ngram`` in one run, on workloads that
copy from their context (code editing, JSON extraction, tool calls), for one user at a time.

For each cluster mode (``--mode``) and each setting (plain, then ngram with each
``--num-speculative-tokens``) it launches a local cluster, sends the same greedy chat requests
one after another and prints, per workload: output tok/s, the speedup over plain in the same
run, the draft acceptance rate and the mean tokens gained per verification step (from the
workers' ``spec_draft_tokens`` / ``spec_accepted_tokens``), and how many outputs equal plain
decoding's (all of them in float32; bfloat16 may part at near-ties, docs/serving.md "Determinism").

The prompts are built here, seeded: code is cut from this repository's own sources (its licence),
records and tool specs are synthetic.

Example::

    python bench/speculative.py --mode colocated disaggregated --num-speculative-tokens 2 4 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import SEED, cpu_line, default_dtype, launch_cluster, resolve_model

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("code_edit", "json_extract", "tool_call")
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "Dmitri Ivanov", "Emma Stone", "Farid Khan"]
CITIES = ["Paris", "Lisbon", "Osaka", "Toronto", "Nairobi", "Lima"]


def code_edit_prompts(num: int, rng: random.Random) -> list[str]:
    """Rename one identifier in a 12-20 line function from this repository and print it all."""
    files = sorted((ROOT / "engine").rglob("*.py"))
    out: list[str] = []
    while len(out) < num:
        lines = rng.choice(files).read_text().splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ")]
        if not starts:
            continue
        i = rng.choice(starts)
        body = "\n".join(lines[i : i + rng.randint(12, 20)])
        names = sorted({w for w in body.replace("(", " ").replace(")", " ").replace(",", " ")
                        .replace(".", " ").replace(":", " ").split() if w.isidentifier()
                        and len(w) > 3 and w not in ("self", "return", "None", "True", "False")})
        if not names:
            continue
        old = rng.choice(names)
        out.append(f"Rename `{old}` to `{old}_v2` in the following Python code and output the "
                   f"whole updated code, nothing else.\n\n```python\n{body}\n```")
    return out


def json_extract_prompts(num: int, rng: random.Random) -> list[str]:
    """Pull the fields of a short message into a JSON object (values copied from the text)."""
    out = []
    for _ in range(num):
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        order, amount = rng.randint(10000, 99999), rng.randint(5, 500)
        email = name.lower().replace(" ", ".") + "@example.com"
        text = (f"Hello, this is {name} ({email}). I live in {city} and I was charged {amount} "
                f"euros twice for order {order}. Please refund one of the charges.")
        out.append("Extract the customer's name, email, city, order number and amount from this "
                   "message as a JSON object with keys name, email, city, order, amount.\n\n"
                   + text)
    return out


def tool_call_prompts(num: int, rng: random.Random) -> list[str]:
    """Answer with a JSON function call whose arguments repeat the request's values."""
    tool = {"name": "book_table", "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string"}, "city": {"type": "string"},
        "guests": {"type": "integer"}, "time": {"type": "string"}}}}
    out = []
    for _ in range(num):
        city, guests = rng.choice(CITIES), rng.randint(2, 8)
        place = rng.choice(["Le Petit Bistro", "Sakura House", "The Green Table", "Casa Nova"])
        hour = f"{rng.randint(18, 21)}:{rng.choice(['00', '30'])}"
        out.append(
            "You can call this function:\n" + json.dumps(tool) + "\nReply only with a JSON "
            'object {"name": ..., "arguments": {...}} that calls it.\n\n'
            f"Book a table at {place} in {city} for {guests} people at {hour}."
        )
    return out


BUILDERS = {"code_edit": code_edit_prompts, "json_extract": json_extract_prompts,
            "tool_call": tool_call_prompts}


def spec_counters(url: str) -> tuple[int, int]:
    rows = httpx.get(url + "/workers", timeout=30).json()
    return (sum(r.get("spec_draft_tokens", 0) for r in rows),
            sum(r.get("spec_accepted_tokens", 0) for r in rows))


def run_workload(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Sequential greedy chat requests; tokens, seconds, texts and the workers' draft counters."""
    d0, a0 = spec_counters(url)
    texts, tokens, seconds = [], 0, 0.0
    with httpx.Client(timeout=600) as client:
        for p in prompts:
            body = {"model": "default", "messages": [{"role": "user", "content": p}],
                    "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            r = client.post(url + "/v1/chat/completions", json=body)
            seconds += time.perf_counter() - t0
            r.raise_for_status()
            out = r.json()
            texts.append(out["choices"][0]["message"]["content"])
            tokens += out["usage"]["completion_tokens"]
    d1, a1 = spec_counters(url)
    return {"texts": texts, "tokens": tokens, "seconds": seconds,
            "drafted": d1 - d0, "accepted": a1 - a0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--dtype", default=None, help="serving dtype (default: this CPU's best)")
    ap.add_argument("--mode", nargs="+", default=["colocated", "disaggregated"],
                    choices=["colocated", "disaggregated"])
    ap.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=6, help="per workload")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.model)
    dtype = args.dtype or default_dtype()[0]
    rng = random.Random(SEED)
    prompts = {w: BUILDERS[w](args.num_prompts, rng) for w in args.workloads}
    print(f"CPU: {cpu_line()}\nmodel {model}, {dtype}, {args.threads_per_worker} thread(s) per "
          f"worker, {args.num_prompts} prompts per workload, max_tokens {args.max_tokens}, c=1")
    settings = [("plain", {})] + [
        (f"ngram K={k}", {"speculative": "ngram", "num_speculative_tokens": k})
        for k in args.num_speculative_tokens
    ]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in args.mode:
        for name, fields in settings:
            key = f"{mode} {name}"
            with launch_cluster(mode, model, dtype, threads_per_worker=args.threads_per_worker,
                                **fields) as url:
                for w in args.workloads:  # one request first: start-up work is not timed
                    run_workload(url, prompts[w][:1], 8)
                results[key] = {w: run_workload(url, prompts[w], args.max_tokens)
                                for w in args.workloads}
    print(f"\n{'setting':<28} {'workload':<13} {'tok/s':>7} {'vs plain':>8} {'accept':>7} "
          f"{'tok/step':>8} {'= plain':>7}")
    for mode in args.mode:
        plain = results[f"{mode} plain"]
        for name, _ in settings:
            res = results[f"{mode} {name}"]
            for w in args.workloads:
                r, p = res[w], plain[w]
                rate = r["tokens"] / r["seconds"]
                speedup = rate / (p["tokens"] / p["seconds"])
                accept = f"{r['accepted'] / r['drafted']:.0%}" if r["drafted"] else "-"
                steps = r["tokens"] - r["accepted"]  # each step gains 1 + its kept drafts
                same = sum(a == b for a, b in zip(r["texts"], p["texts"]))
                print(f"{mode + ' ' + name:<28} {w:<13} {rate:7.1f} {speedup:7.2f}x {accept:>7} "
                      f"{r['tokens'] / max(steps, 1):8.2f} {same:>3}/{len(r['texts'])}")
    geo = {}
    for mode in args.mode:
        for name, _ in settings[1:]:
            ratios = [(results[f"{mode} {name}"][w]["tokens"] / results[f"{mode} {name}"][w]["seconds"])
                      / (results[f"{mode} plain"][w]["tokens"] / results[f"{mode} plain"][w]["seconds"])
                      for w in args.workloads]
            geo[f"{mode} {name}"] = statistics.geometric_mean(ratios)
    for k, v in geo.items():
        print(f"geometric mean speedup, {k}: {v:.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
