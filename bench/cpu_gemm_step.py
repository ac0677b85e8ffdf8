"""Whole decode steps with the C tiles (``gemm_bf16.c``) against oneDNN, in one process: steps
alternate between the two (the model's kernel plan switched between the tiles' limit
and the skinny kernel's, which is main's behaviour), so a noisy neighbour on this shared machine
hits both alike. Prints each side's median step and the median of the paired ratios.

    python bench/cpu_gemm_step.py --batch 32 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import default_dtype, resolve_model
from profile_decode import build

from splitserve.engine.kernels.cpu.bindings import SKINNY_MAX_ROWS
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.model.kernel_plan import ProductPlan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--min-prompt-len", type=int, default=20)
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    assert kernels is not None and kernels.has_gemm, "no AVX512_BF16 tiles on this machine"
    tiles_rows = kernels.decode_max_rows
    core = build(
        resolve_model(args.model), default_dtype()[0], args.batch, args.prompt_len,
        1000, args.min_prompt_len,
    )
    model = core.runner.model
    modes = {"oneDNN": SKINNY_MAX_ROWS, "C tiles": tiles_rows}
    times: dict[str, list[float]] = {name: [] for name in modes}
    print(f"load average at start: {os.getloadavg()}")
    for i in range(args.pairs + 2):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for name in order:
            model.set_product_plan(ProductPlan(modes[name], modes[name], name))
            t0 = time.perf_counter()
            core.step()
            if i >= 2:  # the first two pairs warm up
                times[name].append(time.perf_counter() - t0)
    print(f"load average at end: {os.getloadavg()}")
    base = times["oneDNN"]
    ratios = [a / b for a, b in zip(base, times["C tiles"], strict=True)]
    print(f"batch {args.batch}, {args.threads} thread(s), {args.pairs} step pairs:")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        print(f"  {name:<8} median {statistics.median(ts) * 1e3:6.1f} ms (quartiles "
              f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})")
    print(f"  oneDNN / C tiles, median of paired ratios: x{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
