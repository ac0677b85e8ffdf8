"""Attention kernel timing: the Triton backend against the torch (SDPA) backend, one layer.

Times ``backend.forward`` (the K/V write included, ``prepare`` excluded: it runs once per forward,
not per layer) for decode batches and for extend (prefill) batches over a paged pool with pages
handed out in shuffled order. Prints a table of microseconds per call and the speed-up, and writes
JSON. Meant for a CUDA machine (bench/gpu_check.sh); on CPU the Triton backend only runs under the
interpreter and timings mean nothing.

    python bench/attention_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from splitserve.engine.attention.base import create_attention_backend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for

PAGE_SIZE = 16
# (name, query heads, KV heads, head_dim): the default model's attention and a Llama-3-8B layer.
SHAPES = [("smollm2-135m", 9, 3, 64), ("llama3-8b", 32, 8, 128)]


def time_call(fn, iters: int) -> float:
    """Median microseconds per call (CUDA events when on GPU, else wall clock)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return sorted(samples)[len(samples) // 2]


def bench_case(
    plan: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    iters: int,
) -> dict[str, float]:
    """``plan``: per sequence ``(cached_len, new_len)``. Returns microseconds per backend."""
    total = sum(pages_for(c + n, PAGE_SIZE) for c, n in plan) + 1
    pool = KVPool(KVLayout(1, hkv, d, PAGE_SIZE, str(dtype).removeprefix("torch.")), total, device)
    pool.buffer.normal_()
    free = list(range(1, total))
    random.Random(0).shuffle(free)
    pages = []
    for c, n in plan:
        k = pages_for(c + n, PAGE_SIZE)
        pages.append(free[:k])
        free = free[k:]
    batch = build_forward_batch(
        [[0] * n for _, n in plan], [c for c, _ in plan], pages, PAGE_SIZE, [], device
    )
    t = sum(n for _, n in plan)
    q = torch.randn(t, hq, d, device=device, dtype=dtype)
    k = torch.randn(t, hkv, d, device=device, dtype=dtype)
    v = torch.randn(t, hkv, d, device=device, dtype=dtype)
    out = {}
    for name in ("torch", "triton"):
        backend = create_attention_backend(name)
        meta = backend.prepare(batch, pool, None)
        out[name] = time_call(
            lambda b=backend, m=meta: b.forward(q, k, v, 0, m, pool, d**-0.5), iters
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    decode = [(1, 1024), (8, 1024), (32, 1024), (128, 1024), (32, 4096)]
    extend = [(1, 0, 2048), (4, 1024, 512)]  # (sequences, cached prefix, new tokens)
    if args.quick:
        decode, extend = [(2, 64)], [(1, 16, 16)]
    rows = []
    for shape, hq, hkv, d in SHAPES:
        for bs, ctx in decode:
            plan = [(ctx - 1 - (i * 7) % 64, 1) for i in range(bs)]  # ragged lengths near ctx
            us = bench_case(plan, hq, hkv, d, dtype, device, args.iters)
            rows.append({"shape": shape, "kind": "decode", "batch": bs, "ctx": ctx, **us})
        for bs, prefix, new in extend:
            us = bench_case([(prefix, new)] * bs, hq, hkv, d, dtype, device, args.iters)
            rows.append({"shape": shape, "kind": "extend", "batch": bs, "ctx": prefix + new, **us})
    print(
        f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), {args.dtype}"
    )
    print(
        f"{'shape':14} {'kind':7} {'batch':>5} {'ctx':>6} {'torch us':>10} {'triton us':>10} {'x':>6}"
    )
    for r in rows:
        r["speedup"] = r["torch"] / r["triton"]
        print(
            f"{r['shape']:14} {r['kind']:7} {r['batch']:5d} {r['ctx']:6d} "
            f"{r['torch']:10.1f} {r['triton']:10.1f} {r['speedup']:6.2f}"
        )
    if args.out:
        meta = {"device": device, "dtype": args.dtype, "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
