"""Measure the engine's step times on this machine and fit ``pd_sim.StepModel`` to them.

Steps run in process on the real model through ``EngineCore`` (the scheduler and runner the
workers use), at a given torch thread count: decode steps at several batch sizes and context
lengths, prefill steps of several chunk sizes over an empty and a cached prefix. Each timing
is the median of a few steps; the fit is ordinary least squares on the model's terms.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from common import make_core
from pd_sim import StepModel

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams

DECODE_ROWS = (1, 2, 4, 8, 16, 32)
DECODE_CTX = (96, 320)
PREFILL_TOKENS = (32, 128, 512, 1024)
PREFILL_PREFIX = (0, 512)


def _req(rid: str, n: int, max_new: int, seed: int) -> Req:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (n,), generator=g).tolist()
    return Req(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))


def _core(model, cfg, dtype: str, budget: int, rows: int):
    model.attn_backend.decode_cache = None
    pool = KVPool(cfg.kv_layout(16, dtype), 4096)
    return make_core(model, pool, cfg.eos_token_ids,
                     EngineConfig(max_batch_tokens=budget, max_running=max(rows, 1)))


def measure_decode(model, cfg, dtype: str, steps: int = 5) -> list[tuple[int, int, float]]:
    """``(rows, total context tokens, seconds)`` of decode-only steps."""
    out = []
    for ctx in DECODE_CTX:
        for rows in DECODE_ROWS:
            core = _core(model, cfg, dtype, 4096, rows)
            for i in range(rows):
                core.scheduler.add(_req(f"d{i}", ctx, steps + 4, seed=i))
            while core.scheduler.waiting:
                core.step()
            core.step()  # warm the decode path (decode cache, kernels)
            times = []
            for _ in range(steps):
                total = sum(r.seq_len for r in core.scheduler.running)
                t0 = time.perf_counter()
                core.step()
                times.append((time.perf_counter() - t0, total))
            dt, total = min(times)
            out.append((rows, total, dt))
    return out


def measure_prefill(model, cfg, dtype: str, repeats: int = 3) -> list[tuple[int, float, float]]:
    """``(new tokens, attention pairs, seconds)`` of prompt-only steps."""
    out = []
    for prefix in PREFILL_PREFIX:
        for tokens in PREFILL_TOKENS:
            times = []
            for rep in range(repeats):
                # The budget is the prefix for the first step, then the timed chunk: with one
                # budget of max(prefix, tokens), a chunk longer than the prefix ate into itself
                # (1,024 over 512 timed 512 over 1,024, labelled 1,024: the fit's 132% error).
                core = _core(model, cfg, dtype, prefix or tokens, 1)
                core.scheduler.add(_req("p", prefix + tokens, 1, seed=rep))
                if prefix:
                    core.step()  # the prefix chunk; the timed step extends over it
                    core.scheduler.max_batch_tokens = tokens
                t0 = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - t0)
            out.append((tokens, tokens * (prefix + tokens / 2), min(times)))
    return out


def fit(decode: list[tuple[int, int, float]], prefill: list[tuple[int, float, float]],
        threads: int) -> StepModel:
    """Least squares of each part's terms; negative coefficients (noise) are clipped to 0."""
    a = np.array([[1.0, r, c] for r, c, _ in decode])
    d = np.clip(np.linalg.lstsq(a, np.array([s for *_, s in decode]), rcond=None)[0], 0, None)
    b = np.array([[1.0, t, p] for t, p, _ in prefill])
    p = np.clip(np.linalg.lstsq(b, np.array([s for *_, s in prefill]), rcond=None)[0], 0, None)
    return StepModel(*map(float, d), *map(float, p), threads=threads)


def profile(model, cfg, dtype: str, threads: int) -> tuple[StepModel, dict]:
    """Measure at ``threads`` torch threads and fit; also returns the raw samples."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode = measure_decode(model, cfg, dtype)
        prefill = measure_prefill(model, cfg, dtype)
    finally:
        torch.set_num_threads(before)
    fitted = fit(decode, prefill, threads)
    residual = max(abs(fitted.decode(r, c) - s) / s for r, c, s in decode)
    residual_p = max(abs(fitted.prefill(t, p) - s) / s for t, p, s in prefill)
    raw = {"decode": decode, "prefill": prefill, "max_rel_error_decode": residual,
           "max_rel_error_prefill": residual_p, "median_decode_s": statistics.median(
               s for *_, s in decode)}
    return fitted, raw
