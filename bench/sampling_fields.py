"""What the sampling fields cost per decode step (issue 16, item 4), with ratios from one run.

An in-process engine on the real model decodes ``--batch`` requests of a ``--prompt-len``-token
prompt; only steps where the whole batch decodes are timed. Each variant runs in turn, several
rounds, against the plain run (temperature 0, nothing else) measured in the same rounds:

- ``penalties``: every row with frequency, presence and repetition penalties, a 20-entry
  ``logit_bias`` and ``min_tokens`` (all of ``engine.runner.penalties``);
- ``top_logprobs``: every row asks for 20 alternatives (raw log-softmax + top-k per step);
- ``both``.

    python bench/sampling_fields.py --batch 1 16 --steps 24 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_line, default_dtype, make_core, resolve_model

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.loader import load_model
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams

PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2,
             "logit_bias": {t: -1.0 for t in range(100, 120)}, "min_tokens": 10_000,
             "stop_token_ids": [0]}
VARIANTS = {
    "plain": {},
    "penalties": PENALTIES,
    "top_logprobs": {"top_logprobs": 20},
    "both": {**PENALTIES, "top_logprobs": 20},
}


def decode_step_ms(core, prompt: list[int], batch: int, steps: int, fields: dict) -> float:
    """Median wall time (ms) of the steps where all ``batch`` requests decode."""
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True,
                            **{k: v for k, v in fields.items() if k != "min_tokens"},
                            min_tokens=min(fields.get("min_tokens", 0), steps + 1))
    for i in range(batch):
        core.scheduler.add(Req(f"r{i}", list(prompt), params))
    times = []
    while core.scheduler.has_work:
        decoding = not core.scheduler.waiting and len(core.scheduler.running) == batch
        t0 = time.perf_counter()
        core.step()
        if decoding:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = default_dtype()[0]
    model, cfg = load_model(resolve_model(args.model), getattr(torch, dtype))
    pool = KVPool(cfg.kv_layout(16, dtype), 4096)
    core = make_core(model, pool, cfg.eos_token_ids)
    prompt = [(i * 7919) % 30000 + 100 for i in range(args.prompt_len)]
    print(f"CPU: {cpu_line()}; {dtype}, {args.threads} thread(s), prompt {args.prompt_len} "
          f"tokens, {args.steps} steps, {args.rounds} rounds")
    for batch in args.batch:
        runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, fields in VARIANTS.items():
                runs[name].append(decode_step_ms(core, prompt, batch, args.steps, fields))
        base = statistics.median(runs["plain"])
        for name, values in runs.items():
            ms = statistics.median(values)
            print(f"batch {batch:3d}  {name:13s} step {ms:8.2f} ms  x{ms / base:5.2f} vs plain")


if __name__ == "__main__":
    main()
