"""Serving benchmark for any OpenAI-compatible server (splitserve, llama.cpp's, vLLM's, SGLang's).

Streams ``/v1/completions`` requests and measures, per request, the time to the first token
(TTFT), the gaps between streamed chunks (ITL), the time per output token after the first (TPOT)
and the end-to-end latency (E2E); per run, request and output-token throughput and goodput (the
rate of requests that met every SLO given with ``--slo``). Every target in one invocation gets
the same prompts, output lengths and arrival times, so their ratios are measured in one run.

Targets: ``--base-url [NAME=]URL`` (any number) and
``--launch MODE[:int8|:int4][:kv8][:ngram][:split]`` (a local splitserve cluster, MODE
``disaggregated`` or ``colocated``, with those weights, with ``:kv8`` an int8 KV cache, with
``:ngram`` n-gram speculative decoding of ``--num-speculative-tokens`` drafts, and with
``:split`` without the core share, ``--no-share-cores``; started for its runs and
stopped after). Load: ``--concurrency N ...``
(closed loop, N in flight) or ``--request-rate R ...`` (Poisson arrivals, ``inf`` = all at once;
``--max-concurrency`` caps in-flight requests). Datasets: ``sharegpt`` (first user turns from
``prompts/sharegpt/`` under ``--data``, default tests/data; truncated to ``--max-input-len``) or
``random`` (``--input-len`` random token ids). Outputs are ``--output-len`` tokens with
``ignore_eos``.

``--openvino [NAME=]DIR`` adds OpenVINO GenAI's ``ContinuousBatchingPipeline`` in process on the
same prompts (bench/ov_peer.py; its venv and models come from ``bench/peers/openvino.sh``).

Examples::

    python bench/serving.py --launch disaggregated --launch colocated --concurrency 1 8 32
    python bench/serving.py --base-url llama.cpp=http://127.0.0.1:8090 --launch disaggregated
    python bench/serving.py --base-url http://127.0.0.1:8000 --request-rate 1 2 4 --slo ttft:2000 itl:200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from common import (
    SEED,
    cpu_line,
    launch_cluster,
    launch_fields,
    load_prompts,
    random_prompts,
    resolve_bench_dtype,
    resolve_model,
)
from serving_args import parse_args as parse_serving_args
from serving_metrics import (
    RequestOutput,
    parse_slos,
    print_summary,
    print_table,
    summarize,
)
from serving_plots import plot
from tqdm import tqdm

from splitserve.server.sse import DONE, aiter_events

# --------------------------------------------------------------------------------------------
# one request


@dataclass(slots=True)
class Workload:
    """One request to send: a prompt (token ids, or text when the server needs text)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    tag: str = ""


@dataclass(slots=True)
class Target:
    """Where requests go. ``model`` is what the ``model`` field says (first of /v1/models)."""

    name: str
    url: str
    model: str = "default"
    ignore_eos: bool = True


async def send_request(
    client: httpx.AsyncClient, target: Target, work: Workload, t0: float
) -> RequestOutput:
    """Stream one ``/v1/completions`` request; count tokens from the usage chunk if there is
    one (else one per content chunk) and record the gap before every chunk after the first."""
    out = RequestOutput(work.tag, work.prompt_len)
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": work.prompt,
        "max_tokens": work.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    out.start = start - t0
    last = start
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:200]}"
                return out
            async for chunk in aiter_events(resp.aiter_lines()):
                if chunk == DONE:
                    break
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(chunk["usage"]["completion_tokens"])
                choices = chunk.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("delta")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itls.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    out.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if chunks == 0:
        out.error = "no tokens streamed"
    return out


# --------------------------------------------------------------------------------------------
# one run: a list of requests under a load pattern


def poisson_starts(num: int, rate: float, seed: int = SEED) -> list[float]:
    """Arrival offsets (s) of ``num`` requests at ``rate`` per second; all 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, starts = 0.0, []
    for _ in range(num):
        starts.append(t)
        t += rng.expovariate(rate)
    return starts


async def run_requests(
    target: Target,
    works: list[Workload],
    starts: list[float] | None = None,
    max_concurrency: int | None = None,
    desc: str = "",
) -> tuple[list[RequestOutput], float]:
    """Send ``works`` (at offsets ``starts``, or all at once) with at most ``max_concurrency``
    in flight. Returns the outputs in ``works`` order and the wall time of the whole run."""
    starts = starts or [0.0] * len(works)
    limit = max_concurrency or len(works)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    timeout = httpx.Timeout(1800.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        bar = tqdm(total=len(works), desc=desc, unit="req", leave=False, file=sys.stderr)
        t0 = time.perf_counter()

        async def one(work: Workload, at: float) -> RequestOutput:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                out = await send_request(client, target, work, t0)
            bar.update(1)
            return out

        outs = await asyncio.gather(*(one(w, s) for w, s in zip(works, starts, strict=True)))
        wall = time.perf_counter() - t0
        bar.close()
    return list(outs), wall


# --------------------------------------------------------------------------------------------
# targets


def parse_base_url(item: str) -> tuple[str, str]:
    """``NAME=URL`` or ``URL`` (named after its host:port)."""
    if "=" in item and not item.startswith("http"):
        name, url = item.split("=", 1)
    else:
        name, url = item.split("://", 1)[-1], item
    return name, url.rstrip("/").removesuffix("/v1")


def first_model(url: str) -> str:
    """The first model id ``/v1/models`` lists ("default" when it lists none)."""
    try:
        r = httpx.get(url + "/v1/models", timeout=30)
        data = r.json().get("data") or []
        return data[0]["id"] if data else "default"
    except (httpx.HTTPError, ValueError, KeyError):
        return "default"


def flush_cache(url: str) -> bool:
    """Best effort ``POST /flush_cache`` (splitserve, SGLang): every load level re-sends the same
    prompts, so a prefix cache would otherwise skip their prefill from the second level on."""
    try:
        return httpx.post(url + "/flush_cache", json={}, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------------------------
# main


def build_workloads(args: argparse.Namespace, tokenizer: Any) -> list[Workload]:
    if args.dataset == "sharegpt":
        prompts = load_prompts(tokenizer, args.num_prompts, args.max_input_len, data=args.data)
    else:
        prompts = random_prompts(tokenizer, args.num_prompts, args.input_len)
    works = []
    for ids in prompts:
        prompt: list[int] | str = ids if args.prompt_format == "ids" else tokenizer.decode(ids)
        works.append(Workload(prompt, len(ids), args.output_len))
    return works


@contextmanager
def open_target(spec: tuple[str, str], args: argparse.Namespace) -> Iterator[Target]:
    """A ``("url", "NAME=URL")`` or ``("launch", MODE)`` target, started if need be."""
    kind, value = spec
    if kind == "url":
        name, url = parse_base_url(value)
        ctx = nullcontext(url)
    else:
        value, name, kw = launch_fields(value, args.num_speculative_tokens)
        kw |= {
            "max_running": args.max_running,
            "threads_per_worker": args.threads_per_worker,
            "cuda_graph": not args.disable_cuda_graph,
        }
        if args.cpu_affinity:
            kw["cpu_affinity"] = args.cpu_affinity
        ctx = launch_cluster(value, args.model_path, args.dtype, **kw)
    with ctx as url:
        model = args.served_model or first_model(url)
        yield Target(name, url, model, not args.no_ignore_eos)


def run_target(
    target: Target, works: list[Workload], args: argparse.Namespace, slos: dict[str, float]
) -> list[dict[str, Any]]:
    """Warm up, then one run per load level."""
    warm = [Workload(w.prompt, w.prompt_len, min(8, w.output_len)) for w in works[:2]]
    outs, _ = asyncio.run(run_requests(target, warm))
    if any(not o.ok for o in outs):
        raise SystemExit(f"{target.name}: warm-up failed: {[o.error for o in outs if o.error]}")
    runs = []
    if args.request_rate:
        loads = [("request_rate", r, f"{r:g}/s") for r in args.request_rate]
    else:
        loads = [("concurrency", c, f"c={c}") for c in args.concurrency]
    for kind, value, label in loads:
        if args.flush_cache:
            flush_cache(target.url)
        if kind == "request_rate":
            starts, limit = poisson_starts(len(works), value), args.max_concurrency
        else:
            starts, limit = None, int(value)
        outs, wall = asyncio.run(
            run_requests(target, works, starts, limit, desc=f"{target.name} {label}")
        )
        s = summarize(outs, wall, slos)
        print_summary(target.name, label, s)
        runs.append(
            {
                "target": target.name,
                "url": target.url,
                "load": label,
                "load_kind": kind,
                "load_value": value if not math.isinf(value) else 1e9,
                "summary": s,
                "raw": {
                    "ttft": [o.ttft for o in outs if o.ok],
                    "e2e": [o.latency for o in outs if o.ok],
                    "itl": [x for o in outs if o.ok for x in o.itls],
                    "tpot": [o.tpot for o in outs if o.ok],
                },
            }
        )
    return runs


def run_hf_static(works: list[Workload], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``transformers`` static-batch baseline (bench/hf_static.py): one run per batch size
    (``--hf-concurrency``, default the concurrency levels)."""
    from hf_static import generate_static, load_hf

    device = args.hf_device or ("cuda" if _cuda_available() else "cpu")
    name = f"transformers static ({device})"
    model, tok = load_hf(args.model_path, args.dtype, device)
    prompts = [w.prompt for w in works]
    generate_static(model, tok, prompts[:2], min(8, args.output_len), 2)  # warm-up
    runs = []
    for c in args.hf_concurrency or args.concurrency:
        records, wall = generate_static(model, tok, prompts, args.output_len, c)
        outs = [RequestOutput(tag="", **r) for r in records]
        s = summarize(outs, wall, {})
        print_summary(name, f"c={c}", s)
        runs.append(
            {"target": name, "url": "", "load": f"c={c}", "load_kind": "concurrency",
             "load_value": c, "summary": s,
             "raw": {"ttft": [o.ttft for o in outs], "e2e": [o.latency for o in outs],
                     "itl": [x for o in outs for x in o.itls], "tpot": [o.tpot for o in outs]}}
        )  # fmt: skip
    del model
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return runs


def default_openvino_python() -> str:
    """The OpenVINO venv's python that bench/peers/openvino.sh makes under the cache folder."""
    from splitserve.config.env import cache_dir

    return str(cache_dir() / "openvino" / "venv" / "bin" / "python")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments (``serving_args``), ``--help`` headed by this module's first
    line."""
    return parse_serving_args(argv, __doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    args.model_path = resolve_model(args.model)
    args.dtype, why = resolve_bench_dtype(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model_path)
    slos = parse_slos(args.slo)
    works = build_workloads(args, tokenizer)
    lens = [w.prompt_len for w in works]
    print(f"CPU: {cpu_line()}", flush=True)
    print(
        f"{len(works)} {args.dataset} prompts (mean {statistics.fmean(lens):.0f}, max "
        f"{max(lens)} tokens), {args.output_len} output tokens each; launched clusters: "
        f"{args.dtype} ({why})",
        flush=True,
    )
    specs = [("url", u) for u in args.base_url] + [("launch", m) for m in args.launch]
    runs: list[dict[str, Any]] = run_hf_static(works, args) if args.hf_static else []
    if args.openvino:
        from ov_peer import run_openvino

        args.openvino_python = args.openvino_python or default_openvino_python()
        runs += run_openvino(works, args)
    for spec in specs:
        with open_target(spec, args) as target:
            runs += run_target(target, works, args, slos)
    print_table(runs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {
            "cpu": cpu_line(),
            "config": config,
            "runs": [{k: v for k, v in r.items() if k != "raw"} for r in runs],
        }
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        (args.out / "raw.json").write_text(
            json.dumps([{"target": r["target"], "load": r["load"], **r["raw"]} for r in runs])
        )
        paths = [] if args.no_plots else plot(runs, args.out)
        print(f"results in {args.out}: results.json raw.json " + " ".join(p.name for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
