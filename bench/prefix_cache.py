"""Prefix-cache benchmark on a GSM8K few-shot workload (issue 3).

Every prompt is the same 5-shot prefix (the first training examples, with worked answers) plus
one test question; answers are short and greedy. In one run it serves the workload through a
disaggregated cluster with the radix cache on and with it off (``--disable-radix-cache``) and
prints throughput, mean/p99 time to first token, and the cache hit rate against the best any
cache could do (every page-aligned prefix already seen, minus the token that must be computed).

With ``--routing-prefixes K`` it also serves a workload of K distinct 5-shot prefixes through
two prefill workers, routed ``cache_aware`` and ``round_robin``, and compares their hit rates.

Quick run::

    python bench/prefix_cache.py --num-questions 24 --routing-prefixes 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import DATA_DIR, add_data_argument

from splitserve.config import ServeConfig
from splitserve.default_model import resolve_model_path
from splitserve.launch.local import Cluster
from splitserve.radix_cache.token_prefix import common_prefix_len
from splitserve.server.sse import DONE, aiter_events

GSM8K = Path("prompts") / "gsm8k"  # under a data folder (--data)
NUM_SHOTS = 5


def load_jsonl(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def few_shot_prefix(shots: list[dict]) -> str:
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots]
    return "".join(parts)


def build_workload(
    tokenizer, num_questions: int, num_prefixes: int, seed: int, data: Path = DATA_DIR
) -> list[list[int]]:
    """Token ids of ``num_questions`` prompts; prefix ``k`` uses training shots
    ``[5k, 5k + 5)``; questions are spread over the prefixes in a seeded random order. Reads
    ``data/prompts/gsm8k/{train_first500,test}.jsonl``."""
    train = load_jsonl(data / GSM8K / "train_first500.jsonl", NUM_SHOTS * num_prefixes)
    questions = load_jsonl(data / GSM8K / "test.jsonl", num_questions)
    prefixes = [
        few_shot_prefix(train[k * NUM_SHOTS : (k + 1) * NUM_SHOTS]) for k in range(num_prefixes)
    ]
    order = [i % num_prefixes for i in range(num_questions)]
    random.Random(seed).shuffle(order)
    texts = [prefixes[k] + f"Question: {q['question']}\nAnswer:" for k, q in zip(order, questions)]
    return [tokenizer.encode(t) for t in texts]


def best_hit_tokens(prompts: list[list[int]], page_size: int) -> int:
    """Prompt tokens an unbounded cache could serve, in arrival order (tokens): for each prompt
    the longest page-aligned prefix shared with an earlier one, leaving its last token."""
    total = 0
    for i, p in enumerate(prompts):
        best = max((common_prefix_len(p, q) for q in prompts[:i]), default=0)
        total += min(best, len(p) - 1) // page_size * page_size
    return total


@dataclass(slots=True)
class RunResult:
    name: str
    wall_s: float
    ttft_s: list[float]
    output_tokens: int
    hit_tokens: int
    prompt_tokens: int

    def row(self, best_hit: int) -> str:
        ttft = sorted(self.ttft_s)
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        rate = self.hit_tokens / max(1, self.prompt_tokens)
        of_best = self.hit_tokens / best_hit if best_hit else float("nan")
        return (
            f"{self.name:<28} {len(ttft) / self.wall_s:7.2f} req/s {self.output_tokens / self.wall_s:8.1f} "
            f"tok/s  TTFT mean {statistics.mean(ttft):6.3f} s p99 {p99:6.3f} s  "
            f"hit {rate:6.1%} ({of_best:6.1%} of best)"
        )


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    """Stream one greedy completion; returns (TTFT in s, output tokens)."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in aiter_events(r.aiter_lines()):
            if chunk == DONE:
                continue
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - start, tokens


def cache_counters(url: str) -> tuple[int, int]:
    rows = httpx.get(url + "/workers", timeout=30).json()
    return (
        sum(r.get("cache_hit_tokens", 0) for r in rows),
        sum(r.get("cache_prompt_tokens", 0) for r in rows),
    )


async def serve_workload(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[float, list[float], int]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded(p: list[int]) -> tuple[float, int]:
            async with sem:
                return await one_request(client, url, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    return wall, [t for t, _ in results], sum(n for _, n in results)


def run_cluster(
    name: str,
    spec: ServeConfig,
    prompts: list[list[int]],
    warmup: list[int],
    args: argparse.Namespace,
) -> RunResult:
    print(f"[{name}] launching ...", flush=True)
    with Cluster(spec) as cluster:
        url = cluster.config.url
        asyncio.run(serve_workload(url, [warmup], 4, 1))  # first-call costs (allocations, JIT)
        httpx.post(url + "/flush_cache", json={}, timeout=60).raise_for_status()
        hit0, prompt0 = cache_counters(url)
        wall, ttft, out = asyncio.run(
            serve_workload(url, prompts, args.max_tokens, args.concurrency)
        )
        hit1, prompt1 = cache_counters(url)
    result = RunResult(name, wall, ttft, out, hit1 - hit0, prompt1 - prompt0)
    print(f"[{name}] done in {wall:.1f} s", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-questions", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument(
        "--routing-prefixes",
        type=int,
        default=0,
        help="K > 0: also compare cache_aware vs round_robin with 2 prefill workers",
    )
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--skip-single", action="store_true", help="only the routing comparison")
    add_data_argument(ap)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model = str(resolve_model_path(None))
    tokenizer = AutoTokenizer.from_pretrained(model)
    base: dict = {
        "model": model,
        "page_size": args.page_size,
        "port": args.port,
        "threads_per_worker": args.threads_per_worker,
        # Queues on an oversubscribed CPU can exceed the serving default (30 s); a benchmark
        # measures throughput, not timeouts.
        "transfer_timeout_s": 600.0,
    }
    warmup = tokenizer.encode("Hello there, how are you today?")
    lines: list[str] = []
    if not args.skip_single:
        lines += compare_cache_on_off(tokenizer, base, warmup, args)
    if args.routing_prefixes > 0:
        lines += compare_routing(tokenizer, base, warmup, args)
    print("\n".join(lines))


def compare_cache_on_off(tokenizer, base: dict, warmup: list[int], args) -> list[str]:
    """One prefill + one decode worker, radix cache on vs off, one shared 5-shot prefix."""
    prompts = build_workload(tokenizer, args.num_questions, 1, seed=0, data=args.data)
    best = best_hit_tokens(prompts, args.page_size)
    total = sum(len(p) for p in prompts)
    print(
        f"workload: {len(prompts)} prompts, mean {total / len(prompts):.0f} tokens, "
        f"best hit rate {best / total:.1%}, {args.max_tokens} output tokens, "
        f"concurrency {args.concurrency}",
        flush=True,
    )
    on = run_cluster("1P1D cache on", ServeConfig.from_fields(**base), prompts, warmup, args)
    off = run_cluster(
        "1P1D cache off", ServeConfig.from_fields(**base, prefix_cache="none"), prompts, warmup,
        args,
    )
    speedup = off.wall_s / on.wall_s
    ttft_ratio = statistics.mean(off.ttft_s) / statistics.mean(on.ttft_s)
    lines = [
        on.row(best),
        off.row(best),
        f"cache on / off: throughput x{speedup:.2f}, mean TTFT x{ttft_ratio:.2f} lower",
    ]
    return lines


def compare_routing(tokenizer, base: dict, warmup: list[int], args) -> list[str]:
    """Two prefill workers, ``cache_aware`` vs ``round_robin``, K distinct 5-shot prefixes."""
    prompts = build_workload(
        tokenizer, args.num_questions, args.routing_prefixes, seed=1, data=args.data
    )
    best = best_hit_tokens(prompts, args.page_size)
    rate = best / sum(len(p) for p in prompts)
    head = f"routing workload: {len(prompts)} prompts over {args.routing_prefixes} prefixes"
    lines = [f"{head}, best hit rate {rate:.1%} (one worker, unbounded cache)"]
    for routing in ("cache_aware", "round_robin"):
        spec = ServeConfig.from_fields(**base, num_prefill=2, routing=routing)
        lines.append(run_cluster(f"2P1D {routing}", spec, prompts, warmup, args).row(best))
    return lines


if __name__ == "__main__":
    main()
