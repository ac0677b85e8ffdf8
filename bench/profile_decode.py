"""Where a decode step's time goes: scheduler + forward-batch building + model + sampling, in
process, at a given batch size, with ``torch.profiler`` op times grouped into matrix products,
attention and the rest.

Goal (issue 8): at batch 32, at least 70% of the step in matrix products and attention.

    python bench/profile_decode.py                       # batch 32, ~180-token prompts, auto dtype
    python bench/profile_decode.py --batch 32 --steps 20 --dtype float32 --top 25
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
from common import default_dtype, make_core, resolve_model

from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.loader import load_model
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "linear_pointwise")
# The torch backend's decode attention: K/V gather (or decode-cache append) and pool write, the
# two products, the softmax.
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "aten::baddbmm", "aten::bmm")
ATTENTION_OPS += ("aten::index_select", "aten::_softmax", "aten::_index_put_impl_")
ATTENTION_OPS += ("aten::index_copy_",)


def build(
    model_path: str, dtype: str, batch: int, prompt_len: int, max_new: int, min_len: int = 0
) -> EngineCore:
    """An engine with ``batch`` prefilled requests; prompt lengths are ``prompt_len``, or
    uniform in ``[min_len, prompt_len]`` when ``min_len`` > 0 (a ShareGPT-like spread)."""
    model, cfg = load_model(model_path, dtype=getattr(torch, dtype))
    layout = cfg.kv_layout(16, dtype)
    pages = batch * ((prompt_len + max_new) // 16 + 2) + 8
    pool = KVPool(layout, pages)
    core = make_core(model, pool, cfg.eos_token_ids, EngineConfig(max_running=batch))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        n = prompt_len
        if min_len > 0:
            n = int(torch.randint(min_len, prompt_len + 1, (1,), generator=g))
        ids = torch.randint(100, cfg.vocab_size - 100, (n,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        core.scheduler.add(Req(rid=str(i), input_ids=ids, sampling=params))
    while core.scheduler.waiting:  # prefill every request (a step prefills within the budget)
        core.step()
    return core


class CpuClock:
    """Main-thread CPU time spent inside wrapped callables, by kind. With one torch thread the
    ops run on the calling thread, so this is each part's cost on an idle core, whatever the
    machine's load (wall-clock op times from the profiler are inflated by preemption)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[kind] += time.thread_time() - c0
                self.depth -= 1

        return timed


def instrument(core: EngineCore) -> CpuClock:
    """Time every projection (and the LM head) as "matmul", the attention backend as
    "attention" (gather, K/V write and the attention products), sampling, and the fused C
    decode layers (which then hold the projections and attention of small steps)."""
    from splitserve.engine.model.layers import Linear

    clock = CpuClock()
    model = core.runner.model
    for module in model.modules():
        if isinstance(module, Linear):
            module.forward = clock.wrap("matmul", module.forward)
    if hasattr(model, "compute_logits"):  # older engines computed logits inline
        model.compute_logits = clock.wrap("matmul", model.compute_logits)
    backend = model.attn_backend
    backend.forward = clock.wrap("attention", backend.forward)
    backend.prepare = clock.wrap("attention prepare", backend.prepare)
    sampler = core.runner.sampler
    core.scheduler.schedule = clock.wrap("scheduler", core.scheduler.schedule)
    core.scheduler.update = clock.wrap("scheduler", core.scheduler.update)
    model.embed = clock.wrap("embed + final norm", model.embed)
    model.norm.forward = clock.wrap("embed + final norm", model.norm.forward)
    model.step_ropes = clock.wrap("batch building", model.step_ropes)
    import splitserve.engine.runner.model_runner as runner_module

    runner_module.build_forward_batch = clock.wrap(
        "batch building", runner_module.build_forward_batch
    )
    sampler.sample = clock.wrap("sampling", sampler.sample)
    # Decode-only steps the step plan gives the fused layers (up to the kernel plan's C rows)
    # run every layer in one C call (projections, attention, norms, RoPE together): timed as
    # one kind.
    fused = getattr(model, "fused_layers", None)
    if fused is not None:
        fused.run = clock.wrap("fused layers (C)", fused.run)
    else:  # engines before the step plan called it through ``engine.model.base``'s name
        import splitserve.engine.model.base as base_module

        if hasattr(base_module, "run_fused_decode_layers"):
            base_module.run_fused_decode_layers = clock.wrap(
                "fused layers (C)", base_module.run_fused_decode_layers
            )
    return clock


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION_OPS):
        return "attention"
    if any(k in low for k in MATMUL_OPS):
        return "matmul"
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=180)
    p.add_argument(
        "--min-prompt-len", type=int, default=0,
        help="if > 0: prompt lengths uniform in [this, --prompt-len] instead of all equal",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        dtype, why = default_dtype()
    else:
        dtype, why = args.dtype, "asked for"
    core = build(
        resolve_model(args.model), dtype, args.batch, args.prompt_len, 1000, args.min_prompt_len
    )
    for _ in range(3):
        core.step()  # warm-up
    times, cpu_times = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        core.step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
    step_ms = statistics.median(times) * 1e3
    cpu_ms = statistics.median(cpu_times) * 1e3
    clock = instrument(core)
    c0 = time.thread_time()
    for _ in range(args.steps):
        core.step()
    total = time.thread_time() - c0
    print(
        f"dtype {dtype} ({why}); batch {args.batch}, "
        + (f"{args.min_prompt_len}-" if args.min_prompt_len else "~")
        + f"{args.prompt_len}+ tokens of context, "
        f"{args.threads} thread(s)"
    )
    print(
        f"decode step: median {step_ms:.1f} ms wall -> {args.batch / step_ms * 1e3:.0f} tok/s; "
        f"main-thread CPU {cpu_ms:.1f} ms -> {args.batch / cpu_ms * 1e3:.0f} tok/s (one "
        "thread: CPU time is the step's cost on an idle core)"
    )
    print("CPU-time breakdown of the decode step (instrumented):")
    for kind, spent in sorted(clock.spent.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<18} {spent / args.steps * 1e3:7.1f} ms  {spent / total:6.1%}")
    rest = total - sum(clock.spent.values())
    print(
        f"  {'everything else':<18} {rest / args.steps * 1e3:7.1f} ms  {rest / total:6.1%}  "
        "(Python glue between the parts above)"
    )
    products = clock.spent["matmul"] + clock.spent["attention"]
    print(f"  matmul + attention: {products / total:.1%} (goal >= 70%)")
    fused = clock.spent["fused layers (C)"]
    if fused:
        # One C call runs every layer's projections, attention, norms, RoPE and SiLU: the
        # per-op path (same kernels, bit-identical) splits them.
        print(
            f"  matmul + attention + fused layers: {(products + fused) / total:.1%} (the fused "
            "layers are mostly both; SPLITSERVE_FUSED_DECODE=0 times them op by op)"
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        prof_wall = time.perf_counter() - t0
    events = prof.key_averages()
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[classify(e.key)] += e.self_cpu_time_total
    total_us = prof_wall * 1e6
    print(
        f"torch.profiler (wall-clock op self times, inflated by preemption under load; "
        f"{prof_wall / args.steps * 1e3:.1f} ms/step profiled):"
    )
    for kind in ("matmul", "attention", "other"):
        print(f"  {kind:<10} {by_kind[kind] / total_us:6.1%}")
    print(f"  outside any op (Python): {1 - sum(by_kind.values()) / total_us:.1%}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
