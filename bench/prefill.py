"""Prefill of long prompts: time to first token (TTFT) and prefill tokens/s of ~1k- and ~4k-token
prompts, splitserve colocated and disaggregated against llama.cpp's ``llama-bench`` (issue 20,
item 4).

Each splitserve target is a local cluster started as ``bench/serving.py --launch`` starts it, with
the prefix cache off (``prefix_cache="none"``) and every request a distinct prompt of random
ordinary token ids, so nothing is reused. Per prompt length: one warm-up request (not counted),
then ``--reps`` requests one at a time, each ``max_tokens=1``, non-streaming; its wall time is the
TTFT (tokenize-free: the prompt is sent as ids; HTTP, scheduling, the prefill, the first token's
sampling and, disaggregated, the hand-off to the decode worker are in it). Prefill tok/s is
``prompt tokens / TTFT`` (median over the reps).

The peer: ``llama-bench -p LENGTHS -n 0 -t THREADS -r REPS`` on the F16 GGUF
(``bench/peers/llamacpp.sh`` builds it and converts the model on first use): prompt processing
in process, from an empty context, no HTTP, so its rate is an upper bound for ``llama-server``'s
TTFT on the same prompt; ours/llama.cpp below 1 means slower. Its F16 weights are our model's
bfloat16 weights in another 16-bit format (the same products' size). ``--base-url NAME=URL``
adds any OpenAI-compatible server, measured like ours (e.g. ``LLAMACPP_SLOTS=1
LLAMACPP_CTX=8192 bash bench/peers/llamacpp.sh serve`` for llama-server's own TTFT).

SmolLM2-135M-Instruct's context is 8192 tokens (``max_position_embeddings``; the server refuses
a prompt that leaves no room for one token), a worker prefills at most ``max_batch_tokens``
(2048) prompt tokens per step (a 4k prompt is two chunks), and its KV pool (``kv_cache_mb``
512, 23,040 bytes a token in bfloat16: 30 layers x K and V x 3 heads x 64) holds about 23k
tokens.

Usage::

    python bench/prefill.py                       # 1024 and 4096 tokens, 3 reps, both modes
    python bench/prefill.py --lengths 256 --reps 1 --launch colocated   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import cpu_line, launch_cluster, random_prompts, resolve_bench_dtype, resolve_model

LAUNCH_MODES = ("colocated", "disaggregated")


def ttft(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending ``prompt`` (token ids) to ``/v1/completions`` with ``max_tokens=1``
    to the whole answer.

    Raises:
        RuntimeError: the server answered an error, or counted other than ``len(prompt)``
            prompt tokens (it would not have prefilled what we think).
    """
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=1800.0)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    usage = r.json().get("usage") or {}
    if usage.get("prompt_tokens") not in (None, len(prompt)):
        raise RuntimeError(
            f"{url}: counted {usage['prompt_tokens']} prompt tokens, sent {len(prompt)}"
        )
    return elapsed


def model_card(url: str) -> dict[str, Any]:
    """The first entry of ``/v1/models`` (``{}`` if there is none)."""
    data = httpx.get(url + "/v1/models", timeout=30).json().get("data") or []
    return data[0] if data else {}


def measure(url: str, prompts: dict[int, list[list[int]]]) -> dict[int, list[float]]:
    """TTFTs (s) of ``prompts[length][1:]`` per length, after ``prompts[length][0]`` as warm-up.

    Raises:
        SystemExit: a length does not fit the server's ``max_model_len``.
    """
    card = model_card(url)
    limit = card.get("max_model_len")
    if limit is not None and max(prompts) >= int(limit):
        raise SystemExit(f"{url}: max_model_len {limit} leaves no room after {max(prompts)}")
    model = card.get("id", "default")
    out: dict[int, list[float]] = {}
    for length, batch in prompts.items():
        ttft(url, model, batch[0])
        out[length] = [ttft(url, model, p) for p in batch[1:]]
        med = statistics.median(out[length])
        print(
            f"  {length:5d} tokens: TTFT p50 {med * 1e3:8.1f} ms (min "
            f"{min(out[length]) * 1e3:.1f}), {length / med:8.1f} prefill tok/s",
            flush=True,
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt lengths in tokens"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="timed requests per length (each a distinct prompt; one more warms up)",
    )
    p.add_argument(
        "--launch",
        nargs="*",
        choices=LAUNCH_MODES,
        default=list(LAUNCH_MODES),
        help="splitserve clusters to start (none: --base-url targets only)",
    )
    p.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also measure this OpenAI-compatible server (prompt cache off there!)",
    )
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    p.add_argument(
        "--threads-per-worker",
        type=int,
        default=0,
        help="0: the launcher splits the cores (serving.py's default)",
    )
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip llama-bench")
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama-bench -t")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args(argv)
    if min(args.lengths) < 2 or args.reps < 1:
        p.error("--lengths must be at least 2 tokens and --reps at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model_path = resolve_model(args.model)
    dtype, why = resolve_bench_dtype(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # A seed per length: no two prompts of one run share a prefix beyond chance.
    prompts = {n: random_prompts(tokenizer, args.reps + 1, n, seed=n) for n in args.lengths}
    print(f"{cpu_line()}; load {os.getloadavg()}")
    print(
        f"{Path(model_path).name}, {dtype} ({why}), prompts of {args.lengths} random tokens, "
        f"{args.reps} rep(s) each after one warm-up, max_tokens 1, prefix cache off"
    )
    results: dict[str, dict[int, list[float]]] = {}
    for spec in args.base_url:
        name, _, url = spec.partition("=")
        print(f"{name} ({url})", flush=True)
        results[name] = measure(url.rstrip("/").removesuffix("/v1"), prompts)
    for mode in args.launch:
        name = f"splitserve {mode}" + (
            f" {args.quantization}" if args.quantization != "none" else ""
        )
        fields = {
            "quantization": args.quantization,
            "prefix_cache": "none",
            "threads_per_worker": args.threads_per_worker,
        }
        with launch_cluster(mode, model_path, dtype, **fields) as url:
            print(name, flush=True)
            results[name] = measure(url, prompts)
    peer: dict[int, dict] = {}
    if args.llamacpp:
        from llamacpp_tools import bench_prompt, gguf_paths

        gguf = gguf_paths(["f16"])["f16"]
        peer = bench_prompt(gguf, args.lengths, args.llamacpp_threads, args.reps)
        print(
            f"llama-bench F16, -t {args.llamacpp_threads}, -r {args.reps}, build "
            f"{next(iter(peer.values()))['build']}; load {os.getloadavg()}"
        )
        for n, r in peer.items():
            print(
                f"  {n:5d} tokens: {r['tok_s']:8.1f} +/- {r['std']:.1f} prompt tok/s "
                f"(TTFT {n / r['tok_s'] * 1e3:.1f} ms)"
            )
    print("prefill tok/s, p50 (ours / llama-bench F16):")
    for name, by_len in results.items():
        cells = []
        for n, times in by_len.items():
            rate = n / statistics.median(times)
            ratio = f" ({rate / peer[n]['tok_s']:.2f}x)" if n in peer else ""
            cells.append(f"{n}: {rate:.1f}{ratio}")
        print(f"  {name:32s} " + "   ".join(cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "config": {k: str(v) for k, v in vars(args).items()},
                    "cpu": cpu_line(),
                    "ttft_s": results,
                    "llama_bench": peer,
                },
                indent=2,
            )
        )
        print(f"results in {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
