"""Weight-only int8/int4 products against our bfloat16 ones, on a decode step's worth of weights.

One "step" is every projection of SmolLM2-135M (30 layers of qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) plus the LM head (576->49152), each with its own random weight, so the
~270 MB of bfloat16 weights stream from memory as in a real decode step (a single matrix in a
loop would sit in cache and measure compute only). Kernels, interleaved within each repeat and
the fastest repeat kept (the machine is shared):

- ``bf16 C``: ``CpuKernels.linear_decode`` (gemv.c / gemm_bf16.c), today's decode products;
- ``bf16 oneDNN``: ``mkldnn._linear_pointwise`` on the oneDNN-packed weight;
- ``int8 torch``: ``aten._weight_int8pack_mm`` (per-channel int8, converts in registers; the
  op takes no block scales);
- ``int8 C``: ``CpuKernels.linear_w8`` (gemm_w8.c, AVX512-VNNI, weight scales and x as int8
  per block of 32: ``--quantization int8`` on CPU);
- ``int4 torch``: ``aten._weight_int4pack_mm_for_cpu`` on ``--quantization int4``'s weights
  (symmetric groups of 32, ``engine.model.quant_int4``; its scales in bfloat16);
- ``int4 C``: ``CpuKernels.linear_w4`` (gemm_w4.c, AVX512-VNNI, x as int8 per group of 32),
  the same levels and scales.

The rows default to decode's buckets (1-32) and a prompt chunk (128). Ratios are against
the first kernel (``bf16 C`` unless ``--kinds`` names others) measured in the same run. Usage::

    python bench/quant_matmul.py [--rows 1 2 4 8 16 32 128] [--repeats 5] [--layers 30]
        [--threads 1] [--kinds 'bf16 C' 'int8 C']
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.kernels.cpu.features import cpu_line
from splitserve.engine.model.layers import pack_weight, packed_linear
from splitserve.engine.model.quant import Int8Weight, quantize_int8, quantize_int8_groups
from splitserve.engine.model.quant_int4 import Int4Weight, quantize_int4, torch_int4_mm

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) per layer
HEAD_SHAPE = (49152, 576)


def make_weights(layers: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in LAYER_SHAPES] + [HEAD_SHAPE]
    out = []
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        q, s = quantize_int8(w)
        out.append({"k": k, "c": CpuKernels.pack_decode(w), "onednn": pack_weight(w),
                    "q": q, "s": s.bfloat16(), "w8": Int8Weight(*quantize_int8_groups(w)),
                    "w4": Int4Weight(*quantize_int4(w))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads (1: on a loaded shared machine every parallel "
                         "region waits for its slowest thread)")
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="only these kernels, e.g. 'bf16 C' 'int8 C' (the first is the baseline)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.has_w8 or not kernels.has_w4:
        raise SystemExit("the C kernels (with AVX512-VNNI) are needed")
    print(f"{cpu_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load: {os.getloadavg()}  (shared machine: min of {args.repeats} interleaved repeats)")
    weights = make_weights(args.layers)
    mb = sum(w["c"].numel() * 2 for w in weights) / 1e6
    print(f"{len(weights)} products per step, {mb:.0f} MB of bfloat16 weights")
    kinds = {
        "bf16 C": lambda x, w: kernels.linear_decode(x, w["c"], None),
        "bf16 oneDNN": lambda x, w: packed_linear(x, w["onednn"], None),
        "int8 torch": lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w["q"], w["s"]),
        "int8 C": lambda x, w: kernels.linear_w8(x, w["w8"].packed, w["w8"].scales, None),
        "int4 torch": lambda x, w: torch_int4_mm(x, w["w4"].torch_packed, w["w4"].torch_sz,
                                                 None),
        "int4 C": lambda x, w: kernels.linear_w4(x, w["w4"].packed, w["w4"].scales, None),
    }
    if args.kinds:
        kinds = {name: kinds[name] for name in args.kinds}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w["k"] for w in weights}}
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.repeats):
            for name, fn in kinds.items():
                t0 = time.perf_counter()
                for w in weights:
                    fn(xs[w["k"]], w)
                best[name] = min(best[name], time.perf_counter() - t0)
        base = next(iter(best.values()))
        cells = "  ".join(f"{n} {t * 1e3:7.2f} ms ({base / t:4.2f}x)" for n, t in best.items())
        print(f"rows {rows:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
