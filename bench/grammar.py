"""Grammar-constrained decoding benchmark (issue 4), with ratios from one run.

1. Step time with constraints vs without, at batch 1 and 16: an in-process engine on the
   real model; only steps where the whole batch decodes are timed. Constrained runs go twice,
   with the mask filled on the runner's thread before the forward pass (serial) and on the mask
   thread during it (overlap, the default), alternating with the unconstrained run.
2. Compile time p50/p99 and coverage per backend and for the sound chain (strict), per
   JSONSchemaBench subset, on a sample of each subset (``--data``: the folder
   whose ``jsonschemabench/schemas/<subset>/`` it samples; default tests/data).
3. Tokens/s for JSON outputs with jump-forward on vs off.
4. Per-token mask fill time (p50/p99) per backend along valid MaskBench instances (``--data``:
   the folder whose ``jsonschemabench/maskbench/<subset>/`` it reads).

    python bench/grammar.py --schemas-per-subset 4 --steps 24
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import DATA_DIR, add_data_argument, cpu_line, make_core

from splitserve.config import EngineConfig
from splitserve.default_model import ensure_default_model
from splitserve.engine.core import EngineCore
from splitserve.engine.grammar import GrammarService, allocate_bitmask
from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.mask_thread import MaskFillThread
from splitserve.engine.grammar.options import CompileOptions
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.loader import load_model
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import Constraint, SamplingParams
from splitserve.worker.grammars import WorkerGrammars, create_worker_grammars

SCHEMAS = Path("jsonschemabench") / "schemas"  # under a data folder (--data)
MASKBENCH = Path("jsonschemabench") / "maskbench"  # {schema, tests: [{valid, data}]} per file
PERSON = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "email": {"type": "string"}, "is_member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "is_member"],
    "additionalProperties": False,
})
STORY = json.dumps({  # JSON with free text: the batch stays full for tens of steps
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("title", "keeper", "setting", "story", "moral")},
    "required": ["title", "keeper", "setting", "story", "moral"],
})
STORY_PROMPT = "Tell me a long story about a lighthouse keeper, as JSON."


class Engine:
    """One in-process worker: the model, grammar compiles, and engines sharing the model."""

    def __init__(self, model_path: str, jump_forward: bool = True) -> None:
        self.model, self.config = load_model(model_path, dtype=torch.float32)
        self.grammars: WorkerGrammars = create_worker_grammars(
            model_path, self.config.vocab_size, self.config.eos_token_ids, jump_forward
        )
        self.tokenizer = self.grammars.tokenizer
        self.core = self.new_core(jump_forward, num_pages=2048)

    def new_core(self, jump_forward: bool, num_pages: int, overlap: bool = True) -> EngineCore:
        """An engine with its own KV pool (``num_pages`` pages of 16 tokens) and runner."""
        pool = KVPool(self.config.kv_layout(16, "float32"), num_pages)
        return make_core(self.model, pool, self.config.eos_token_ids,
                         EngineConfig(jump_forward=jump_forward),
                         vocab_size=self.config.vocab_size, overlap_grammar_mask=overlap)

    def chat_ids(self, text: str) -> list[int]:
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def submit(self, core: EngineCore, prompts: list[str], constraint: Constraint | None,
               max_new_tokens: int, ignore_eos: bool = False) -> list[Req]:
        """Queue greedy requests for chat ``prompts`` on ``core`` (:meth:`submit_ids`)."""
        return self.submit_ids(core, [self.chat_ids(text) for text in prompts], constraint,
                               max_new_tokens, ignore_eos)

    def submit_ids(self, core: EngineCore, prompts: list[list[int]], constraint: Constraint | None,
                   max_new_tokens: int, ignore_eos: bool = False) -> list[Req]:
        """Queue greedy requests for token-id ``prompts`` on ``core`` once their grammar
        compiled (cached after the first time). Returns: the requests."""
        reqs = []
        for i, ids in enumerate(prompts):
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos,
                stop_token_ids=[] if ignore_eos else self.config.eos_token_ids,
                constraint=constraint,
            )
            req = Req(rid=str(i), input_ids=list(ids), sampling=sampling)
            reqs.append(req)
            if constraint is None:
                core.scheduler.add(req)
            else:
                self.grammars.submit(req)
        while len(self.grammars):
            for done in self.grammars.poll():
                assert done.error is None, done.error
                core.scheduler.add(done.req)
            time.sleep(0.001)
        return reqs

    def run(self, prompts: list[str], constraint: Constraint | None, max_new_tokens: int,
            ignore_eos: bool = False) -> tuple[list[Req], int]:
        """Generate greedily on the engine's own core.

        Returns: the requests and the number of forward steps taken.
        """
        reqs = self.submit(self.core, prompts, constraint, max_new_tokens, ignore_eos)
        num_steps = 0
        while self.core.scheduler.has_work:
            self.core.step()
            num_steps += 1
        return reqs, num_steps


# name: (constrained, mask filled during the forward pass, mask applied as a float bias).
# "serial, xgrammar apply" is the runner before the overlap (issue 4): fill, forward, then
# xgrammar's CPU kernel; it is also what non-CPU devices apply with.
STEP_VARIANTS = {
    "unconstrained": (False, True, True),
    "serial, xgrammar apply": (True, False, False),
    "serial": (True, False, True),
    "overlap": (True, True, True),
}
MASK_PARTS = ("fill", "wait", "apply")


def bench_step_time(engine: Engine, batch_sizes: list[int], steps: int, reps: int) -> None:
    """Every variant gets its own engine on the same model and the same prompts; they take
    one step each in turn, so outside load hits all alike, and step ``k`` of each is compared at
    the same sequence length (the constrained outputs may end sooner: only the steps that all
    variants ran with the full batch count)."""
    print("\n## Step time, constrained vs unconstrained (decode steps with the full batch)")
    print("Median wall ms per step (main-thread CPU ms), ratios to unconstrained likewise (CPU "
          "time is what outside load disturbs least). Variants step in turn. Mask ms/step: "
          "fill = matchers + bias (on the mask thread when overlapped), wait = the runner "
          "waiting for the fill after the forward pass, apply = masking the logits")
    print("| batch | steps | " + " | ".join(f"{v} ms | ratio" for v in STEP_VARIANTS)
          + " | fill / wait / apply ms: " + " ; ".join(list(STEP_VARIANTS)[1:]) + " |")
    print("|---|---|" + "---|---|" * len(STEP_VARIANTS) + "---|")
    timings: dict[str, dict[int, list[float]]] = {part: {} for part in MASK_PARTS}
    originals = (BatchMask.fill, BatchMask.apply, MaskFillThread.join)
    BatchMask.fill = _timed_per_instance(BatchMask.fill, timings["fill"])
    BatchMask.apply = _timed_per_instance(BatchMask.apply, timings["apply"])
    MaskFillThread.join = _timed_per_instance(MaskFillThread.join, timings["wait"])
    try:
        for batch in batch_sizes:
            prompt_len = len(engine.chat_ids(STORY_PROMPT))
            num_pages = batch * ((prompt_len + steps) // 16 + 2) + 1
            cores = {}
            for name, (_, overlap, bias) in STEP_VARIANTS.items():
                core = engine.new_core(False, num_pages, overlap)
                mask = core.runner.grammar_mask = BatchMask(engine.config.vocab_size)
                mask.use_bias = bias
                cores[name] = core
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cores}
            for values in timings.values():
                values.clear()
            for _ in range(reps):
                timed = _steps_in_turn(engine, cores, batch, steps)
                num_common = min(len(t) for t in timed.values())
                for name, values in timed.items():
                    samples[name] += values[:num_common]
            _print_step_row(batch, samples, cores, timings)
    finally:
        BatchMask.fill, BatchMask.apply, MaskFillThread.join = originals


def _steps_in_turn(engine: Engine, cores: dict[str, EngineCore], batch: int,
                   steps: int) -> dict[str, list[tuple[float, float]]]:
    """One generation per variant, stepped in turn. Returns: per variant, (wall s, main-thread
    CPU s) of each decode step with the full batch, in order."""
    for name, core in cores.items():
        constraint = Constraint("json_schema", STORY) if STEP_VARIANTS[name][0] else None
        engine.submit(core, [STORY_PROMPT] * batch, constraint, steps,
                      ignore_eos=constraint is None)
    timed: dict[str, list[tuple[float, float]]] = {name: [] for name in cores}
    order = list(cores)
    while any(c.scheduler.has_work for c in cores.values()):
        order = order[1:] + order[:1]  # rotate: no variant always runs right after another
        for name in order:
            scheduler = cores[name].scheduler
            if not scheduler.has_work:
                continue
            full = not scheduler.waiting and len(scheduler.running) == batch
            start, cpu_start = time.perf_counter(), time.thread_time()
            cores[name].step()
            if full:
                timed[name].append((time.perf_counter() - start, time.thread_time() - cpu_start))
    return timed


def _print_step_row(batch: int, samples: dict[str, list[tuple[float, float]]],
                    cores: dict[str, EngineCore],
                    timings: dict[str, dict[int, list[float]]]) -> None:
    base = statistics.median(w for w, _ in samples["unconstrained"])
    base_cpu = statistics.median(c for _, c in samples["unconstrained"])
    cells = [str(batch), str(len(samples["unconstrained"]))]
    for values in samples.values():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        cells += [f"{wall * 1e3:.1f} ({cpu * 1e3:.1f})",
                  f"{wall / base:.3f} ({cpu / base_cpu:.3f})"]
    parts = []
    for core in list(cores.values())[1:]:
        runner = core.runner
        fills = timings["fill"].get(id(runner.grammar_mask), [])
        owners = {"fill": runner.grammar_mask, "wait": runner.mask_thread,
                  "apply": runner.grammar_mask}
        per_step = [sum(timings[part].get(id(owners[part]), [])) * 1e3 / max(1, len(fills))
                    for part in MASK_PARTS]
        parts.append(" / ".join(f"{ms:.2f}" for ms in per_step))
    cells.append(" ; ".join(parts))
    print("| " + " | ".join(cells) + " |", flush=True)


def bench_compile(engine: Engine, per_subset: int, timeout_s: float, seed: int,
                  data: Path = DATA_DIR) -> None:
    """Compile time p50/p99 and coverage per backend and for the sound chain (strict: only
    backends that enforce every keyword), per subset of a JSONSchemaBench sample."""
    backends = engine.grammars.service.backends
    names = [b.name for b in backends]
    print(f"\n## Compile time and coverage ({per_subset} sampled schemas per subset, "
          f"{timeout_s:g} s timeout per backend)")
    header = [f"{n} ok | p50 ms | p99 ms" for n in [*names, "chain(strict)"]]
    print("| subset | n | " + " | ".join(header) + " |")
    print("|---|---|" + "---|---|---|" * (len(names) + 1))
    rng = random.Random(seed)
    services = {b.name: GrammarService([b], timeout_s=timeout_s, num_threads=1)
                for b in backends}
    # A fresh chain with its own cache: its times include walking past refused backends.
    services["chain(strict)"] = GrammarService(backends, timeout_s=timeout_s, num_threads=1)
    totals: dict[str, list[int]] = {name: [0, 0] for name in services}
    schema_dir = data / SCHEMAS
    for subset in sorted(p.name for p in schema_dir.iterdir() if p.is_dir()):
        files = sorted((schema_dir / subset).glob("*.json"))
        sample = rng.sample(files, min(per_subset, len(files)))
        results: dict[str, list[tuple[bool, float]]] = {name: [] for name in services}
        for path in sample:
            text = json.dumps(json.loads(path.read_text()))
            for name, service in services.items():
                options = CompileOptions(strict=name == "chain(strict)")
                start = time.perf_counter()
                try:
                    service.compile("json_schema", text, options)
                    ok = True
                except ValueError:
                    ok = False
                results[name].append((ok, time.perf_counter() - start))
        cells = [subset, str(len(sample))]
        for name in services:
            oks = sum(ok for ok, _ in results[name])
            times = sorted(t * 1e3 for ok, t in results[name] if ok) or [float("nan")]
            totals[name][0] += oks
            totals[name][1] += len(sample)
            cells += [f"{oks}/{len(sample)}", f"{_pct(times, 50):.1f}", f"{_pct(times, 99):.1f}"]
        print("| " + " | ".join(cells) + " |")
    print("coverage: " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in totals.items()))
    print("MaskBench's table (11,306 schemas; compile = TTFM): llguidance p50 1.0 ms / p99 18 ms, "
          "xgrammar 0.1.17 p50 919 ms / p99 900 s (timeouts)")
    for service in services.values():
        service.shutdown()


def bench_jump_forward(model_path: str, batch: int, max_new_tokens: int) -> None:
    print("\n## Jump-forward, JSON outputs (schema with 5 required keys, greedy)")
    print("| jump-forward | tokens | forward steps | seconds | tokens/s | valid JSON |")
    print("|---|---|---|---|---|---|")
    prompts = [f"Give a person record #{i} as JSON." for i in range(batch)]
    rates = {}
    for jump in (False, True):
        engine = Engine(model_path, jump_forward=jump)
        engine.run(prompts[:1], Constraint("json_schema", PERSON), 4)  # warm up
        start = time.perf_counter()
        reqs, num_steps = engine.run(prompts, Constraint("json_schema", PERSON), max_new_tokens)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in reqs)
        valid = sum(_is_json(engine.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                    for r in reqs)
        rates[jump] = tokens / seconds
        print(f"| {'on' if jump else 'off'} | {tokens} | {num_steps} | {seconds:.2f} | "
              f"{tokens / seconds:.1f} | {valid}/{batch} |")
    print(f"tokens/s ratio on/off: {rates[True] / rates[False]:.2f}")


def bench_mask_fill(engine: Engine, num_schemas: int, data: Path = DATA_DIR) -> None:
    """``fill_bitmask`` wall time per token, per backend, along the first valid instance of every
    12th MaskBench schema that has one (sorted by path), ``num_schemas`` of them, compact JSON."""
    docs = [json.loads(p.read_text()) for p in sorted((data / MASKBENCH).glob("*/*.json"))]
    cases = [(d["schema"], next(t["data"] for t in d["tests"] if t["valid"]))
             for d in docs[::12] if any(t["valid"] for t in d["tests"])][:num_schemas]
    print(f"\n## Mask fill per token, {len(cases)} MaskBench schemas (compact JSON instances)")
    print("| backend | schemas compiled | tokens | p50 us | p99 us | MaskBench TBM p50 / p99 us |")
    print("|---|---|---|---|---|---|")
    published = {"llguidance": "46 / 533", "xgrammar": "9 / 5,687 (0.1.17)",
                 "outlines": "34 / 7,184 (0.2.3)"}
    for backend in engine.grammars.service.backends:
        if backend.name == "outlines":
            continue  # minutes per schema to build its index; its fill is an array lookup
        bitmask = allocate_bitmask(1, backend.vocab_size)
        timings_us: list[float] = []
        compiled_n = 0
        for schema, instance in cases:
            try:
                compiled = backend.compile("json_schema", json.dumps(schema))
            except ValueError:
                continue
            compiled_n += 1
            matcher = compiled.create_matcher()
            text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
            for token_id in engine.tokenizer.encode(text, add_special_tokens=False):
                start = time.perf_counter()
                matcher.fill_bitmask(bitmask, 0)
                timings_us.append((time.perf_counter() - start) * 1e6)
                if not matcher.accept_token(token_id):
                    break
        timings_us.sort()
        if not timings_us:
            continue
        print(f"| {backend.name} | {compiled_n}/{len(cases)} | {len(timings_us)} | "
              f"{_pct(timings_us, 50):.1f} | {_pct(timings_us, 99):.1f} | "
              f"{published.get(backend.name, '')} |")


def _timed_per_instance(method: Callable, sink: dict[int, list[float]]) -> Callable:
    """Wrap ``method`` so that each call's seconds go to ``sink[id(self)]`` (from any thread)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            sink.setdefault(id(self), []).append(time.perf_counter() - start)

    return wrapper


def _pct(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per step-time run")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--reps", type=int, default=3, help="step-time runs per batch size")
    parser.add_argument("--schemas-per-subset", type=int, default=4)
    parser.add_argument("--compile-timeout", type=float, default=10.0)
    parser.add_argument("--jump-batch", type=int, default=4)
    parser.add_argument("--jump-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mask-schemas", type=int, default=12)
    parser.add_argument("--skip", default="", help="comma list of: step,compile,jump,mask")
    add_data_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model_path = str(ensure_default_model())
    engine = Engine(model_path, jump_forward=False)
    print(f"model {model_path}, {args.threads} thread(s), CPU {cpu_line()}")
    if "step" not in skip:
        bench_step_time(
            engine, [int(b) for b in args.batch_sizes.split(",")], args.steps, args.reps
        )
    if "compile" not in skip:
        bench_compile(engine, args.schemas_per_subset, args.compile_timeout, args.seed, args.data)
    if "jump" not in skip:
        bench_jump_forward(model_path, args.jump_batch, args.jump_tokens)
    if "mask" not in skip:
        bench_mask_fill(engine, args.mask_schemas, args.data)


if __name__ == "__main__":
    main()
