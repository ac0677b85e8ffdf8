"""The C bfloat16 product of the batched decode step (``csrc/gemm_bf16.c``) against oneDNN on its
pre-packed weight (what ``Linear`` runs), in the same process, interleaved, medians of rounds.

For each thread count, each of SmolLM2-135M's projection shapes and the LM head, and each row
count: microseconds and GFLOP/s of both, and oneDNN's time over ours (> 1: ours is faster). Then
one decode step's products (30 layers x 4 projections + the LM head) summed at each row count.
By default each call reads another copy of the weight (copies totalling > 64 MB, twice this
machine's L3), so weights come from memory as in a real step where 30 layers' weights (~270 MB)
pass through; ``--warm`` reuses one copy (cache-resident, flattering both). Not a test: timings
on a shared machine vary; the printed load says how quiet it was.

    python bench/cpu_gemm.py                          # M 4 8 16 32 64, 1 and 2 threads
    python bench/cpu_gemm.py --blockings 0 1 2 3      # every tile shape the kernel has
    python bench/cpu_gemm.py --rows 1 2 3 4 --skinny  # the skinny kernel too (crossover)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from itertools import cycle

import torch

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.model.layers import pack_weight, packed_linear

# (name, N, K, times per decode step): SmolLM2-135M's fused projections and its tied LM head.
SHAPES = (
    ("qkv", 960, 576, 30),
    ("o", 576, 576, 30),
    ("gate_up", 3072, 576, 30),
    ("down", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
)
BLOCK_NAMES = {0: "8x3", 1: "4x6", 2: "6x4", 3: "12x2"}
COLD_BYTES = 64 << 20


def rotating(fn: Callable[[torch.Tensor], object], copies: list[torch.Tensor]) -> Callable:
    """``fn`` on the next of ``copies`` at each call (round-robin)."""
    it = cycle(copies)
    return lambda: fn(next(it))


def cpu_idle(seconds: float = 0.25) -> float:
    """Fraction of all CPUs idle over ``seconds`` (from /proc/stat; 1.0 where unreadable)."""

    def sample() -> tuple[int, int]:
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return 0, 0
        return vals[3] + vals[4], sum(vals)

    i0, t0 = sample()
    time.sleep(seconds)
    i1, t1 = sample()
    return (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0


def wait_quiet(max_wait_s: float, min_idle: float = 0.9) -> float:
    """Wait (up to ``max_wait_s``) until the machine is idle, as another user's process on one
    of two cores stalls every OpenMP barrier; returns the idle fraction last seen."""
    deadline = time.monotonic() + max_wait_s
    idle = cpu_idle()
    while idle < min_idle and time.monotonic() < deadline:
        idle = cpu_idle()
    return idle


def median_times(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float) -> dict:
    """Median seconds per call of each function, measured round-robin so that a noisy neighbour
    hits every contender alike (in reverse order every other round: the order itself biased
    results by a few percent); each round runs each function for about ``budget_s``."""
    iters = {}
    for name, fn in fns.items():  # warm up and size the inner loop
        fn()
        t0 = time.perf_counter()
        fn()
        iters[name] = max(1, int(budget_s / max(time.perf_counter() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name, fn in list(fns.items())[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blockings", type=int, nargs="+", default=[0])
    ap.add_argument("--skinny", action="store_true", help="time the 1-3 row kernel too")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-ms", type=float, default=6.0, help="per contender per round")
    ap.add_argument("--warm", action="store_true", help="one weight copy (cache-resident)")
    ap.add_argument("--quiet-wait-s", type=float, default=20.0, help="per row, for idle CPUs")
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C kernels did not build"
    print(f"load average at start: {os.getloadavg()}")
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, n, k, _ in SHAPES:
        if name in args.shapes:
            copies = 1 if args.warm else COLD_BYTES // (2 * n * k) + 2
            ws = [
                (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
                for _ in range(copies)
            ]
            weights[name] = (
                ws, [pack_weight(w) for w in ws], [CpuKernels.pack_decode(w) for w in ws],
            )
    step: dict[tuple[int, int, str], float] = {}
    print("threads shape M, idle fraction before, oneDNN us GFLOP/s | ours ... x(oneDNN/ours)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, n, k, per_step in SHAPES:
            if name not in weights:
                continue
            ws, packed, gemm_w = weights[name]
            for m in args.rows:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                fns: dict[str, Callable[[], object]] = {
                    "onednn": rotating(lambda p, x=x: packed_linear(x, p, None), packed)
                }
                ref = packed_linear(x, packed[0], None).float()
                for b in args.blockings:
                    fns[BLOCK_NAMES[b]] = rotating(
                        lambda p, x=x, b=b: kernels.linear_gemm(x, p, None, b), gemm_w
                    )
                    out = kernels.linear_gemm(x, gemm_w[0], None, b)
                    assert out is not None, "no AVX512_BF16: the kernel refused"
                    assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max()
                if args.skinny and m <= 4:
                    fns["skinny"] = rotating(
                        lambda p, x=x: kernels.linear_skinny(x, p, None), gemm_w
                    )
                idle = wait_quiet(args.quiet_wait_s)
                t = median_times(fns, args.rounds, args.budget_ms / 1e3)
                flops = 2.0 * m * n * k
                line = f"{threads:>3} {name:>8} {m:>3} idle {idle:4.2f} {t['onednn'] * 1e6:9.1f} "
                line += f"{flops / t['onednn'] / 1e9:5.0f}"
                for key, sec in t.items():
                    step[(threads, m, key)] = step.get((threads, m, key), 0.0) + per_step * sec
                    if key != "onednn":
                        line += f" | {key:>6} {sec * 1e6:8.1f} us {flops / sec / 1e9:5.0f} GF/s"
                        line += f" x{t['onednn'] / sec:4.2f}"
                print(line, flush=True)
    print(f"load average at end: {os.getloadavg()}")
    if len(weights) == len(SHAPES):
        print("one decode step's products (30 x qkv/o/gate_up/down + LM head), ms:")
        for (threads, m, key), sec in sorted(step.items()):
            base = step[(threads, m, "onednn")]
            print(f"  threads {threads} M {m:>3} {key:>6}: {sec * 1e3:7.2f} ms  x{base / sec:4.2f}")


if __name__ == "__main__":
    main()
