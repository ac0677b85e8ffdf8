"""Where a worker's memory goes on the grammar side (issue 33: a worker OOM-killed at ~6.5 GB).

Builds the grammar side exactly as a worker does (``worker.grammars.create_worker_grammars``:
the model's tokenizer, every registered backend, the compile pool of child processes), then

1. compiles every real schema the e2e test sends (``tests/data/jsonschemabench``, 70, compact
   JSON, not strict) one after the other, printing after each the worker's RSS, its children's
   RSS, which backend compiled it, the service's estimate of its cache (bytes) and the
   exported payload's size;
2. compiles a 24-tool tool-call grammar (Claude-Code-like tools, Hermes envelope, ``auto``);
3. makes one request's grammar (matcher + mask fill) per compiled constraint, then drops them;
4. builds the think block's end-marker automaton (``WorkerGrammars.marker_scan``).

RSS is read from ``/proc``; ``malloc_trim`` runs before each reading so freed heap does not
count. One line per step; the model's CPU is printed first.

    .venv/bin/python bench/grammar_memory.py --model ~/.cache/splitserve/SmolLM2-135M-Instruct
    .venv/bin/python bench/grammar_memory.py --model ~/.cache/splitserve/Qwen2.5-Coder-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from common import DATA_DIR, cpu_line

from splitserve.engine.grammar.base import GrammarError
from splitserve.engine.grammar.bitmask import allocate_bitmask
from splitserve.engine.grammar.options import CompileOptions
from splitserve.engine.grammar.request_grammar import RequestGrammar
from splitserve.engine.model.config import ModelConfig
from splitserve.server.tools.formats import HERMES
from splitserve.server.tools.grammar import FunctionSpec, tool_call_constraint
from splitserve.worker.grammars import create_worker_grammars

SCHEMA_DIR = DATA_DIR / "jsonschemabench" / "schemas"
MIB = 2**20


def rss_mib(pid: int | str = "self") -> float:
    """Returns: resident set size of ``pid`` in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children_rss_mib() -> float:
    """Returns: the summed RSS of this process's children (the compile processes), MiB."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(rss_mib(k) for k in kids)
    return total


def trim() -> None:
    """Give freed heap back to the OS, so RSS counts what is held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def claude_code_tools(n: int) -> list[FunctionSpec]:
    """``n`` tools shaped like Claude Code's (string/enum/array/object arguments)."""
    base = [
        ("Bash", {"command": {"type": "string"}, "timeout": {"type": "number"},
                  "description": {"type": "string"}, "run_in_background": {"type": "boolean"}},
         ["command"]),
        ("Read", {"file_path": {"type": "string"}, "offset": {"type": "number"},
                  "limit": {"type": "number"}}, ["file_path"]),
        ("Write", {"file_path": {"type": "string"}, "content": {"type": "string"}},
         ["file_path", "content"]),
        ("Edit", {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                  "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
         ["file_path", "old_string", "new_string"]),
        ("MultiEdit", {"file_path": {"type": "string"}, "edits": {"type": "array", "minItems": 1,
                       "items": {"type": "object", "properties": {
                           "old_string": {"type": "string"}, "new_string": {"type": "string"},
                           "replace_all": {"type": "boolean"}},
                           "required": ["old_string", "new_string"],
                           "additionalProperties": False}}}, ["file_path", "edits"]),
        ("Glob", {"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern"]),
        ("Grep", {"pattern": {"type": "string"}, "path": {"type": "string"},
                  "glob": {"type": "string"},
                  "output_mode": {"type": "string",
                                  "enum": ["content", "files_with_matches", "count"]},
                  "-B": {"type": "number"}, "-A": {"type": "number"}, "-C": {"type": "number"},
                  "-n": {"type": "boolean"}, "-i": {"type": "boolean"},
                  "type": {"type": "string"}, "head_limit": {"type": "number"},
                  "multiline": {"type": "boolean"}}, ["pattern"]),
        ("WebFetch", {"url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"}},
         ["url", "prompt"]),
        ("WebSearch", {"query": {"type": "string", "minLength": 2},
                       "allowed_domains": {"type": "array", "items": {"type": "string"}},
                       "blocked_domains": {"type": "array", "items": {"type": "string"}}},
         ["query"]),
        ("TodoWrite", {"todos": {"type": "array", "items": {"type": "object", "properties": {
            "content": {"type": "string", "minLength": 1},
            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
            "activeForm": {"type": "string", "minLength": 1}},
            "required": ["content", "status", "activeForm"], "additionalProperties": False}}},
         ["todos"]),
        ("NotebookEdit", {"notebook_path": {"type": "string"}, "cell_id": {"type": "string"},
                          "new_source": {"type": "string"},
                          "cell_type": {"type": "string", "enum": ["code", "markdown"]},
                          "edit_mode": {"type": "string",
                                        "enum": ["replace", "insert", "delete"]}},
         ["notebook_path", "new_source"]),
        ("Task", {"description": {"type": "string"}, "prompt": {"type": "string"},
                  "subagent_type": {"type": "string"}},
         ["description", "prompt", "subagent_type"]),
        ("ExitPlanMode", {"plan": {"type": "string"}}, ["plan"]),
        ("BashOutput", {"bash_id": {"type": "string"}, "filter": {"type": "string"}},
         ["bash_id"]),
        ("KillShell", {"shell_id": {"type": "string"}}, ["shell_id"]),
        ("SlashCommand", {"command": {"type": "string"}}, ["command"]),
    ]
    tools = []
    for i in range(n):
        name, props, required = base[i % len(base)]
        suffix = "" if i < len(base) else f"_{i}"
        tools.append(FunctionSpec(name + suffix, {
            "type": "object", "properties": props, "required": required,
            "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}))
    return tools


def exported_bytes(service: Any, compiled: Any) -> int:
    """Returns: the size of what the compile process ships back for ``compiled`` (bytes)."""
    backend = service._by_name[compiled.backend_name]
    exported = backend.export(compiled)
    if exported is None:
        return 0
    return len(exported) if isinstance(exported, str | bytes) else len(pickle.dumps(exported))


def report(label: str, grammars: Any, extra: str = "") -> None:
    trim()
    service = grammars.service
    cached = getattr(service, "cached_bytes", None)
    est = f" cache_est={cached() / MIB:7.1f}MiB" if callable(cached) else ""
    print(f"{label:<48} worker_rss={rss_mib():7.1f}MiB children_rss={children_rss_mib():7.1f}MiB"
          f"{est} {extra}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (config + tokenizer)")
    parser.add_argument("--schemas", type=int, default=70, help="how many real schemas")
    parser.add_argument("--pick", default="",
                        help="comma-separated parts of schema names: only those (else all)")
    parser.add_argument("--tools", type=int, default=24)
    parser.add_argument("--procs", type=int, default=2, help="compile processes (0: threads)")
    parser.add_argument("--timeout", type=float, default=30.0, help="compile deadline, s")
    parser.add_argument("--export-sizes", action="store_true",
                        help="also print each grammar's exported size (costs a serialization)")
    args = parser.parse_args()
    print(f"CPU: {cpu_line()}; python {sys.version.split()[0]}; pid {os.getpid()}")
    model = os.path.expanduser(args.model)
    config = ModelConfig.from_dir(model)
    print(f"model {Path(model).name}: vocab {config.vocab_size}")
    trim()
    print(f"{'start':<48} worker_rss={rss_mib():7.1f}MiB")
    grammars = create_worker_grammars(model, config.vocab_size, config.eos_token_ids,
                                      compile_procs=args.procs, compile_timeout_s=args.timeout)
    report("grammar side built (tokenizer, backends)", grammars)
    options = CompileOptions(whitespace_flexible=False, strict=False)
    names = sorted(p.relative_to(SCHEMA_DIR).as_posix() for p in SCHEMA_DIR.glob("*/*.json"))
    if args.pick:
        names = [n for n in names if any(part in n for part in args.pick.split(","))]
    compiled: list[Any] = []
    started = time.perf_counter()
    for n, name in enumerate(names[: args.schemas], 1):
        text = json.dumps(json.loads((SCHEMA_DIR / name).read_text()))
        try:
            grammar = grammars.service.submit("json_schema", text, options).result()
        except GrammarError as exc:
            report(f"{n:2d} {name[:40]}", grammars, f"refused: {str(exc)[:60]}")
            continue
        compiled.append(grammar)
        size = (f" export={exported_bytes(grammars.service, grammar) / MIB:.2f}MiB"
                if args.export_sizes else "")
        report(f"{n:2d} {name[:40]}", grammars, f"{grammar.backend_name}{size}")
    print(f"schemas compiled: {len(compiled)} in {time.perf_counter() - started:.1f}s")
    tools = tool_call_constraint(HERMES, claude_code_tools(args.tools), "auto", parallel=True)
    started = time.perf_counter()
    try:
        tool_grammar = grammars.service.submit(tools.kind, tools.text, options).result()
        compiled.append(tool_grammar)
        size = (f" export={exported_bytes(grammars.service, tool_grammar) / MIB:.2f}MiB"
                if args.export_sizes else "")
        report(f"{args.tools}-tool grammar ({len(tools.text)} chars)", grammars,
               f"{tool_grammar.backend_name} {time.perf_counter() - started:.1f}s{size}")
    except GrammarError as exc:
        report(f"{args.tools}-tool grammar", grammars, f"refused: {str(exc)[:80]}")
    requests = []
    bitmask = allocate_bitmask(1, config.vocab_size)
    for grammar in compiled:
        request = RequestGrammar(grammar.create_matcher(64), config.vocab_size,
                                 grammars.stop_token_ids, None)
        request.fill_bitmask(bitmask, 0)
        request.must_end()
        requests.append(request)
    report(f"{len(requests)} request grammars, one mask each", grammars)
    del requests, request
    report("request grammars dropped", grammars)
    grammars.marker_scan("</think>")
    report("think end-marker automaton", grammars)
    grammars.close()


if __name__ == "__main__":
    main()
