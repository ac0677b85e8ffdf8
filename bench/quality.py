"""Quality of each weight quantization and KV cache dtype, measured: perplexity on a fixed text and top-1 agreement
with the unquantized bfloat16 model (issue 18, item 5).

The text: GSM8K test solutions (question + worked answer, ``tests/data/prompts/gsm8k/test.jsonl``,
MIT, see ``tests/data/MANIFEST.json``), in file order, concatenated until ``--tokens`` tokens,
scored in windows of ``--window`` tokens (each window from an empty context, every position
after the first scored), through the engine's own model (``load_model``, the same products a
worker serves with; all positions of a window in one prompt step, i.e. the oneDNN/torch path of
prompt steps, not the decode kernels, which tests/engine/test_quant_int8.py and
test_quant_int4.py bound separately; for int4 that is ``W'`` rounded to bfloat16, ``float32:int4``
scores ``W'`` exactly).

- perplexity: ``exp(mean NLL)`` over the scored positions;
- agreement: the share of positions whose argmax equals the ``bfloat16 none`` run's (the
  first configuration is the baseline: teacher-forced, so one early divergence does not
  cascade as it would in free generation).

Usage::

    python bench/quality.py [--tokens 4096] [--window 512]
        [--configs bfloat16:none bfloat16:int8 bfloat16:int4]
    python bench/quality.py --configs bfloat16:none bfloat16:none:int8 bfloat16:none:fp8_e4m3
    python bench/quality.py --decode   # through decode steps: the served C products

``--decode`` scores every window through one-token decode steps, all windows as one batch
(teacher-forced), so the products are the decode kernels the server runs at that many rows:
for int8/int4 the C products with their activations quantized per group of 32 (``gemm_w8.c``,
``gemm_w4.c``), which the prompt-step default does not exercise.

A config is ``DTYPE:QUANTIZATION[:KV_CACHE_DTYPE]`` (``--kv-cache-dtype``, default auto): with an
8-bit KV cache every window's K/V are quantized as they are stored, and attention reads them
back de-quantized.

The llama.cpp peer (``--llamacpp``, needs ``bench/peers/llamacpp.sh``'s build, made on first
use): the same text (the scored tokens decoded, written to a file) through ``llama-perplexity``
for each GGUF of ``--llamacpp-types`` (default F16, Q8_0 and Q4_K_M: the first its baseline),
``-c --window``. llama.cpp tokenizes the file itself, needs at least two windows, evaluates each
chunk from an empty context like we do but scores only its second half (so every scored token
sees at least ``window / 2`` tokens; we score every position after the first), and its F16 is
not our bfloat16: absolute perplexities of the two tools are NOT comparable, only each one's
change against its own unquantized baseline (``int8`` next to ``Q8_0``, ``int4`` next to
``Q4_K_M``)::

    python bench/quality.py --llamacpp --configs bfloat16:none bfloat16:int8 bfloat16:int4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from splitserve.config import EngineConfig
from splitserve.default_model import ensure_default_model
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kernels.cpu.features import cpu_line
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.loader import load_model

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "prompts" / "gsm8k" / "test.jsonl"
PAGE_SIZE = 16


def text_tokens(tokenizer, limit: int) -> list[int]:
    ids: list[int] = []
    with DATA.open() as f:
        for line in f:
            item = json.loads(line)
            ids += tokenizer.encode(f"Question: {item['question']}\nAnswer: {item['answer']}\n\n")
            if len(ids) >= limit:
                break
    return ids[:limit]


def window_logits(model, cfg, ids: list[int], dtype: str, kv_dtype: str = "auto") -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one window from an empty context."""
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, dtype, kv_dtype), pages_for(len(ids), PAGE_SIZE) + 1)
    pages = pool.allocator.alloc(pages_for(len(ids), PAGE_SIZE))
    batch = build_forward_batch([ids], [0], [pages], PAGE_SIZE, [0])
    batch.logit_indices = torch.arange(len(ids))
    model.attn_backend.decode_cache = None
    return model(batch, pool)


def decode_logits(model, cfg, windows: list[list[int]], dtype: str,
                  kv_dtype: str = "auto") -> list[torch.Tensor]:
    """float32 logits ``[len(w), vocab]`` per window, every window decoded at once as a batch
    of one-token steps (teacher-forced: step t feeds each window's token t), so the products
    are the decode steps' kernels at ``len(windows)`` rows (the C products, int8/int4 included,
    and the fused decode layers where they apply) rather than a prompt step's oneDNN path."""
    pages_each = pages_for(max(len(w) for w in windows), PAGE_SIZE)
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, dtype, kv_dtype), pages_each * len(windows) + 1)
    pages = [pool.allocator.alloc(pages_each) for _ in windows]
    model.attn_backend.decode_cache = None
    out: list[list[torch.Tensor]] = [[] for _ in windows]
    for t in range(max(len(w) for w in windows)):
        live = [i for i, w in enumerate(windows) if t < len(w)]
        batch = build_forward_batch([[windows[i][t]] for i in live], [t] * len(live),
                                    [pages[i] for i in live], PAGE_SIZE, list(range(len(live))),
                                    seq_ids=live)
        logits = model(batch, pool)
        for row, i in enumerate(live):
            out[i].append(logits[row].float())
    return [torch.stack(rows) for rows in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["bfloat16:none", "bfloat16:int8", "bfloat16:int4"],
        help="DTYPE:QUANTIZATION[:KV_CACHE_DTYPE], the first is the agreement baseline",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--decode",
        action="store_true",
        help="score through decode steps (all windows as one batch, a token per step): the "
        "served decode products (C int8/int4 kernels, their activation quantization) instead "
        "of a prompt step's",
    )
    ap.add_argument(
        "--llamacpp",
        action="store_true",
        help="also llama.cpp's llama-perplexity on the same text (bench/peers/"
        "llamacpp.sh builds it and makes the GGUFs on first use)",
    )
    ap.add_argument(
        "--llamacpp-types",
        nargs="+",
        default=["f16", "q8_0", "q4_k_m"],
        help="GGUF weight types for --llamacpp, the first is its baseline",
    )
    args = ap.parse_args()
    if args.llamacpp and args.tokens < 2 * args.window:
        ap.error(
            "--llamacpp: llama-perplexity needs at least two windows, --tokens >= "
            f"2 * --window ({2 * args.window})"
        )
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = text_tokens(tokenizer, args.tokens)
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    print(f"{cpu_line()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(
        f"SmolLM2-135M-Instruct, {len(ids)} tokens of GSM8K test solutions in "
        f"{len(windows)} windows of <= {args.window}; load {os.getloadavg()}"
    )
    base_argmax: list[torch.Tensor] | None = None
    ours: dict[str, float] = {}  # config -> perplexity change against the first, in %
    for spec in args.configs:
        dtype, _, rest = spec.partition(":")
        quant, _, kv_dtype = rest.partition(":")
        t0 = time.perf_counter()
        model, cfg = load_model(
            path, getattr(torch, dtype), engine=EngineConfig(quantization=quant or "none")
        )
        nll, count, argmaxes = 0.0, 0, []
        with torch.inference_mode():
            if args.decode:
                all_logits = decode_logits(model, cfg, windows, dtype, kv_dtype or "auto")
            else:
                # one window at a time: a window's logits are ~100 MB (512 x 49,152 float32)
                all_logits = (window_logits(model, cfg, w, dtype, kv_dtype or "auto")
                              for w in windows)
            for w, logits in zip(windows, all_logits, strict=True):
                logits = logits[:-1]
                target = torch.tensor(w[1:])
                nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
                count += len(target)
                argmaxes.append(logits.argmax(-1))
        ppl = math.exp(nll / count)
        if base_argmax is None:
            base_argmax, agree, base_ppl = argmaxes, 1.0, ppl
        else:
            same = sum(int((a == b).sum()) for a, b in zip(argmaxes, base_argmax, strict=True))
            agree = same / count
        ours[spec] = (ppl / base_ppl - 1) * 100
        print(
            f"{spec:24s} perplexity {ppl:8.4f} ({(ppl / base_ppl - 1) * 100:+6.2f}% vs "
            f"{args.configs[0]})  top-1 agreement {agree * 100:6.2f}%  "
            f"({count} positions, {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if args.llamacpp:
        theirs = llamacpp_peer(tokenizer.decode(ids), args)
        print(
            "perplexity change against each tool's own unquantized baseline (the numbers "
            "that compare across tools):"
        )
        print(
            f"  splitserve vs {args.configs[0]}: "
            + ", ".join(f"{k} {v:+.2f}%" for k, v in list(ours.items())[1:])
        )
        print(
            f"  llama.cpp  vs {args.llamacpp_types[0].upper()}: "
            + ", ".join(f"{k.upper()} {v:+.2f}%" for k, v in list(theirs.items())[1:])
        )


def llamacpp_peer(text: str, args: argparse.Namespace) -> dict[str, float]:
    """Print ``llama-perplexity``'s estimate for each of ``args.llamacpp_types`` on ``text``
    and its change against the first type's (see the module docstring for what compares).

    Returns:
        ``{type: perplexity change against the first type, in %}``.
    """
    import tempfile

    from llamacpp_tools import gguf_paths, kl_divergence, perplexity

    ggufs = gguf_paths(args.llamacpp_types)
    print(
        f"llama.cpp llama-perplexity, -c {args.window}, {args.threads} thread(s), the same text "
        "(second half of each chunk scored; agreement and KL divergence against its first "
        "type): compare only the % changes against each tool's own baseline, not perplexities "
        "across tools",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "quality.txt"
        text_file.write_text(text)
        base_logits = Path(tmp) / "base.kld"
        base_kind = args.llamacpp_types[0]
        changes = {}
        for kind, gguf in ggufs.items():
            t0 = time.perf_counter()
            if kind == base_kind:
                # The baseline saves its log-probabilities; the others are scored against them
                # on the same tokens (top-1 agreement and KL divergence, like ours).
                r = perplexity(gguf, text_file, args.window, args.threads, base_logits)
                r.update(same_top=100.0, kld=0.0)
                base = r["ppl"]
            else:
                r = kl_divergence(gguf, base_logits, args.window, args.threads)
            changes[kind] = (r["ppl"] / base - 1) * 100
            name = f"llama.cpp {kind.upper()}"
            print(
                f"{name:24s} perplexity {r['ppl']:8.4f} ({changes[kind]:+6.2f}% "
                f"vs {base_kind.upper()})  top-1 agreement {r['same_top']:6.2f}%  "
                f"KLD {r['kld']:.5f}  ({r['chunks']} chunks of {r['ctx']}, "
                f"{time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return changes


if __name__ == "__main__":
    main()
