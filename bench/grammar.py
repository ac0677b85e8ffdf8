"""Grammar-constrained decoding benchmark (issue 4), with ratios from one run.

1. Step time with constraints vs without, at batch 1 and 16: an in-process scheduler on the
   real model; only steps where the whole batch decodes are timed.
2. Compile time p50/p99 and coverage per backend and for the fallback chain (xgrammar, then
   outlines), per JSONSchemaBench subset, on a sample of each subset.
3. Tokens/s for JSON outputs with jump-forward on vs off.

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

from splitserve.default_model import ensure_default_model
from splitserve.engine import model_runner
from splitserve.engine.grammar import GrammarService
from splitserve.engine.grammar.worker_grammars import WorkerGrammars, create_worker_grammars
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.loader import load_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Req
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.messages import Constraint, SamplingParams

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench" / "schemas"
PERSON = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "email": {"type": "string"}, "is_member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "is_member"],
    "additionalProperties": False,
})
LONG_TEXT = json.dumps({  # free text inside JSON: the batch stays full for many steps
    "type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
})


class Engine:
    """One in-process worker: model, pool, scheduler and grammar compiles."""

    def __init__(self, model_path: str, jump_forward: bool = True) -> None:
        self.model, self.config = load_model(model_path, dtype=torch.float32)
        pool = KVPool(self.config.kv_layout(16, "float32"), 2048)
        runner = ModelRunner(self.model, pool, vocab_size=self.config.vocab_size)
        self.scheduler = Scheduler(
            runner, SchedulerConfig(jump_forward=jump_forward), self.config.eos_token_ids
        )
        self.grammars: WorkerGrammars = create_worker_grammars(
            model_path, self.config.vocab_size, self.config.eos_token_ids, jump_forward
        )
        self.tokenizer = self.grammars.tokenizer

    def chat_ids(self, text: str) -> list[int]:
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def run(self, prompts: list[str], constraint: Constraint | None, max_new_tokens: int,
            ignore_eos: bool = False) -> tuple[list[Req], list[tuple[int, float]]]:
        """Generate greedily. Returns: the requests and (decode batch size, seconds) per step."""
        reqs = []
        for i, text in enumerate(prompts):
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos,
                stop_token_ids=[] if ignore_eos else self.config.eos_token_ids,
                constraint=constraint,
            )
            req = Req(rid=str(i), input_ids=self.chat_ids(text), sampling=sampling)
            reqs.append(req)
            if constraint is None:
                self.scheduler.add(req)
            else:
                self.grammars.submit(req)
        while len(self.grammars):
            for done in self.grammars.poll():
                assert done.error is None, done.error
                self.scheduler.add(done.req)
            time.sleep(0.001)
        steps = []
        while self.scheduler.has_work:
            decoding = not self.scheduler.waiting
            batch = len(self.scheduler.running)
            start = time.perf_counter()
            self.scheduler.step()
            if decoding:
                steps.append((batch, time.perf_counter() - start))
        return reqs, steps


def bench_step_time(engine: Engine, batch_sizes: list[int], steps: int, reps: int) -> None:
    print("\n## Step time, constrained vs unconstrained (decode steps with the full batch)")
    print(f"min over {reps} alternating runs of the median step; mask = bitmask fill + apply")
    print("| batch | unconstrained ms | json_schema ms | ratio | mask ms/step |")
    print("|---|---|---|---|---|")
    prompt = "Tell me a long story about a lighthouse keeper, as JSON."
    mask_s: list[float] = []
    fill, apply = model_runner.fill_grammar_bitmask, model_runner.apply_bitmask
    model_runner.fill_grammar_bitmask = _timed(fill, mask_s)
    model_runner.apply_bitmask = _timed(apply, mask_s)
    try:
        for batch in batch_sizes:
            best = [float("inf"), float("inf")]
            mask_s.clear()
            for _ in range(reps):  # alternate, so load from other processes hits both alike
                for k, constraint in enumerate((None, Constraint("json_schema", LONG_TEXT))):
                    _, timed = engine.run(
                        [prompt] * batch, constraint, steps, ignore_eos=constraint is None
                    )
                    full = [t for b, t in timed if b == batch] or [t for _, t in timed]
                    best[k] = min(best[k], statistics.median(full) * 1e3)
            mask_ms = sum(mask_s) * 1e3 / max(1, reps * steps)
            print(f"| {batch} | {best[0]:.1f} | {best[1]:.1f} | {best[1] / best[0]:.3f} "
                  f"| {mask_ms:.2f} |")
    finally:
        model_runner.fill_grammar_bitmask, model_runner.apply_bitmask = fill, apply


def bench_compile(engine: Engine, per_subset: int, timeout_s: float, seed: int) -> None:
    print(f"\n## Compile time and coverage ({per_subset} sampled schemas per subset, "
          f"{timeout_s:g} s timeout per backend)")
    print("| subset | n | xgrammar ok | p50 ms | p99 ms | outlines ok | p50 ms | p99 ms "
          "| chain ok | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rng = random.Random(seed)
    services = {b.name: GrammarService([b], timeout_s=timeout_s, num_threads=1)
                for b in engine.grammars.service.backends}
    totals: dict[str, list[int]] = {name: [0, 0] for name in [*services, "chain"]}
    for subset in sorted(p.name for p in SCHEMA_DIR.iterdir()):
        files = sorted((SCHEMA_DIR / subset).glob("*.json"))
        sample = rng.sample(files, min(per_subset, len(files)))
        results: dict[str, list[tuple[bool, float]]] = {name: [] for name in services}
        for path in sample:
            text = path.read_text()
            for name, service in services.items():
                start = time.perf_counter()
                try:
                    service.compile("json_schema", text)
                    ok = True
                except ValueError:
                    ok = False
                results[name].append((ok, time.perf_counter() - start))
        xgr, outl = results["xgrammar"], results["outlines"]
        # The chain runs outlines only when xgrammar fails: its time is the sum then.
        results["chain"] = [(a_ok or b_ok, a_t + (0.0 if a_ok else b_t))
                            for (a_ok, a_t), (b_ok, b_t) in zip(xgr, outl)]
        cells = [subset, str(len(sample))]
        for name in ("xgrammar", "outlines", "chain"):
            oks = sum(ok for ok, _ in results[name])
            times = sorted(t * 1e3 for ok, t in results[name] if ok) or [float("nan")]
            totals[name][0] += oks
            totals[name][1] += len(sample)
            cells += [f"{oks}/{len(sample)}", f"{_pct(times, 50):.0f}", f"{_pct(times, 99):.0f}"]
        print("| " + " | ".join(cells) + " |")
    print("coverage: " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in totals.items()))
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
        reqs, steps = engine.run(prompts, Constraint("json_schema", PERSON), max_new_tokens)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in reqs)
        valid = sum(_is_json(engine.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                    for r in reqs)
        rates[jump] = tokens / seconds
        print(f"| {'on' if jump else 'off'} | {tokens} | {len(steps)} | {seconds:.2f} | "
              f"{tokens / seconds:.1f} | {valid}/{batch} |")
    print(f"tokens/s ratio on/off: {rates[True] / rates[False]:.2f}")


def _timed(fn: Callable, sink: list[float]) -> Callable:
    """Wrap ``fn`` so that each call's seconds are appended to ``sink``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

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
    parser.add_argument("--steps", type=int, default=24, help="decode steps per step-time run")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--reps", type=int, default=3, help="alternating step-time runs")
    parser.add_argument("--schemas-per-subset", type=int, default=4)
    parser.add_argument("--compile-timeout", type=float, default=10.0)
    parser.add_argument("--jump-batch", type=int, default=4)
    parser.add_argument("--jump-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma list of: step,compile,jump")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model_path = str(ensure_default_model())
    engine = Engine(model_path, jump_forward=False)
    print(f"model {model_path}, {args.threads} thread(s)")
    if "step" not in skip:
        bench_step_time(
            engine, [int(b) for b in args.batch_sizes.split(",")], args.steps, args.reps
        )
    if "compile" not in skip:
        bench_compile(engine, args.schemas_per_subset, args.compile_timeout, args.seed)
    if "jump" not in skip:
        bench_jump_forward(model_path, args.jump_batch, args.jump_tokens)


if __name__ == "__main__":
    main()
