"""Agent sessions against a small KV pool: prefix-cache tiers off, host memory (L2), L2 + disk (L3),
and two prefill workers sharing a Mooncake Store, in one run (issue 34).

N sessions × T turns. Every session starts from the same system prompt and tool list; each turn
appends the model's answer, a tool result and a new user message (ShareGPT turns from
``tests/data``), so a session's prompt grows by a few hundred tokens a turn. Turns go in rounds
(every session's turn t, ``--concurrency`` at a time, before any turn t+1), so between two turns
of one session the others' prompts pass through the pool: with the default sizes the sessions'
working set is several times the pool and an L1-only cache has lost a session's prefix by the
time it comes back.

Per configuration it prints TTFT p50/p90, goodput (requests per second whose TTFT met the SLO:
``--slo-ttft-s``, by default the tiers-off TTFT p50 measured in the same run), prompt tokens
computed against what a cache of unbounded size would compute, and the cached tokens per tier.
After the L2 + L3 run it restarts every worker with the same disk and sends each session's next
turn: the share of those prompts served from cache. Then the L3 and store load rates (GB/s,
tokens/s) next to the prefill rate the worker measured, and whether every answer equals the
tiers-off one (greedy; float32 by default).

Quick run (a few minutes on two cores)::

    python bench/agent_sessions.py --sessions 6 --turns 3

The defaults give a working set of only ~2× the pool; the README's run (4.3×, ~15 minutes)::

    python bench/agent_sessions.py --sessions 11 --turns 12 --pool-mb 160

``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import add_data_argument, cpu_line, first_user_turns, percentile

from splitserve.config import ServeConfig
from splitserve.default_model import resolve_model_path
from splitserve.ipc.sockets import free_tcp_addr
from splitserve.launch.local import Cluster
from splitserve.radix_cache.token_prefix import common_prefix_len
from splitserve.server.sse import DONE, aiter_events

SYSTEM = ("You are a coding agent working in a repository. Think step by step, call one tool at a "
          "time, and answer the user briefly once the task is done.\n\n# Tools\n")
TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": "string", "offset": "integer"}),
    ("write_file", "Write a file, replacing its content.", {"path": "string", "text": "string"}),
    ("run_tests", "Run the test suite or one test file.", {"target": "string"}),
    ("grep", "Search the repository for a regular expression.", {"pattern": "string"}),
    ("list_dir", "List a folder of the repository.", {"path": "string"}),
    ("git_diff", "Show the uncommitted changes.", {}),
]
CACHE_HEADER = "x-splitserve-cached-tokens"
TIERS = ("l1", "l2", "l3", "store")


def system_prompt() -> str:
    """The shared system prompt and tool list (JSON schemas), a few hundred tokens."""
    tools = [{"type": "function", "function": {
        "name": n, "description": d,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in p.items()},
                       "required": list(p)}}} for n, d, p in TOOLS]
    return SYSTEM + json.dumps(tools, indent=1) + "\n\n"


@dataclass(slots=True)
class Turn:
    """One request's outcome: seconds to the first token, tokens, cached tokens per tier."""

    session: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    text: str
    cached: dict[str, int]


@dataclass(slots=True)
class RunResult:
    name: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    after_restart: list[Turn] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)


class Workload:
    """The sessions' texts: turn ``t`` of session ``s`` appends ``tool_results[s][t]`` and
    ``user_turns[s][t]`` after the model's previous answer."""

    def __init__(self, tokenizer: Any, sessions: int, turns: int, tool_tokens: int,
                 user_tokens: int, data: Path) -> None:
        texts = first_user_turns(data / "prompts" / "sharegpt")
        random.Random(0).shuffle(texts)
        need = sessions * (turns + 1) * 2
        if len(texts) < need:
            raise SystemExit(f"{len(texts)} ShareGPT turns under {data}, {need} needed")

        def cut(text: str, n: int) -> str:
            return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n])

        it = iter(texts)
        self.tool = [[cut(next(it), tool_tokens) for _ in range(turns + 1)]
                     for _ in range(sessions)]
        self.user = [[cut(next(it), user_tokens) for _ in range(turns + 1)]
                     for _ in range(sessions)]
        self.sessions, self.turns = sessions, turns

    def first(self, s: int) -> str:
        return system_prompt() + f"User: {self.user[s][0]}\nAssistant:"

    def next(self, history: str, answer: str, s: int, t: int) -> str:
        return (history + answer + f"\nTool result: {self.tool[s][t]}\n"
                f"User: {self.user[s][t]}\nAssistant:")


async def ask(client: httpx.AsyncClient, url: str, tokenizer: Any, text: str, s: int, t: int,
              max_tokens: int) -> Turn:
    ids = tokenizer.encode(text)
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    ttft, parts = 0.0, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise SystemExit(f"HTTP {r.status_code}: {r.text}")
        header = dict(p.strip().split("=") for p in r.headers[CACHE_HEADER].split(";"))
        async for chunk in aiter_events(r.aiter_lines()):
            if chunk == DONE:
                break
            choices = chunk.get("choices") or [{}]
            piece = choices[0].get("text", "")
            if piece and not ttft:
                ttft = time.perf_counter() - start
            parts.append(piece)
    cached = {k: int(v) for k, v in header.items()}
    return Turn(s, t, len(ids), ttft or time.perf_counter() - start, "".join(parts), cached)


async def run_rounds(url: str, tokenizer: Any, work: Workload, rounds: range,
                     histories: list[str], answers: list[str], concurrency: int,
                     max_tokens: int) -> list[Turn]:
    """Rounds ``rounds`` of every session (updating ``histories``/``answers`` in place)."""
    sem = asyncio.Semaphore(concurrency)
    out: list[Turn] = []
    async with httpx.AsyncClient(timeout=1800) as client:
        for t in rounds:
            async def one(s: int, t: int = t) -> Turn:
                text = work.first(s) if t == 0 else work.next(histories[s], answers[s], s, t)
                async with sem:
                    turn = await ask(client, url, tokenizer, text, s, t, max_tokens)
                histories[s], answers[s] = text, turn.text
                return turn

            out += await asyncio.gather(*(one(s) for s in range(work.sessions)))
    return out


def worker_rows(url: str) -> list[dict]:
    return httpx.get(url + "/workers", timeout=30).json()


def serve(args: argparse.Namespace, name: str, tokenizer: Any, work: Workload,
          disk: Path | None) -> RunResult:
    """Start the configuration ``name``, serve every round, and (L2 + L3) restart every worker
    and serve one more round."""
    fields: dict[str, Any] = {
        "model": str(args.model_path), "dtype": args.dtype, "kv_cache_mb": args.pool_mb,
        "port": int(free_tcp_addr().rsplit(":", 1)[1]), "threads_per_worker": args.threads,
        "num_prefill": 1, "num_decode": 1}
    if name in ("L2", "L2+L3"):
        fields["kv_host_cache_mb"] = args.host_mb
    if name == "L2+L3":
        fields.update(kv_disk_cache_dir=str(disk), kv_cache_write_policy="write_through")
    if name.startswith("2 prefill + store"):
        fields.update(num_prefill=2, kv_store="local", kv_store_segment_mb=args.store_mb,
                      kv_host_cache_mb=args.host_mb)
        if name.endswith("round robin"):  # every other turn on the worker that lacks it
            fields["routing"] = "round_robin"
    config = ServeConfig.from_fields(**fields)
    res = RunResult(name)
    histories, answers = [""] * work.sessions, [""] * work.sessions
    print(f"[{name}] starting {config.url} ...", flush=True)
    with Cluster(config) as cluster:
        start = time.perf_counter()
        res.turns = asyncio.run(run_rounds(config.url, tokenizer, work, range(work.turns),
                                           histories, answers, args.concurrency,
                                           args.max_tokens))
        res.wall_s = time.perf_counter() - start
        res.workers = worker_rows(config.url)
        if name == "L2+L3":
            names = [n for n, _ in cluster.procs if n != "api-server"]
            for n in names:
                cluster.kill(n)
            for n in names:
                cluster.restart(n)
            deadline = time.monotonic() + 300
            while not (len(rows := worker_rows(config.url)) == len(names)
                       and all(r["healthy"] for r in rows)):
                if time.monotonic() > deadline:
                    raise SystemExit("workers not healthy again within 300 s")
                time.sleep(0.5)
            res.after_restart = asyncio.run(run_rounds(
                config.url, tokenizer, work, range(work.turns, work.turns + 1), histories,
                answers, args.concurrency, args.max_tokens))
            res.workers = worker_rows(config.url)  # the restarted workers' L3 loads
    return res


def unbounded_computed(prompts: list[list[int]], page_size: int) -> int:
    """Prompt tokens a cache of unbounded size computes, serving ``prompts`` in order: each
    prompt's tokens past the longest page-aligned prefix shared with an earlier one (and always
    its last token)."""
    total = 0
    for i, p in enumerate(prompts):
        best = max((common_prefix_len(p, q) for q in prompts[:i]), default=0)
        total += len(p) - min(best, len(p) - 1) // page_size * page_size
    return total


def tier_rates(res: RunResult, page_size: int) -> list[str]:
    """Each prefill worker's L3 and store load rates (GB/s, tokens/s) and its measured prefill
    rate (tokens/s), one line per tier that loaded anything."""
    lines = []
    for row in res.workers:
        if row.get("role") == "decode":
            continue
        rate = row.get("prefill_tokens_per_s", 0.0)
        for t in row.get("cache_tiers", []):
            if t["tier"] in ("l3", "store") and t["load_s"] > 0:
                tok_s = t["load_blocks"] * page_size / t["load_s"]
                lines.append(f"  {res.name:18s} {row['worker_id']:10s} {t['tier']:5s} "
                             f"load {t['load_bytes'] / t['load_s'] / 1e9:6.3f} GB/s "
                             f"{tok_s:10.0f} tok/s vs prefill {rate:8.0f} tok/s "
                             f"(skipped as slower: {t.get('skipped_slower', 0)} blocks)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tool-tokens", type=int, default=160)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--pool-mb", type=int, default=80, help="KV pool (L1) of each worker")
    p.add_argument("--host-mb", type=int, default=512)
    p.add_argument("--store-mb", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--slo-ttft-s", type=float, default=0.0,
                   help="TTFT SLO of goodput (default: the tiers-off TTFT p50 of this run)")
    p.add_argument("--configs", default="off,L2,L2+L3,2 prefill + store,"
                   "2 prefill + store round robin")
    p.add_argument("--json", type=Path, default=None)
    add_data_argument(p)
    args = p.parse_args()
    from transformers import AutoTokenizer

    args.model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    work = Workload(tokenizer, args.sessions, args.turns, args.tool_tokens, args.user_tokens,
                    args.data)
    page_size = ServeConfig.from_fields(model=str(args.model_path)).engine.page_size
    print(f"CPU: {cpu_line()}")
    print(f"{args.sessions} sessions x {args.turns} turns, pool {args.pool_mb} MiB/worker, "
          f"L2 {args.host_mb} MiB, {args.dtype}, concurrency {args.concurrency}", flush=True)

    disk = Path(tempfile.mkdtemp(prefix="agent-l3-"))
    results: list[RunResult] = []
    try:
        for name in [c.strip() for c in args.configs.split(",")]:
            results.append(serve(args, name, tokenizer, work, disk))
    finally:
        shutil.rmtree(disk, ignore_errors=True)

    base = results[0]
    order = sorted(base.turns, key=lambda x: (x.turn, x.session))
    # Rebuild every prompt of the tiers-off run, in the order sent.
    hist, ans = [""] * work.sessions, [""] * work.sessions
    prompts = []
    for x in order:
        text = work.first(x.session) if x.turn == 0 else work.next(
            hist[x.session], ans[x.session], x.session, x.turn)
        prompts.append(tokenizer.encode(text))
        hist[x.session], ans[x.session] = text, x.text
    unbounded = unbounded_computed(prompts, page_size)
    total_prompt = sum(len(q) for q in prompts)
    # The distinct tokens of every prompt (what an unbounded cache computes) against the pool.
    pool_tokens = next(w["pages_total"] * page_size for w in base.workers
                       if w.get("role") != "decode")
    print(f"\nprompt tokens {total_prompt}; an unbounded cache computes {unbounded}: the "
          f"working set is {unbounded / pool_tokens:.1f}x the pool ({pool_tokens} tokens)")

    slo = args.slo_ttft_s or percentile([x.ttft_s for x in base.turns], 50)
    print(f"\nTTFT SLO for goodput: {slo:.3f} s\n")
    hdr = (f"{'config':18s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'goodput':>9s} {'computed':>9s} "
           f"{'vs unbnd':>8s}  cached by tier (l1/l2/l3/store)   same answers")
    print(hdr)
    figures: dict[str, Any] = {"cpu": cpu_line(), "slo_ttft_s": slo, "unbounded": unbounded}
    want = {(x.session, x.turn): x.text for x in base.turns}
    for r in results:
        ttfts = [x.ttft_s for x in r.turns]
        good = sum(t <= slo for t in ttfts) / r.wall_s
        computed = sum(x.prompt_tokens - x.cached["total"] for x in r.turns)
        by = [sum(x.cached.get(t, 0) for x in r.turns) for t in TIERS]
        same = sum(want.get((x.session, x.turn)) == x.text for x in r.turns)
        print(f"{r.name:18s} {percentile(ttfts, 50):8.3f}s {percentile(ttfts, 90):8.3f}s "
              f"{good:7.3f}/s {computed:9d} {computed / unbounded:7.2f}x  "
              f"{'/'.join(map(str, by)):30s} {same}/{len(r.turns)}")
        figures[r.name] = {"ttft_p50_s": percentile(ttfts, 50),
                           "ttft_p90_s": percentile(ttfts, 90),
                           "goodput_per_s": good, "computed": computed, "cached_by_tier": by,
                           "same_answers": same, "requests": len(r.turns), "wall_s": r.wall_s}
    byname = {r.name: r for r in results}
    if "off" in byname and "L2+L3" in byname:
        off, on = figures["off"], figures["L2+L3"]
        print(f"\nL2+L3 vs off: TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x lower "
              f"(goal >= 3x), goodput {on['goodput_per_s'] / max(off['goodput_per_s'], 1e-9):.2f}x "
              "(goal >= 2x)")
    for name in byname:
        if name.startswith("2 prefill + store"):
            two = figures[name]["computed"] / unbounded
            print(f"{name}: computed {two:.2f}x an unbounded cache (goal <= 1.1x)")
    if "L2+L3" in byname and byname["L2+L3"].after_restart:
        rs = byname["L2+L3"].after_restart
        share = sum(x.cached["total"] for x in rs) / sum(x.prompt_tokens for x in rs)
        worst = min(x.cached["total"] / x.prompt_tokens for x in rs)
        # The part of each prompt sent before the restart (its previous turn's prompt, whole
        # pages): the most any cache could serve, since the rest is the turn's new messages.
        last = {x.session: x.prompt_tokens for x in byname["L2+L3"].turns
                if x.turn == work.turns - 1}
        seen = sum(last[x.session] // page_size * page_size for x in rs)
        of_seen = sum(x.cached["total"] for x in rs) / seen
        print(f"after restarting every worker: {share:.1%} of the first prompts' tokens from "
              f"cache (worst session {worst:.1%}; goal >= 90%); {of_seen:.1%} of the tokens "
              "those sessions had sent before the restart; by tier "
              f"{ {t: sum(x.cached.get(t, 0) for x in rs) for t in TIERS} }")
        figures["after_restart_share"], figures["after_restart_worst"] = share, worst
        figures["after_restart_of_seen"] = of_seen
    print("\nload rates next to the prefill rate they replace:")
    for r in results:
        for line in tier_rates(r, page_size):
            print(line)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
