"""The int8 weight products of a decode step (``bench/quant_matmul.py``'s SmolLM2-135M step: 30
layers of qkv, o, gate_up, down and the LM head), this checkout's kernels against another build
of the C kernels (``--old-lib``: a ``libsplitserve_cpu.so`` built from an earlier commit), in
one process: same weights and x, the outputs compared bit for bit, the two alternated within
each repeat (the machine may be shared), min and median reported. Usage::

    python bench/w8_old_new.py --old-lib OLD.so [--threads 1] [--repeats 9] [--rows 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from quant_matmul import HEAD_SHAPE as HEAD
from quant_matmul import LAYER_SHAPES as SHAPES

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.model.quant import Int8Weight, quantize_int8_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-lib", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    new = load_cpu_kernels()
    if new is None:
        raise SystemExit("this checkout's C kernels did not build")
    print(f"old {args.old_lib}\nthreads {args.threads}")
    old = CpuKernels(ctypes.CDLL(args.old_lib))
    gen = torch.Generator().manual_seed(0)
    ws = []
    for n, k in [s for _ in range(args.layers) for s in SHAPES] + [HEAD]:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        ws.append((k, Int8Weight(*quantize_int8_groups(w))))
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for k, _ in ws}}
        for k, w in ws[: len(SHAPES)] + ws[-1:]:
            a = old.linear_w8(xs[k], w.packed, w.scales, None)
            b = new.linear_w8(xs[k], w.packed, w.scales, None)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (rows, k)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.repeats):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                kern = old if name == "old" else new
                t0 = time.perf_counter()
                for k, w in ws:
                    kern.linear_w8(xs[k], w.packed, w.scales, None)
                times[name].append(time.perf_counter() - t0)
        o, n = times["old"], times["new"]
        print(f"rows {rows:3d}: old min {min(o) * 1e3:7.2f} ms med {statistics.median(o) * 1e3:7.2f}"
              f" | new min {min(n) * 1e3:7.2f} ms med {statistics.median(n) * 1e3:7.2f}"
              f" | new/old speed min {min(o) / min(n):.2f}x med "
              f"{statistics.median(o) / statistics.median(n):.2f}x", flush=True)


if __name__ == "__main__":
    main()
