"""The cost of a grammar-enforced tool call (issue 16): decode step time of requests under the
tool-call grammar (``server.tools.grammar``, ``tool_choice: required``, Hermes envelope, a
function with a free-text argument so calls keep going) vs the same prompts unconstrained, at
batch 1 and 16, on an in-process engine with the real default model. Both engines share the
model and step in turn, so outside load hits both alike; only decode steps with the full batch
count. The ratio is constrained / unconstrained, measured in this run.

    python bench/tool_calls.py --steps 24 --reps 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from grammar import Engine

from splitserve.default_model import ensure_default_model
from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.kernels.cpu.features import cpu_line
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.tools.formats import HERMES
from splitserve.server.tools.grammar import FunctionSpec, tool_call_constraint

TOOLS = [
    {"type": "function", "function": {
        "name": "write_note", "description": "Save a note with a title and a long body.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"}, "body": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["title", "body", "tags"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}},
]
PROMPT = "Write a long note about lighthouses and save it."


def bench(engine: Engine, batch_sizes: list[int], steps: int, reps: int) -> None:
    renderer = ChatRenderer(engine.tokenizer)
    text = renderer.render([{"role": "user", "content": PROMPT}], TOOLS)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    functions = [FunctionSpec(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    variants = {"unconstrained": None,
                "tool call": tool_call_constraint(HERMES, functions, "required", True)}
    print(f"\nprompt {len(prompt)} tokens (built-in tool prompt), {steps} decode steps, "
          f"{reps} rep(s)")
    print("| batch | steps | unconstrained ms/step | tool call ms/step | ratio |")
    print("|---|---|---|---|---|")
    for batch in batch_sizes:
        num_pages = batch * ((len(prompt) + steps) // 16 + 2) + 1
        cores = {}
        for name in variants:
            core = engine.new_core(False, num_pages)
            core.runner.grammar_mask = BatchMask(engine.config.vocab_size)
            cores[name] = core
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(reps):
            for name, constraint in variants.items():
                engine.submit_ids(cores[name], [prompt] * batch, constraint, steps,
                                  ignore_eos=constraint is None)
            timed: dict[str, list[float]] = {name: [] for name in variants}
            order = list(cores)
            while any(c.scheduler.has_work for c in cores.values()):
                order = order[1:] + order[:1]
                for name in order:
                    scheduler = cores[name].scheduler
                    if not scheduler.has_work:
                        continue
                    full = not scheduler.waiting and len(scheduler.running) == batch
                    start = time.perf_counter()
                    cores[name].step()
                    if full:
                        timed[name].append(time.perf_counter() - start)
            common = min(len(v) for v in timed.values())
            for name, values in timed.items():
                samples[name] += values[:common]
        base = statistics.median(samples["unconstrained"])
        tool = statistics.median(samples["tool call"])
        print(f"| {batch} | {len(samples['tool call'])} | {base * 1e3:.1f} | {tool * 1e3:.1f} "
              f"| {tool / base:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = str(ensure_default_model())
    engine = Engine(model_path, jump_forward=False)
    print(f"CPU: {cpu_line()}; model {model_path}, float32, {args.threads} thread(s)")
    bench(engine, [int(b) for b in args.batch_sizes.split(",")], args.steps, args.reps)


if __name__ == "__main__":
    main()
