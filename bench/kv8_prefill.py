"""One prompt's prefill over bfloat16 KV pages against ``--kv-cache-dtype int8`` / fp8_e4m3
pages, in one process, configurations interleaved and the fastest of ``--rounds`` kept.

The default model in bfloat16 (its kernel plan) runs ``DecoderLM.forward`` over a random
``--tokens``-token prompt into a fresh pool of each kind, as a prefill worker does:

- ``bf16``: bfloat16 pages, the C extend attention over them;
- ``int8``, ``fp8_e4m3``: 8-bit pages (a prefill's K/V written by ``KVPool.write``'s torch
  ops), the C extend attention de-quantizing rows as it packs them (``extend_attention_q8``);
- ``int8-sdpa``: int8 pages with the extend attention in torch (de-quantized gather + SDPA),
  the path 8-bit pools took before the C kernel read them.

Usage::

    python bench/kv8_prefill.py [--tokens 512] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from splitserve.default_model import ensure_default_model
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kernels.cpu.pool_bindings import PoolKernels
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.loader import load_model

CONFIGS = {  # name: (kv_cache_dtype, C extend attention over 8-bit pages)
    "bf16": ("auto", True),
    "int8": ("int8", True),
    "fp8_e4m3": ("fp8_e4m3", True),
    "int8-sdpa": ("int8", False),
}
PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, cfg = load_model(ensure_default_model(), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.tokens,), generator=g).tolist()
    c_kernel = PoolKernels.extend_attention_q8
    best = dict.fromkeys(CONFIGS, float("inf"))
    print(f"{args.tokens}-token prefill, {args.threads} thread(s), load {os.getloadavg()}")
    try:
        for _ in range(args.rounds):
            for name, (kind, use_c) in CONFIGS.items():
                # None: "the kernel does not apply", so the backend takes its torch path.
                PoolKernels.extend_attention_q8 = c_kernel if use_c else lambda *a, **k: None
                pool = KVPool(
                    cfg.kv_layout(PAGE, "bfloat16", kind), pages_for(args.tokens, PAGE) + 1
                )
                pages = [pool.allocator.alloc(pages_for(args.tokens, PAGE))]
                model.attn_backend = TorchAttentionBackend()
                fb = build_forward_batch([ids], [0], pages, PAGE, [0], seq_ids=[0])
                t0 = time.perf_counter()
                model.forward(fb, pool)
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        PoolKernels.extend_attention_q8 = c_kernel
    ref = best["bf16"]
    print("  ".join(f"{n} {t * 1e3:6.0f} ms ({ref / t:4.2f}x)" for n, t in best.items()))


if __name__ == "__main__":
    main()
