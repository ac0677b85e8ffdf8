"""The most output tokens per second a serving run could reach on this machine: the run's matrix
work (prefill and decode, from the model's shapes and the run's prompts) divided by the bf16
product rates measured here, now, with everything else (attention, sampling, Python, HTTP)
taken as free. Compared with the measured rates in a ``bench/serving.py`` results file, it
says how far a goal such as "4x llama.cpp's server" is from what the hardware allows.

    python bench/roofline.py --num-prompts 32 --output-len 64 --concurrency 32 \\
        --results bench/results/<run>/results.json

Two bounds are printed:

* **step rates**: each product at the row count it really has (decode: ``concurrency`` rows;
  prefill: all of a wave's prompt tokens in one product), timed with the faster of oneDNN on
  pre-packed weights and the engine's own C tiles, weights in cache;
* **peak**: every product at the best rate measured for any shape here (usually 2048 rows),
  i.e. even if a kernel ran the 32-row decode products as well as the largest ones.

Matrix FLOPs count ``2 * rows * in * out`` for the projections and the LM head (decode: every
token; prefill: only each prompt's last token), plus the attention products
(``4 * Hq * D`` per query-key pair; causal pairs for prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import add_data_argument, load_prompts, resolve_model

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import Linear, can_pack, pack_weight, packed_linear
from splitserve.engine.step_plan import product_for


@dataclass
class Shapes:
    """One layer's projections as ``(out_features, in_features)``, and the LM head."""

    layer: list[tuple[int, int]]
    head: tuple[int, int]

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shapes:
        h = cfg.hidden_size
        layer = [
            (cfg.q_size + 2 * cfg.kv_size, h),  # fused q/k/v
            (h, cfg.q_size),  # o
            (2 * cfg.intermediate_size, h),  # fused gate/up
            (h, cfg.intermediate_size),  # down
        ]
        return cls(layer, (cfg.vocab_size, h))


RATES: list[float] = []  # FLOP/s of every product timed in this run


def time_linear(rows: int, out_f: int, in_f: int, budget_s: float = 0.3) -> float:
    """Median seconds of one bf16 ``[rows, in] @ [out, in].T``: the faster of oneDNN on its
    pre-packed weight and the engine's own ``Linear`` (the C tiles up to 128 rows where the CPU
    has AVX512_BF16). The weight stays in cache between calls, so the rate is optimistic, as an
    upper bound should be. The rate is kept in ``RATES``."""
    x = torch.randn(rows, in_f).to(torch.bfloat16)
    w = (torch.randn(out_f, in_f) * in_f**-0.5).to(torch.bfloat16)
    contenders = [lambda: torch.nn.functional.linear(x, w)]
    if can_pack(w):
        packed = pack_weight(w)
        contenders = [lambda: packed_linear(x, packed, None)]
    engine = Linear(in_f, out_f, False, torch.bfloat16)
    engine.weight.data.copy_(w)
    engine.pack()
    # The step planner's choice for the layers before a kernel plan: C up to the tiles' limit.
    product = product_for(rows, engine.kernels.decode_max_rows if engine.kernels else 0)
    contenders.append(lambda: engine(x, product))
    best = float("inf")
    for run in contenders:
        for _ in range(3):
            run()
        times: list[float] = []
        end = time.perf_counter() + budget_s / len(contenders)
        while time.perf_counter() < end or len(times) < 5:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    RATES.append(2 * rows * out_f * in_f / best)
    return best


def pass_seconds(shapes: Shapes, num_layers: int, rows: int, head_rows: int) -> float:
    """Seconds of one forward pass's products: ``rows`` through every layer, ``head_rows``
    through the LM head."""
    per_layer = sum(time_linear(rows, o, i) for o, i in shapes.layer)
    head = time_linear(head_rows, *shapes.head) if head_rows else 0.0
    return num_layers * per_layer + head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the engine's)")
    p.add_argument("--results", type=Path, default=None, help="a serving.py results.json")
    add_data_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model)
    prompts = load_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts,
                           args.max_input_len, data=args.data)
    lens = [len(x) for x in prompts]
    shapes, layers, c, out_len = Shapes.of(cfg), cfg.num_layers, args.concurrency, args.output_len
    qd = cfg.num_heads * cfg.head_dim

    # FLOPs of the whole run.
    layer_flops = 2 * sum(o * i for o, i in shapes.layer)
    head_flops = 2 * shapes.head[0] * shapes.head[1]
    prefill = sum(n * layers * layer_flops + head_flops for n in lens)
    prefill_attn = sum(4 * qd * layers * n * (n + 1) // 2 for n in lens)
    decode = len(lens) * out_len * (layers * layer_flops + head_flops)
    decode_attn = sum(4 * qd * layers * sum(n + t for t in range(out_len)) for n in lens)
    total = prefill + prefill_attn + decode + decode_attn

    # Rates measured now: decode steps of c rows, prefill waves of c prompts in one product.
    waves = [lens[i : i + c] for i in range(0, len(lens), c)]
    steps = sum(out_len for _ in waves)  # every wave decodes out_len steps at <= c rows
    rows_per_wave = [len(w) for w in waves]
    decode_s = sum(out_len * pass_seconds(shapes, layers, r, r) for r in rows_per_wave)
    prefill_s = sum(pass_seconds(shapes, layers, sum(w), len(w)) for w in waves)
    pass_seconds(shapes, layers, 2048, 2048)  # large products: usually the best rate
    peak = max(RATES)
    step_bound = (prefill_s + decode_s) + (prefill_attn + decode_attn) / peak
    peak_bound = total / peak
    tokens = len(lens) * out_len

    print(
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}; {len(lens)} prompts (mean "
        f"{statistics.mean(lens):.0f}, max {max(lens)} tokens), {out_len} output tokens each, "
        f"concurrency {c}, {args.threads} thread(s), bfloat16"
    )
    print(
        f"matrix work: prefill {prefill / 1e12:.3f} TFLOP (+ attention {prefill_attn / 1e12:.3f}),"
        f" decode {decode / 1e12:.3f} TFLOP (+ attention {decode_attn / 1e12:.3f}), "
        f"{steps} decode steps"
    )
    print(
        f"measured products: decode steps {decode_s:.2f} s, prefill {prefill_s:.2f} s; "
        f"best rate {peak / 1e9:.0f} GFLOP/s"
    )
    bounds = {"step rates": tokens / step_bound, "peak": tokens / peak_bound}
    for name, tok_s in bounds.items():
        print(f"  upper bound at {name}: {tok_s:7.1f} output tok/s")
    if args.results:
        runs = json.loads(args.results.read_text())["runs"]
        load = f"c={c}"
        print(f"measured in {args.results} at {load}:")
        for run in runs:
            if run["load"] != load:
                continue
            got = run["summary"]["output_throughput"]
            ratios = ", ".join(f"{got / b:.0%} of the {n} bound" for n, b in bounds.items())
            print(f"  {run['target']:<28} {got:7.1f} tok/s ({ratios})")
            for name, tok_s in bounds.items():
                if run["target"].startswith("llama.cpp"):
                    print(f"    -> the {name} bound is {tok_s / got:.2f}x this")
    return 0


if __name__ == "__main__":
    sys.exit(main())
