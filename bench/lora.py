"""Multi-LoRA serving cost (issue 35): one colocated cluster serving the base model and rank-16
adapters on every projection, measured against the base model alone in the same run.

- c=32: closed-loop streams, requests spread evenly over 4 adapters, against the same streams
  on the base model (goal: >= 0.8x the base's output tokens/s; S-LoRA reports ~0.75-0.9x on
  GPUs);
- c=1: one stream through one adapter against one stream on the base (goal: >= 0.85x);
- load under load: base streams run while a fresh rank-16 adapter is loaded at run time
  (``POST /v1/load_lora_adapter``): the load's wall time and the streams' ITL p99 in the
  window of the load against the same streams without it.

Each ratio's two sides alternate ``--repeats`` times (base first, then adapters, ...); the
ratio is of the medians, and the spread (min..max of the per-pair ratios) is printed. The
adapters are random (PEFT's format and names, ``lora_B`` non-zero), so their cost is a trained
adapter's cost; ``--rank`` sets their rank. Prompts are random token ids.

    python bench/lora.py                        # about 3-4 minutes on 2 cores
    python bench/lora.py --duration 20 --repeats 3 --out bench/results/lora.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from common import (
    cpu_line,
    default_dtype,
    launch_cluster,
    percentile,
    random_prompts,
    resolve_model,
)
from serving import Target, Workload, first_model, send_request
from serving_metrics import RequestOutput

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model_path: str, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter for the model at ``model_path`` on all seven projections:
    ``adapter_config.json`` and ``adapter_model.safetensors`` as ``save_pretrained`` writes
    them (``lora_A`` and ``lora_B`` normal, std 0.02), in ``folder``."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    part = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
            "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            key = f"base_model.model.model.layers.{layer}.{part[t]}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": model_path,
        "task_type": "CAUSAL_LM",
    }))
    return folder


async def closed_loop(url: str, models: list[str], prompts: list[list[int]], concurrency: int,
                      output_len: int, duration: float) -> tuple[list[RequestOutput], float]:
    """``concurrency`` streams, each sending its next request when the last ends, until
    ``duration`` passes (those in flight finish); request ``k`` goes to ``models[k % len]``.
    Returns the outputs and the wall time."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    targets = [Target(m, url, m) for m in models]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + duration

        async def stream(i: int) -> list[RequestOutput]:
            outs, k = [], i
            while time.perf_counter() < deadline:
                ids = prompts[k % len(prompts)]
                work = Workload(ids, len(ids), output_len, models[k % len(models)])
                outs.append(await send_request(client, targets[k % len(targets)], work, t0))
                k += concurrency
            return outs

        results = await asyncio.gather(*(stream(i) for i in range(concurrency)))
        return [o for outs in results for o in outs], time.perf_counter() - t0


def tok_s(outs: list[RequestOutput], wall: float) -> float:
    failed = [o.error for o in outs if not o.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[:3]}")
    return sum(o.output_tokens for o in outs) / wall


def compare(url: str, name: str, lora_models: list[str], prompts: list[list[int]],
            concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """Base and adapters alternating ``args.repeats`` times at ``concurrency``."""
    base, lora = [], []
    for r in range(args.repeats):
        for side, models, into in (("base", [args.base], base), ("lora", lora_models, lora)):
            outs, wall = asyncio.run(closed_loop(url, models, prompts, concurrency,
                                                 args.output_len, args.duration))
            into.append(tok_s(outs, wall))
            print(f"  {name} repeat {r + 1} {side:<4}: {into[-1]:7.1f} tok/s "
                  f"({len(outs)} requests)", flush=True)
    pairs = [lo / b for lo, b in zip(lora, base, strict=True)]
    ratio = statistics.median(lora) / statistics.median(base)
    return {"base_tok_s": base, "lora_tok_s": lora, "ratio": ratio,
            "pair_ratio_min": min(pairs), "pair_ratio_max": max(pairs)}


def load_under_load(url: str, folder: Path, prompts: list[list[int]],
                    args: argparse.Namespace) -> dict[str, Any]:
    """Base streams at ``args.load_concurrency``: ITL p99 alone, then with a run-time load of
    ``folder`` in the middle (ITLs of gaps that overlap the load's window)."""
    c, dur = args.load_concurrency, args.duration

    async def with_load() -> tuple[list[RequestOutput], float, float, int]:
        run = asyncio.create_task(closed_loop(url, [args.base], prompts, c, args.output_len, dur))
        await asyncio.sleep(dur / 3)
        async with httpx.AsyncClient(timeout=600.0) as client:
            t_start = time.perf_counter()
            r = await client.post(url + "/v1/load_lora_adapter",
                                  json={"lora_name": "fresh", "lora_path": str(folder)})
            t_end = time.perf_counter()
        outs, _ = await run
        return outs, t_start, t_end, r.status_code

    quiet, _ = asyncio.run(closed_loop(url, [args.base], prompts, c, args.output_len, dur))
    t_before = time.perf_counter()
    outs, t_start, t_end, status = asyncio.run(with_load())
    if status != 200:
        raise SystemExit(f"load_lora_adapter: HTTP {status}")
    tok_s(quiet + outs, 1.0)  # raises on any failed request
    quiet_itl = [x for o in quiet for x in o.itls]
    # Gaps that overlap [t_start, t_end] (their times relative to the run's own t0 ~ t_before).
    window = []
    for o in outs:
        t = t_before + o.start + o.ttft
        for gap in o.itls:
            if t + gap >= t_start and t <= t_end:
                window.append(gap)
            t += gap
    all_itl = [x for o in outs for x in o.itls]
    return {"load_s": t_end - t_start, "itl_p99_ms_quiet": percentile(quiet_itl, 99) * 1e3,
            "itl_p99_ms_during_load_run": percentile(all_itl, 99) * 1e3,
            "itl_max_ms_in_load_window": max(window, default=float("nan")) * 1e3,
            "gaps_in_load_window": len(window)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="base model folder (default: SmolLM2-135M)")
    p.add_argument("--dtype", default=None, help="serving dtype (default: this CPU's)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--duration", type=float, default=12.0, help="seconds per measured side")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--load-concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="threads of the colocated worker")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = resolve_model(args.model_path)
    dtype = args.dtype or default_dtype()[0]
    print(f"CPU: {cpu_line()}\nmodel {model_path} ({dtype}), rank {args.rank}, input "
          f"{args.input_len}, output {args.output_len}, {args.duration:g} s per side x "
          f"{args.repeats}", flush=True)
    from transformers import AutoTokenizer

    prompts = random_prompts(AutoTokenizer.from_pretrained(model_path), 64, args.input_len)
    names = [f"lora{i}" for i in range(4)]
    with TemporaryDirectory() as tmp:
        folders = {n: write_adapter(model_path, Path(tmp) / n, args.rank, i)
                   for i, n in enumerate(names)}
        fresh = write_adapter(model_path, Path(tmp) / "fresh", args.rank, 99)
        fields = {"lora_modules": {n: str(f) for n, f in folders.items()}, "max_loras": 5,
                  "max_lora_rank": max(64, args.rank), "threads_per_worker": args.threads,
                  "max_running": 64, "prefix_cache": "none"}
        results: dict[str, Any] = {"cpu": cpu_line(), "dtype": dtype, "rank": args.rank}
        with launch_cluster("colocated", model_path, dtype, **fields) as url:
            args.base = first_model(url)  # the base model comes first, then the adapters
            asyncio.run(closed_loop(url, [args.base, *names], prompts[:5], 5, 4, 0.01))  # warm
            print("c=32, 4 adapters vs base:", flush=True)
            results["c32"] = compare(url, "c=32", names, prompts, 32, args)
            print("c=1, 1 adapter vs base:", flush=True)
            results["c1"] = compare(url, "c=1", names[:1], prompts, 1, args)
            print(f"load a rank-{args.rank} adapter under c={args.load_concurrency} base "
                  "streams:", flush=True)
            results["load"] = load_under_load(url, fresh, prompts, args)
    c32, c1, ld = results["c32"], results["c1"], results["load"]
    print(f"\nCPU: {results['cpu']}")
    print(f"c=32, 4 adapters / base: {c32['ratio']:.2f}x (pairs {c32['pair_ratio_min']:.2f}.."
          f"{c32['pair_ratio_max']:.2f}; goal >= 0.8x)")
    print(f"c=1, 1 adapter / base:   {c1['ratio']:.2f}x (pairs {c1['pair_ratio_min']:.2f}.."
          f"{c1['pair_ratio_max']:.2f}; goal >= 0.85x)")
    print(f"rank-{args.rank} load under load: {ld['load_s'] * 1e3:.0f} ms; streams' ITL p99 "
          f"{ld['itl_p99_ms_quiet']:.1f} ms without, {ld['itl_p99_ms_during_load_run']:.1f} ms "
          f"in the run with the load; largest gap in the load's window "
          f"{ld['itl_max_ms_in_load_window']:.1f} ms ({ld['gaps_in_load_window']} gaps)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    ok = c32["ratio"] >= 0.8 and c1["ratio"] >= 0.85
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
