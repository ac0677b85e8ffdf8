"""Why the 8-bit KV cache keeps one scale per token and KV head: the round-trip error of real
K/V (the default model's, over GSM8K text) with that choice against one scale per page and KV
head (the coarser choice, 1/page_size of the scale bytes), for int8 and fp8_e4m3.

The K/V come from one prompt step of ``--tokens`` tokens in float32 (``bench/quality.py``'s
text). Printed per format and choice: the relative error ``||x - x^|| / ||x||`` of K and of V over
every layer, and the scale bytes per token.

Usage::

    python bench/kv8_scales.py [--tokens 512]
"""

from __future__ import annotations

import argparse
import os

import torch
from quality import PAGE_SIZE, text_tokens

from splitserve.default_model import ensure_default_model
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.kv_quant import dequantize_kv, quantize_kv


def per_page(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Round trip of ``x [pages, L, 2, P, H, D]`` with one scale per (page, layer, K/V, head)."""
    xt = x.permute(0, 1, 2, 4, 3, 5).flatten(-2)  # [pages, L, 2, H, P * D]
    back = dequantize_kv(*quantize_kv(xt, kind), torch.float32)
    pages, layers, _, page, heads, d = x.shape
    return back.view(pages, layers, 2, heads, page, d).permute(0, 1, 2, 4, 3, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from splitserve.engine.model.loader import load_model

    path = ensure_default_model()
    ids = text_tokens(AutoTokenizer.from_pretrained(path), args.tokens)
    model, cfg = load_model(path, torch.float32)
    n = pages_for(len(ids), PAGE_SIZE)
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, "float32"), n + 1)
    pages = pool.allocator.alloc(n)
    with torch.inference_mode():
        model(build_forward_batch([ids], [0], [pages], PAGE_SIZE, [0]), pool)
    full = len(ids) // PAGE_SIZE  # whole pages only
    x = pool.kv[torch.tensor(pages[:full])].float()  # [pages, L, 2, P, H, D]
    print(f"SmolLM2-135M K/V of {full * PAGE_SIZE} GSM8K tokens, pages of {PAGE_SIZE}; "
          f"load {os.getloadavg()}")
    for kind in ("int8", "fp8_e4m3"):
        token = dequantize_kv(*quantize_kv(x, kind), torch.float32)
        for name, back, scale_bytes in (("per token+head", token, 4.0),
                                        ("per page+head", per_page(x, kind), 4.0 / PAGE_SIZE)):
            errs = [((back[:, :, i] - x[:, :, i]).norm() / x[:, :, i].norm()).item()
                    for i in (0, 1)]
            print(f"  {kind:9s} {name:15s}: K {errs[0] * 100:5.2f}%  V {errs[1] * 100:5.2f}%  "
                  f"(scale bytes per token and head: {scale_bytes:.2f})")


if __name__ == "__main__":
    main()
