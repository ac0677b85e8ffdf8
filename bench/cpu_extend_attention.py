"""The C extend (prefill) attention kernel (``engine/kernels/cpu/csrc/extend_attention.c``) against torch's
``scaled_dot_product_attention`` (what the torch backend ran before), one layer, same process,
interleaved, best of rounds.

For each thread count and each (new tokens, cached prefix) case: milliseconds and GFLOP/s of
both (causal work only: ``2 * 2 * Hq * D`` per visible query-key pair) and SDPA's time over the
kernel's (> 1: the kernel is faster). The kernel reads K/V from a paged pool in shuffled pages;
SDPA gets them contiguous, as if the gather were free. Not a test: timings on a shared machine
vary; the printed load says how quiet it was.

    python bench/cpu_extend_attention.py                     # SmolLM2-135M's heads, 1 and 2 threads
    python bench/cpu_extend_attention.py --heads 32 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels

PAGE_SIZE = 16
# (new tokens, cached prefix): a short prompt, a ShareGPT-length one, the interference run's
# 1536-token prompt, and a follow-up turn over a cached conversation.
CASES = ((64, 0), (256, 0), (1536, 0), (256, 1280))


def best_of(fn: Callable[[], object], rounds: int) -> float:
    """Best seconds per call over ``rounds`` (after two warm-up calls)."""
    fn()
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def causal_flops(n: int, prefix: int, hq: int, d: int) -> float:
    """Score and value products over the visible (query, key) pairs."""
    pairs = n * prefix + n * (n + 1) / 2
    return 4.0 * hq * d * pairs


def time_case(
    kernels: CpuKernels, n: int, prefix: int, hq: int, hkv: int, d: int, rounds: int
) -> tuple[float, float] | None:
    """(kernel, SDPA) best seconds for ``n`` new tokens over ``prefix`` cached ones; None when
    the kernel declines."""
    s = n + prefix
    g = torch.Generator().manual_seed(s)
    num_pages = -(-s // PAGE_SIZE)
    pool = torch.randn(num_pages, 1, 2, PAGE_SIZE, hkv, d, generator=g).bfloat16()
    pages = torch.randperm(num_pages, generator=g)
    k = pool[pages, 0, 0].reshape(-1, hkv, d)[:s].transpose(0, 1)[None].contiguous()
    v = pool[pages, 0, 1].reshape(-1, hkv, d)[:s].transpose(0, 1)[None].contiguous()
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    qt = q.transpose(0, 1)[None]
    mask = torch.arange(s)[None] <= torch.arange(prefix, s)[:, None] if prefix else None

    def kernel() -> object:
        return kernels.extend_attention(q, pool, 0, pages, s, None, d**-0.5)

    def sdpa() -> object:
        return F.scaled_dot_product_attention(
            qt, k, v, attn_mask=mask, is_causal=mask is None, scale=d**-0.5, enable_gqa=True
        )

    if kernel() is None:
        return None
    return best_of(kernel, rounds), best_of(sdpa, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        print("the C kernels are off here (no compiler or SPLITSERVE_CPU_KERNELS=0)")
        return 1
    hq, hkv = args.heads
    d = args.head_dim
    print(f"load {os.getloadavg()[0]:.2f}; Hq {hq}, Hkv {hkv}, D {d}, bfloat16, causal")
    print(f"{'thr':>3} {'new':>5} {'prefix':>6} | {'kernel ms':>9} {'GFLOP/s':>7} | "
          f"{'SDPA ms':>8} {'GFLOP/s':>7} | SDPA/kernel")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, prefix in CASES:
            times = time_case(kernels, n, prefix, hq, hkv, d, args.rounds)
            if times is None:
                print("the kernel declines this shape or CPU (needs AVX512-BF16)")
                return 1
            tk, ts = times
            fl = causal_flops(n, prefix, hq, d) / 1e9
            print(f"{threads:>3} {n:>5} {prefix:>6} | {tk * 1e3:>9.2f} {fl / tk:>7.0f} | "
                  f"{ts * 1e3:>8.2f} {fl / ts:>7.0f} | {ts / tk:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
