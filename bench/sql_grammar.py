"""The cost of the SQL grammar (issue 38) within the grammar layer's budgets (compile < 1 s,
decode step overhead <= 1.05x), on the text-to-SQL data set's shop database:

1. compile time of ``lang.sql.sql_grammar``'s GBNF per backend (wall and CPU, median of
   ``--reps`` fresh backends), and which backend the chain picks (its first that compiles);
2. mask fill time per token (p50/p99) along every reference query, per backend;
3. decode step time of requests under the grammar against the same prompts unconstrained, at
   batch 1 and 16, in process with the real default model: both engines share the model and
   step in turn (outside load hits both alike); only steps with the full batch count. The
   ratio is constrained / unconstrained, from this run.

    python bench/sql_grammar.py --reps 3 --steps 24 --step-reps 2
    python bench/sql_grammar.py --model qwen-coder --skip step
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import DATA_DIR, cpu_line, percentile
from grammar import Engine

from splitserve.default_model import ensure_default_model
from splitserve.engine.grammar import GrammarError, GrammarService, allocate_bitmask
from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.registry import BACKEND_NAMES, create_backend
from splitserve.ipc.messages import Constraint
from splitserve.lang.sql import describe_schema, sql_grammar

DATA = DATA_DIR / "text_to_sql"


def model_path(name: str) -> str:
    """``default``, ``qwen-coder`` (its 151k-token vocabulary makes every mask 3x wider) or a
    model folder."""
    if name == "default":
        return str(ensure_default_model())
    if name == "qwen-coder":
        from splitserve.qwen_coder import ensure_qwen_coder_model

        return str(ensure_qwen_coder_model())
    return name


def build_shop() -> Path:
    path = Path(tempfile.mkdtemp()) / "shop.db"
    conn = sqlite3.connect(path)
    conn.executescript((DATA / "shop.sql").read_text())
    conn.commit()
    conn.close()
    return path


def compile_times(tokenizer, grammar: str, reps: int) -> None:
    print("\n| backend | compiles | wall ms (median) | CPU ms (median) |\n|---|---|---|---|")
    for name in BACKEND_NAMES:
        walls, cpus, error = [], [], None
        for _ in range(reps):
            backend = create_backend(name, tokenizer)  # fresh: no compile cache
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                backend.compile("ebnf", grammar)
            except GrammarError as exc:
                error = str(exc).splitlines()[0][:60]
                break
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        if error:
            print(f"| {name} | no: {error} | | |")
        else:
            print(f"| {name} | yes | {1e3 * statistics.median(walls):.0f} | "
                  f"{1e3 * statistics.median(cpus):.0f} |")
    service = GrammarService([create_backend(n, tokenizer) for n in BACKEND_NAMES],
                             timeout_s=60.0)
    print(f"chain ({', '.join(BACKEND_NAMES)}) picks: "
          f"{service.compile('ebnf', grammar).backend_name}")
    service.shutdown()


def mask_times(tokenizer, grammar: str, queries: list[str]) -> None:
    print("\n| backend | tokens | mask fill µs p50 | p99 |\n|---|---|---|---|")
    for name in ("llguidance", "xgrammar"):
        compiled = create_backend(name, tokenizer).compile("ebnf", grammar)
        bitmask = allocate_bitmask(1, compiled.vocab_size)
        times = []
        for sql in queries:
            matcher = compiled.create_matcher()
            for token in tokenizer.encode(sql, add_special_tokens=False):
                start = time.perf_counter()
                matcher.fill_bitmask(bitmask, 0)
                times.append(time.perf_counter() - start)
                assert matcher.accept_token(token), sql
        print(f"| {name} | {len(times)} | {1e6 * percentile(times, 50):.0f} | "
              f"{1e6 * percentile(times, 99):.0f} |")


def step_times(engine: Engine, prompts: list[list[int]], grammar: str, batch_sizes: list[int],
               steps: int, reps: int) -> None:
    variants = {"unconstrained": None, "SQL grammar": Constraint("ebnf", grammar)}
    fills: list[float] = []  # CPU seconds of each mask fill (on the mask thread)
    fill = BatchMask.fill

    def timed_fill(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return fill(self, *args, **kwargs)
        finally:
            fills.append(time.thread_time() - start)

    BatchMask.fill = timed_fill
    print(f"\n{steps} decode steps, {reps} rep(s); wall and main-thread CPU per step (the mask "
          "is filled on its own thread during the forward pass)\n| batch | steps timed | "
          "unconstrained ms wall / CPU | SQL grammar ms wall / CPU | ratio wall / CPU | "
          "mask fill CPU ms/step |\n|---|---|---|---|---|---|")
    try:
        for batch in batch_sizes:
            fills.clear()
            samples = _step_samples(engine, prompts, variants, batch, steps, reps)
            base, sql = (tuple(statistics.median(x) for x in zip(*samples[name]))
                         for name in variants)
            num = len(samples["SQL grammar"])
            print(f"| {batch} | {num} | {1e3 * base[0]:.1f} / {1e3 * base[1]:.1f} | "
                  f"{1e3 * sql[0]:.1f} / {1e3 * sql[1]:.1f} | {sql[0] / base[0]:.3f} / "
                  f"{sql[1] / base[1]:.3f} | {1e3 * statistics.mean(fills or [0]):.2f} |",
                  flush=True)
    finally:
        BatchMask.fill = fill


def _step_samples(engine: Engine, prompts: list[list[int]], variants: dict, batch: int,
                  steps: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, main-thread CPU) of every step each variant took with its batch full, the
    variants stepping in turn."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    num_pages = sum(len(p) + steps for p in rows) // 16 + 2 * batch + 1
    cores = {name: engine.new_core(False, num_pages) for name in variants}
    for core in cores.values():
        core.runner.grammar_mask = BatchMask(engine.config.vocab_size)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, constraint in variants.items():
            engine.submit_ids(cores[name], rows, constraint, steps, ignore_eos=constraint is None)
        timed: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        order = list(cores)
        while any(c.scheduler.has_work for c in cores.values()):
            order = order[1:] + order[:1]
            for name in order:
                scheduler = cores[name].scheduler
                if not scheduler.has_work:
                    continue
                full = not scheduler.waiting and len(scheduler.running) == batch
                start, cpu = time.perf_counter(), time.thread_time()
                cores[name].step()
                if full:
                    timed[name].append((time.perf_counter() - start, time.thread_time() - cpu))
        common = min(len(v) for v in timed.values())
        for name, values in timed.items():
            samples[name] += values[1:common]  # the first holds the prefill's last chunk
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="compiles per backend")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--step-reps", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--skip", default="", help="comma list of compile,mask,step")
    parser.add_argument("--model", default="default",
                        help="default, qwen-coder (the tool-model extra) or a model folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(args.skip.split(","))
    database = build_shop()
    start = time.perf_counter()
    grammar = sql_grammar(database)
    questions = json.loads((DATA / "questions.json").read_text())["questions"]
    print(f"CPU: {cpu_line()}; {args.threads} thread(s)\nshop grammar: {len(grammar):,} "
          f"characters, {grammar.count('::=')} rules, built in "
          f"{1e3 * (time.perf_counter() - start):.0f} ms")
    engine = Engine(model_path(args.model), jump_forward=False)
    print(f"model: {args.model}, vocabulary {engine.config.vocab_size:,} tokens")
    if "compile" not in skip:
        compile_times(engine.tokenizer, grammar, args.reps)
    if "mask" not in skip:
        mask_times(engine.tokenizer, grammar, [q["sql"] for q in questions])
    if "step" not in skip:
        schema = describe_schema(database)
        prompts = [engine.chat_ids(f"Database schema:\n{schema}\n\nQuestion: {q['question']}")
                   for q in questions]
        step_times(engine, prompts, grammar, [int(b) for b in args.batch_sizes.split(",")],
                   args.steps, args.step_reps)


if __name__ == "__main__":
    main()
