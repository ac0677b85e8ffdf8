"""Where a serving-like run's CPU time goes, in process: ``--concurrency`` requests running at
once (a finished one is replaced by the next, as a closed-loop client does), prompt lengths
drawn log-normally (ShareGPT-like, mean ~70 tokens, at most 256), greedy, ``ignore_eos``. Unlike
``profile_decode.py`` (decode-only steps), this counts the prefill/mixed steps, the decode
cache's growth (``_fit``) and its copies of new sequences from the pool (``_fill``).

It also reports the decode cache's growths (a ``_fit`` call that allocated new buffers: its CPU
ms, the memory after, and the step's kind) and each step's main-thread CPU time: the p50/p99 of
decode-only steps and of steps with prompt tokens, and the steps above 1.5x their kind's
median ("spikes") with how many of them contain a growth (issue 20's ITL spikes).

    python bench/profile_closed_loop.py --concurrency 32 --num-prompts 64 --output-len 128
    python bench/profile_closed_loop.py --concurrency 1 --num-prompts 32 --kv-cache-mb 512
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from common import make_core, percentile, resolve_model
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
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=0,
        help="KV pool size as a served worker's (the decode cache is bounded by it; 512 when "
        "served); 0: just what the run needs",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    c, n, out_len = args.concurrency, args.num_prompts, args.output_len
    model, cfg = load_model(resolve_model(args.model), dtype=torch.bfloat16)
    layout = cfg.kv_layout(16, "bfloat16")
    num_pages = c * ((256 + out_len) // 16 + 2) + 8
    if args.kv_cache_mb:
        num_pages = max(num_pages, args.kv_cache_mb * 2**20 // layout.page_bytes)
    pool = KVPool(layout, num_pages)
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
    growths = watch_growth(cache_cls)
    schedule, has_prompt = core.scheduler.schedule, [False]

    def watched_schedule():
        batch = schedule()
        has_prompt[0] = batch is not None and any(n > 1 for n in batch.chunk_lens)
        return batch

    core.scheduler.schedule = watched_schedule
    nxt = steps = peak_bytes = 0
    step_log: list[tuple[float, bool, int]] = []  # (CPU s, has prompt tokens, growths in it)
    for _ in range(min(c, n)):
        add(nxt)
        nxt += 1
    t0, c0 = time.perf_counter(), time.thread_time()
    while core.scheduler.has_work:
        steps += 1
        s0, g0 = time.thread_time(), len(growths)
        outputs = core.step()
        step_log.append((time.thread_time() - s0, has_prompt[0], len(growths) - g0))
        peak_bytes = max(peak_bytes, model.attn_backend.cache_bytes())
        for g in growths[g0:]:
            g["step"], g["prompt"] = steps, has_prompt[0]
        for o in outputs:
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
    report_steps(step_log, growths)
    print(
        f"  decode cache: at most {peak_bytes / 2**20:.1f} MiB held "
        f"(pool {pool.buffer.numel() * pool.buffer.element_size() / 2**20:.0f} MiB)"
    )
    return 0


def watch_growth(cache_cls: type) -> list[dict]:
    """Wrap ``cache_cls._fit`` (the decode cache's only allocation) to log each call that
    replaced the buffers: its CPU seconds and the bytes held after. Returns the live log."""
    log: list[dict] = []
    fit = cache_cls._fit

    def watched(self, *args, **kwargs):
        before, c0 = self.kt, time.thread_time()
        ok = fit(self, *args, **kwargs)
        if self.kt is not before and self.kt is not None:
            log.append(
                {
                    "cpu": time.thread_time() - c0,
                    "bytes": self.nbytes,
                    "shape": (self.v.shape[1], self.v.shape[3]),  # slots, capacity
                }
            )
        return ok

    cache_cls._fit = watched
    return log


def report_steps(step_log: list[tuple[float, bool, int]], growths: list[dict]) -> None:
    """Per kind of step (decode-only, with prompt tokens): count, p50/p99 CPU ms, p99/p50, the
    steps above 1.5x the kind's median and how many of those contain a growth; then the
    growths themselves."""
    print("  steps (main-thread CPU):")
    for kind, is_prompt in (("decode-only", False), ("with prompt", True)):
        times = [t for t, p, _ in step_log if p == is_prompt]
        if not times:
            continue
        p50, p99 = percentile(times, 50), percentile(times, 99)
        spikes = [(t, g) for t, p, g in step_log if p == is_prompt and t > 1.5 * p50]
        print(
            f"    {kind:<12} {len(times):4d} steps, p50 {p50 * 1e3:6.1f} ms, p99 "
            f"{p99 * 1e3:6.1f} ms, p99/p50 {p99 / p50:4.2f}; {len(spikes)} above 1.5x p50, "
            f"{sum(1 for _, g in spikes if g)} of them with a growth; "
            f"{sum(g for _, p, g in step_log if p == is_prompt)} growths"
        )
    if not growths:
        return
    cpu = [g["cpu"] for g in growths]
    print(
        f"  decode-cache growths: {len(growths)}, {sum(cpu) * 1e3:.1f} ms CPU in all, "
        f"each {min(cpu) * 1e3:.1f}-{max(cpu) * 1e3:.1f} ms; peak "
        f"{max(g['bytes'] for g in growths) / 2**20:.1f} MiB"
    )
    decode_p50 = percentile([t for t, p, _ in step_log if not p] or [float("nan")], 50)
    for g in growths:
        print(
            f"    step {g['step']:4d} ({'prompt' if g['prompt'] else 'decode'}): slots x cap "
            f"{g['shape'][0]} x {g['shape'][1]}, {g['bytes'] / 2**20:6.1f} MiB, "
            f"{g['cpu'] * 1e3:6.1f} ms ({g['cpu'] / decode_p50:4.2f} decode steps)"
        )


if __name__ == "__main__":
    sys.exit(main())
