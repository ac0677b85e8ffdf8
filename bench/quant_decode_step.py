"""A batch-B decode step of the engine, bfloat16 weights against ``--quantization int8`` and
``int4``, in one
process, steps interleaved (one of each in turn) and the fastest of each kept: the shared
machine's noise hits both alike.

Each configuration is the default model loaded by ``load_model`` (its kernel plan, the fused
decode path where it applies) driving the real scheduler and runner (``EngineCore.step``:
forward, sampling, bookkeeping) over B requests of a 32-token prompt, greedy, ``ignore_eos``.
Not a serving run (no HTTP, no detokenization): ``bench/serving.py --launch colocated
--launch colocated:int8`` is that. A config ``int4:unfused`` runs the per-op path (the fused
one-call decode layers off), to measure in the same run what the fused path is worth.

Usage::

    python bench/quant_decode_step.py [--batch 1 8 32] [--steps 40] [--threads 1] [--kernels c]
        [--configs none int8 int4 int4:unfused] [--device cuda] [--model PATH]

On ``--device cuda`` the quantized configs run the Triton weight-only kernels
(``engine/kernels/triton/quant_matmul.py``) and there is no kernel plan or fused path
(``bench/gpu_check.sh`` runs it so, on a random-weight SmolLM2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engine_core

from splitserve.config import EngineConfig
from splitserve.default_model import ensure_default_model
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.loader import load_model
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core

QUANTIZATIONS = ("none", "int8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", default="c", help="--kernels for both (default c: the C "
                    "products at every step size, so a kernel plan timed under load cannot "
                    "make the comparison; auto: each measures its own plan)")
    ap.add_argument("--configs", nargs="+", default=list(QUANTIZATIONS),
                    help="QUANTIZATION or QUANTIZATION:unfused (the fused one-call decode "
                         "layers off); the first is the baseline")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or ensure_default_model()
    models = {}
    for spec in args.configs:
        q, _, how = spec.partition(":")
        if q not in QUANTIZATIONS or how not in ("", "unfused"):
            raise SystemExit(f"bad config {spec!r}: QUANTIZATION[:unfused], one of {QUANTIZATIONS}")
        models[spec] = load_model(path, torch.bfloat16, device=args.device, engine=EngineConfig(
            quantization=q, kernels=args.kernels, fused_decode=how != "unfused"))
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"{cpu}, torch {torch.__version__}, {args.threads} thread(s), load {os.getloadavg()}")
    for q, (model, _) in models.items():
        print(f"  {q}: {model.kernel_plan.summary() if model.kernel_plan else 'no kernel plan'};"
              f" weights + packed copies {model.weight_bytes() / 1e6:.0f} MB")
    for batch in args.batch:
        cores = {}
        for q, (model, cfg) in models.items():
            model.attn_backend.decode_cache = None
            pool = KVPool(cfg.kv_layout(16, "bfloat16"), batch * (4 + args.steps // 16) + 8,
                          args.device)
            core = make_core(model, pool, cfg.eos_token_ids, runner={"device": args.device},
                             max_running=batch)
            for i in range(batch):
                ids = torch.randint(100, 40000, (32,), generator=torch.Generator().manual_seed(i))
                params = SamplingParams(temperature=0.0, max_new_tokens=args.steps + 4,
                                        ignore_eos=True)
                core.scheduler.add(Req(rid=str(i), input_ids=ids.tolist(), sampling=params))
            core.step()  # the prefill step
            cores[q] = core
        best = dict.fromkeys(cores, float("inf"))
        for _ in range(args.steps):
            for q, core in cores.items():
                t0 = time.perf_counter()
                core.step()
                if args.device != "cpu":
                    torch.cuda.synchronize()
                best[q] = min(best[q], time.perf_counter() - t0)
        base = best[args.configs[0]]
        cells = "  ".join(f"{q} {t * 1e3:7.2f} ms/step ({base / t:4.2f}x)" for q, t in best.items())
        print(f"batch {batch:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
