"""Text to SQL through a disaggregated cluster (issue 38): the share of generated queries that
parse (SQLite ``EXPLAIN``: valid syntax, every table and column exists), that run without error,
and whose result equals the reference query's, with the schema's SQL grammar
(``lang.sql.sql_grammar``) against without it (plain ``gen`` stopping at ``;``), per model, in one
run. The program is ``examples/text_to_sql.py``'s; the data set is tests/data/text_to_sql (a
shop database built here, 40 questions with reference queries, CC0). Greedy decoding; a
fenced answer (```sql ... ```) is unwrapped for both. Results are compared as multisets of rows
(in order where the reference has ORDER BY), numbers rounded to 4 decimals.

    python bench/text_to_sql.py --models default qwen-coder
    python bench/text_to_sql.py --url http://127.0.0.1:8000 --models default   # a running server
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from common import DATA_DIR, cpu_line, default_dtype, launch_cluster

from splitserve import lang
from splitserve.lang.sql import describe_schema, run_query, sql_grammar

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "text_to_sql.py"
QUESTIONS = DATA_DIR / "text_to_sql" / "questions.json"


def load_example() -> Any:
    """``examples/text_to_sql.py`` as a module (its name would clash with this file's)."""
    spec = importlib.util.spec_from_file_location("text_to_sql_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def model_path(name: str) -> str:
    """``default``, ``qwen-coder`` (the tool-model extra) or a model folder / GGUF path."""
    if name == "default":
        from splitserve.default_model import ensure_default_model

        return str(ensure_default_model())
    if name == "qwen-coder":
        from splitserve.qwen_coder import ensure_qwen_coder_model

        return str(ensure_qwen_coder_model())
    return name


def normalized(rows: list[tuple], ordered: bool) -> list[tuple]:
    """Rows comparable across queries: floats rounded, sorted unless the order counts."""
    out = [tuple(round(v, 4) if isinstance(v, float) else v for v in row) for row in rows]
    return out if ordered else sorted(out, key=repr)


def score(database: Path, sql: str, reference: str) -> dict[str, Any]:
    """Whether ``sql`` parses, runs, and returns what ``reference`` returns."""
    parsed = run_query(database, sql, explain_only=True)
    ran = run_query(database, sql) if parsed.ok else parsed
    ref = run_query(database, reference)
    ordered = "ORDER BY" in reference.upper()
    match = ran.ok and normalized(ran.rows, ordered) == normalized(ref.rows, ordered)
    return {"sql": sql, "parses": parsed.ok, "executes": ran.ok, "matches": match,
            "error": ran.error}


def run_mode(example: Any, database: Path, questions: list[dict], grammar: str | None,
             threads: int) -> tuple[list[dict[str, Any]], float]:
    """Every question through the program; returns the scored answers and the wall time."""
    schema = describe_schema(database)
    start = time.perf_counter()
    states = example.text_to_sql.run_batch(
        [{"question": q["question"], "schema": schema, "grammar": grammar} for q in questions],
        num_threads=threads, temperature=0)
    wall = time.perf_counter() - start
    scored = []
    for q, s in zip(questions, states):
        if isinstance(s, lang.ProgramError):
            scored.append({"sql": None, "parses": False, "executes": False, "matches": False,
                           "error": str(s)})
            continue
        scored.append({"id": q["id"], **score(database, example.extract_sql(s["sql"]),
                                             q["sql"])})
    return scored, wall


def share(rows: list[dict[str, Any]], key: str) -> str:
    hits = sum(r[key] for r in rows)
    return f"{hits}/{len(rows)} ({100 * hits / len(rows):.0f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["default", "qwen-coder"])
    parser.add_argument("--url", help="use this running server (one model) instead of "
                                      "launching a disaggregated cluster per model")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--batch-threads", type=int, default=8, help="run_batch's threads")
    parser.add_argument("--transfer-timeout", type=float, default=300.0,
                        help="the launched cluster's KV transfer timeout, s (a loaded 2-core "
                             "machine can stall a transfer past the default 30 s)")
    parser.add_argument("--num-questions", type=int, default=0, help="0: all")
    parser.add_argument("--out", type=Path, help="write every generated query here (JSON)")
    args = parser.parse_args()
    example = load_example()
    questions = json.loads(QUESTIONS.read_text())["questions"]
    questions = questions[: args.num_questions or None]
    database = example.build_shop(Path(tempfile.mkdtemp()) / "shop.db")
    start = time.perf_counter()
    grammar = sql_grammar(database)
    print(f"{cpu_line()}\n{len(questions)} questions; grammar {len(grammar):,} characters, "
          f"built in {1e3 * (time.perf_counter() - start):.0f} ms", flush=True)
    dtype, _ = default_dtype()
    report: dict[str, Any] = {}
    table = ["| model | decoding | parses | executes | result = reference | s/query |",
             "|---|---|---|---|---|---|"]
    for name in args.models:
        cluster = (nullcontext(args.url) if args.url else launch_cluster(
            "disaggregated", model_path(name), dtype, threads_per_worker=args.threads_per_worker,
            transfer_timeout_s=args.transfer_timeout))
        with cluster as url:
            lang.set_default_backend(lang.Endpoint(url))
            for mode, g in (("grammar", grammar), ("free, stop at ;", None)):
                rows, wall = run_mode(example, database, questions, g, args.batch_threads)
                report[f"{name} / {mode}"] = rows
                table.append(f"| {name} | {mode} | {share(rows, 'parses')} | "
                             f"{share(rows, 'executes')} | {share(rows, 'matches')} | "
                             f"{wall / len(rows):.2f} |")
                print(table[-1], flush=True)
                if args.out:  # after every mode: a later model's failure keeps these
                    args.out.write_text(json.dumps(report, indent=1))
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
