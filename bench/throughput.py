"""Throughput benchmark: splitserve (disaggregated and/or colocated) against HF ``transformers``.

In one run it serves the same ShareGPT prompts at several client concurrencies through a local
splitserve cluster and generates them with ``transformers`` ``generate`` one request at a time
(same model, same dtype, greedy, same fixed output length), then prints output tokens/s for each
and the ratio against the sequential ``transformers`` baseline. Goal: at concurrency 32, at least
5x the sequential ``transformers`` throughput.

Quick check::

    python bench/throughput.py --num-prompts 16 --output-len 32 --hf-prompts 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import (
    MAX_PROMPT_TOKENS,
    add_data_argument,
    default_dtype,
    launch_cluster,
    load_prompts,
    percentile,
    resolve_model,
)
from tqdm import tqdm

from splitserve.server.sse import DONE, aiter_events

GOAL_RATIO = 5.0
GOAL_CONCURRENCY = 32


# --------------------------------------------------------------------------------------------
# results


@dataclass(slots=True)
class RequestResult:
    """One streamed request: timings in seconds, tokens as counted by the server."""

    ttft: float
    latency: float
    output_tokens: int
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    """One system at one concurrency (or the sequential HF baseline)."""

    name: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    mean_itl_ms: float | None = None
    errors: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def req_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tok_per_s=self.tok_per_s, req_per_s=self.req_per_s)
        return d


def summarize(name: str, concurrency: int, results: list[RequestResult], wall_s: float) -> RunResult:
    """Aggregate per-request results into a :class:`RunResult`."""
    ok = [r for r in results if r.error is None]
    run = RunResult(name, concurrency, len(ok), sum(r.output_tokens for r in ok), wall_s,
                    errors=len(results) - len(ok))
    if ok:
        ttfts = [r.ttft * 1e3 for r in ok]
        run.ttft_p50_ms = percentile(ttfts, 50)
        run.ttft_p99_ms = percentile(ttfts, 99)
        itls = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
        run.mean_itl_ms = statistics.fmean(itls) if itls else None
    run.notes += sorted({r.error for r in results if r.error})[:3]
    return run


# --------------------------------------------------------------------------------------------
# Hugging Face transformers baseline


def run_hf(model_path: str, dtype: str, prompts: list[list[int]], output_len: int) -> RunResult:
    """``generate`` one prompt at a time (greedy, exactly ``output_len`` new tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    kwargs = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False,
              "pad_token_id": model.config.eos_token_id}

    def one(ids: list[int]) -> tuple[int, float]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return out.shape[1] - x.shape[1], time.perf_counter() - t0

    one(prompts[0][:16])  # warm-up
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    for ids in tqdm(prompts, desc="transformers sequential", unit="req", leave=False):
        n, latency = one(ids)
        results.append(RequestResult(ttft=float("nan"), latency=latency, output_tokens=n))
    wall = time.perf_counter() - t0
    run = RunResult("transformers sequential", 1, len(results),
                    sum(r.output_tokens for r in results), wall)
    run.notes.append(f"timed on {len(prompts)} prompt(s); sequential throughput is per request")
    return run


# --------------------------------------------------------------------------------------------
# splitserve client


async def stream_one(client: httpx.AsyncClient, ids: list[int], output_len: int) -> RequestResult:
    """One streamed ``/v1/completions`` request; the token count comes from the usage chunk."""
    body = {
        "model": "default", "prompt": ids, "max_tokens": output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(0.0, 0.0, 0, f"HTTP {resp.status_code}: {text[:200]}")
            async for chunk in aiter_events(resp.aiter_lines()):
                if chunk == DONE:
                    break
                if "error" in chunk:
                    return RequestResult(0.0, 0.0, 0, str(chunk["error"])[:200])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return RequestResult(0.0, 0.0, 0, f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - t0
    return RequestResult(ttft if ttft is not None else latency, latency, tokens)


async def run_concurrency(url: str, name: str, prompts: list[list[int]], output_len: int,
                          concurrency: int) -> RunResult:
    """Send every prompt with at most ``concurrency`` requests in flight."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        bar = tqdm(total=len(prompts), desc=f"{name} c={concurrency}", unit="req", leave=False)

        async def task(ids: list[int]) -> RequestResult:
            async with sem:
                r = await stream_one(client, ids, output_len)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(task(ids) for ids in prompts))
        wall = time.perf_counter() - t0
        bar.close()
    return summarize(name, concurrency, list(results), wall)


async def warm_up(url: str, prompts: list[list[int]], output_len: int, n: int = 2) -> None:
    """A couple of short concurrent requests so first-call costs are not timed."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        rs = await asyncio.gather(*(stream_one(client, p, min(output_len, 8)) for p in prompts[:n]))
    bad = [r.error for r in rs if r.error]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def run_cluster(mode: str, model_path: str, dtype: str, prompts: list[list[int]], output_len: int,
                concurrencies: list[int]) -> list[RunResult]:
    """Start a cluster in ``mode`` (disaggregated or colocated) and run every concurrency."""
    name = f"splitserve {mode}"
    runs: list[RunResult] = []
    with launch_cluster(mode, model_path, dtype, max_running=max(64, max(concurrencies))) as url:
        asyncio.run(warm_up(url, prompts, output_len))
        for c in concurrencies:
            runs.append(asyncio.run(run_concurrency(url, name, prompts, output_len, c)))
            print_run(runs[-1])
    return runs


# --------------------------------------------------------------------------------------------
# reporting


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_run(run: RunResult) -> None:
    """One line per finished run."""
    print(f"  {run.name} c={run.concurrency}: {run.tok_per_s:.1f} tok/s, {run.req_per_s:.2f} req/s, "
          f"TTFT p50 {_ms(run.ttft_p50_ms)} ms p99 {_ms(run.ttft_p99_ms)} ms, "
          f"mean ITL {_ms(run.mean_itl_ms)} ms, {run.output_tokens} tokens in {run.wall_s:.1f} s"
          + (f", {run.errors} ERRORS: {run.notes}" if run.errors else ""), flush=True)


def print_table(hf: RunResult, runs: list[RunResult]) -> bool | None:
    """The final table; returns whether the goal is met (None if c=32 was not run)."""
    header = (f"{'system':<32}{'tok/s':>10}{'req/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'ITL ms':>9}{'vs HF':>8}")
    print("\n" + header)
    print("-" * len(header))
    print(f"{hf.name:<32}{hf.tok_per_s:>10.1f}{hf.req_per_s:>9.2f}{'-':>10}{'-':>10}"
          f"{_ms(hf.mean_itl_ms):>9}{1.0:>7.2f}x")
    met: bool | None = None
    for r in runs:
        ratio = r.tok_per_s / hf.tok_per_s if hf.tok_per_s else float("nan")
        label = f"{r.name} c={r.concurrency}"
        print(f"{label:<32}{r.tok_per_s:>10.1f}{r.req_per_s:>9.2f}{_ms(r.ttft_p50_ms):>10}"
              f"{_ms(r.ttft_p99_ms):>10}{_ms(r.mean_itl_ms):>9}{ratio:>7.2f}x"
              + (f"  ({r.errors} errors)" if r.errors else ""))
        if r.concurrency == GOAL_CONCURRENCY and r.name.endswith("disaggregated"):
            met = ratio >= GOAL_RATIO and r.errors == 0
    print(f"\nHF tok/s from {hf.num_requests} prompt(s) run one at a time (sequential throughput is "
          "per request, so a subset is a fair sample).")
    if met is None:
        print(f"goal ({GOAL_RATIO:g}x at c={GOAL_CONCURRENCY}, disaggregated): not measured")
    else:
        print(f"goal ({GOAL_RATIO:g}x HF at c={GOAL_CONCURRENCY}, disaggregated): "
              f"{'MET' if met else 'NOT MET'}")
    return met


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 if the CPU has AMX/avx512_bf16, else float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--hf-prompts", type=int, default=8,
                   help="prompts to time transformers on (sequential, so a subset is fair)")
    p.add_argument("--mode", choices=["disaggregated", "colocated", "both"],
                   default="disaggregated")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    add_data_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model_path = resolve_model(args.model)
    if args.dtype:
        dtype, why = args.dtype, "from --dtype"
    else:
        dtype, why = default_dtype()
    print(f"model {model_path}\ndtype {dtype} ({why})", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = load_prompts(tokenizer, args.num_prompts, data=args.data)
    lens = [len(p) for p in prompts]
    print(f"{len(prompts)} ShareGPT prompts (first user turns, <= {MAX_PROMPT_TOKENS} tokens; "
          f"mean {statistics.fmean(lens):.0f}, max {max(lens)}), output {args.output_len} tokens "
          "each (ignore_eos)", flush=True)

    hf_n = max(1, min(args.hf_prompts, len(prompts)))
    print(f"running transformers generate on {hf_n} prompt(s), one at a time ...", flush=True)
    hf = run_hf(model_path, dtype, prompts[:hf_n], args.output_len)
    print_run(hf)

    modes = ["disaggregated", "colocated"] if args.mode == "both" else [args.mode]
    runs: list[RunResult] = []
    for mode in modes:
        runs += run_cluster(mode, model_path, dtype, prompts, args.output_len, args.concurrency)

    met = print_table(hf, runs)
    if args.json:
        args.json.write_text(json.dumps({
            "model": model_path, "dtype": dtype, "num_prompts": len(prompts),
            "output_len": args.output_len, "hf": hf.to_json(),
            "runs": [r.to_json() for r in runs], "goal_met": met,
        }, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
