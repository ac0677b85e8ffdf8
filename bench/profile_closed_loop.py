"""Where a serving-like run's CPU time goes, in process: ``--concurrency`` requests running at
once (a finished one is replaced by the next, as a closed-loop client does), prompt lengths
drawn log-normally (ShareGPT-like, mean ~70 tokens, at most 256), greedy, ``ignore_eos``. Unlike
``profile_decode.py`` (decode-only steps), this counts the prefill/mixed steps, the decode
cache's growth (``_fit``) and its copies of new sequences from the pool (``_fill``).

    python bench/profile_closed_loop.py --concurrency 32 --num-prompts 64 --output-len 128
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from common import make_core, resolve_model
from profile_decode import CpuClock, instrument

from splitserve.config import EngineConfig
from splitserve.engine.attention import decode_kv_cache
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.loader import load_model
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    c, n, out_len = args.concurrency, args.num_prompts, args.output_len
    model, cfg = load_model(resolve_model(args.model), dtype=torch.bfloat16)
    pool = KVPool(cfg.kv_layout(16, "bfloat16"), c * ((256 + out_len) // 16 + 2) + 8)
    core = make_core(model, pool, cfg.eos_token_ids, EngineConfig(max_running=c))
    rng = random.Random(0)
    lens = [min(256, max(8, int(rng.lognormvariate(4.0, 0.8)))) for _ in range(n + 4)]

    def add(i: int) -> None:
        ids = [rng.randrange(100, cfg.vocab_size - 100) for _ in range(lens[i])]
        params = SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True)
        core.scheduler.add(Req(rid=str(i), input_ids=ids, sampling=params))

    for i in range(n, n + 4):  # warm-up requests, not timed
        add(i)
    while core.scheduler.has_work:
        core.step()
    clock, inner = instrument(core), CpuClock()
    cache_cls = decode_kv_cache.DecodeKVCache
    for name in ("_fill", "_fit", "_build_plan"):
        setattr(cache_cls, name, inner.wrap(f"(of prepare) {name}", getattr(cache_cls, name)))
    nxt = steps = 0
    for _ in range(min(c, n)):
        add(nxt)
        nxt += 1
    t0, c0 = time.perf_counter(), time.thread_time()
    while core.scheduler.has_work:
        steps += 1
        for o in core.step():
            if o.finished and nxt < n:
                add(nxt)
                nxt += 1
    total = time.thread_time() - c0
    print(
        f"concurrency {c}, {n} prompts x {out_len} tokens, {args.threads} thread(s): {steps} "
        f"steps, {time.perf_counter() - t0:.2f} s wall, {total:.2f} s main-thread CPU "
        f"({n * out_len / total:.0f} tok/s of CPU)"
    )
    kinds = sorted(clock.spent.items(), key=lambda kv: -kv[1])
    kinds += sorted(inner.spent.items(), key=lambda kv: -kv[1])
    kinds.append(("everything else", total - sum(clock.spent.values())))
    for kind, spent in kinds:
        print(f"  {kind:<24} {spent / steps * 1e3:7.2f} ms/step  {spent / total:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
