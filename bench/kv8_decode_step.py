"""A batch-B decode step over a long context, bfloat16 KV pages against ``--kv-cache-dtype int8``
(and fp8_e4m3), in one process, steps interleaved (one of each in turn) and the fastest of each
kept: the shared machine's noise hits all alike.

The default model in bfloat16 (its kernel plan, the C products; int8 weights where a config
says so, with that model's own kernel plan) runs ``DecoderLM.forward`` for B decode rows, each
over ``--context`` tokens of K/V written into its pool beforehand (random values: the step's
time does not depend on them), with the decode KV cache on, as a worker runs.
Configurations, each with its own pool and attention backend:

- ``bf16``: bfloat16 pages, the C decode attention and fused decode layers (the default path);
- ``bf16-torch``: bfloat16 pages, attention in torch ops only (``--disable-cpu-kernels``'s
  attention, no fused decode layers);
- ``int8``, ``fp8_e4m3``: 8-bit pages, the same C path as ``bf16`` (fused decode layers, whose
  KV append quantizes each new token into its page, ``csrc/kv_quant.c``); decode rows read the
  8-bit pages where they are (``csrc/decode_attention_q8.c``, de-quantizing in registers), so
  no decode cache is kept for them;
- ``int8w+int8kv``: ``--quantization int8`` weights (the VNNI products) with int8 pages: the
  smallest weights and KV together, against ``bf16``'s bfloat16 weights and pages.

Every pool has the same bytes (``--pool-room`` times what the bf16 one needs), so the 8-bit
pools hold ~1.9x the tokens, and the decode cache's bound (the pool's bytes) is the same for
all; each line says whether decode rows read the decode cache, gathered from the pool, or read
the pool in place. Issue 36's goal: ``int8`` (in place) at least 1.1x ``bf16`` with its decode
cache (the default ``--pool-room``) at batch 32, contexts 512 and 2048.

Also printed: the pool's bytes per token of each, and the tokens a 512 MiB pool holds.

Usage::

    python bench/kv8_decode_step.py [--batch 1 8 32] [--context 1024] [--steps 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from splitserve.config import EngineConfig
from splitserve.default_model import ensure_default_model
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kernels.cpu.features import cpu_line
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.loader import load_model

CONFIGS = {  # name: (kv_cache_dtype, C kernels, --quantization of the weights)
    "bf16": ("auto", True, "none"),
    "bf16-torch": ("auto", False, "none"),
    "int8": ("int8", True, "none"),
    "fp8_e4m3": ("fp8_e4m3", True, "none"),
    "int8w+int8kv": ("int8", True, "int8"),
}
PAGE = 16


def parse_config(spec: str) -> tuple[str, int]:
    """``name`` or ``name@page_size`` (tokens per KV page, default 16) from ``--configs``."""
    name, _, page = spec.partition("@")
    if name not in CONFIGS or (page and not page.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected one of {list(CONFIGS)}[@page_size]")
    return spec, int(page or PAGE)


def fill_pool(pool: KVPool, batch: int, context: int, steps: int) -> list[list[int]]:
    """Pages for ``batch`` sequences of ``context + steps`` tokens; the first ``context`` tokens
    of every layer written with random K/V. Returns each sequence's page ids."""
    lay = pool.layout
    ps = lay.page_size
    g = torch.Generator().manual_seed(0)
    pages = [pool.allocator.alloc(pages_for(context + steps, ps)) for _ in range(batch)]
    pos = torch.arange(context)
    for ids in pages:
        page_of = torch.tensor(ids)[pos // ps]
        for layer in range(lay.num_layers):
            k = torch.randn(context, lay.num_kv_heads, lay.head_dim, generator=g)
            pool.write(layer, page_of, pos % ps, k.bfloat16(), (0.5 * k).bfloat16())
    return pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1024, help="KV tokens per sequence")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool-room", type=float, default=1.5, help="every pool's bytes, as a "
                    "multiple of what the bf16 pool needs (the decode cache is bounded by the "
                    "pool's bytes: at 1.0 it does not fit, and every config gathers per step)")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=list(map(parse_config,
                    CONFIGS)), help=f"of {list(CONFIGS)}, each with @page_size if not {PAGE}")
    args = ap.parse_args()
    pages_of = dict(args.configs)
    base_of = {spec: spec.partition("@")[0] for spec in pages_of}
    torch.set_num_threads(args.threads)
    quants = dict.fromkeys(CONFIGS[base_of[spec]][2] for spec in pages_of)
    models = {
        q: load_model(ensure_default_model(), torch.bfloat16, engine=EngineConfig(quantization=q))
        for q in quants
    }
    cfg = next(iter(models.values()))[1]
    print(f"{cpu_line()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"context {args.context}, load {os.getloadavg()}")
    base = cfg.kv_layout(PAGE, "bfloat16").bytes_per_token
    bf16_page = cfg.kv_layout(PAGE, "bfloat16").page_bytes
    for name, ps in pages_of.items():
        lay = cfg.kv_layout(ps, "bfloat16", CONFIGS[base_of[name]][0])
        print(f"  {name}: {lay.bytes_per_token:.0f} bytes/token, {2**29 // lay.page_bytes * ps}"
              f" tokens in 512 MiB ({base / lay.bytes_per_token:.2f}x bf16's)")
    for batch in args.batch:
        runs = {}
        for name, ps in pages_of.items():
            kind, kernels, _ = CONFIGS[base_of[name]]
            layout = cfg.kv_layout(ps, "bfloat16", kind)
            need = (batch * pages_for(args.context + args.steps, PAGE) + 2) * bf16_page
            pool_bytes = int(need * args.pool_room)
            pool = KVPool(layout, pool_bytes // layout.page_bytes)
            pages = fill_pool(pool, batch, args.context, args.steps)
            runs[name] = (pool, pages, TorchAttentionBackend(use_cpu_kernels=kernels))
        best = dict.fromkeys(runs, float("inf"))
        for step in range(args.steps):
            prefix = [args.context + step] * batch
            for name, (pool, pages, backend) in runs.items():
                fb = build_forward_batch([[7]] * batch, prefix, pages, pool.page_size,
                                         list(range(batch)), seq_ids=list(range(batch)))
                model = models[CONFIGS[base_of[name]][2]][0]
                model.attn_backend = backend
                t0 = time.perf_counter()
                model.forward(fb, pool)
                if step > 0:  # the first step fills each decode cache from the pool
                    best[name] = min(best[name], time.perf_counter() - t0)
        ref = best[args.configs[0][0]]
        cells = "  ".join(f"{n} {t * 1e3:7.1f} ms ({ref / t:4.2f}x)" for n, t in best.items())
        served = {
            n: "cache" if b.cache_bytes() else "pool" if b.reads_pool_in_place(p) else "gather"
            for n, (p, _, b) in runs.items()
        }
        cells += f"  [decode K/V from: {served}]"
        print(f"batch {batch:3d}: {cells}", flush=True)
        del runs


if __name__ == "__main__":
    main()
