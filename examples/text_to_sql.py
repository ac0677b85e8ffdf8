"""Text to SQL over a SQLite file: the schema goes in the prompt, the query is decoded under a
grammar made from that schema (only its tables and columns can be named, only SELECT, one
statement), then run read-only.

    python examples/text_to_sql.py "Which customers have never placed an order?"
    python examples/text_to_sql.py --database my.db "How many rows are in the users table?"

Without ``--database`` it builds the repository's sample shop database (tests/data/text_to_sql).
``--no-grammar`` decodes freely, stopping at ``;``, to compare.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import tempfile
from pathlib import Path

from splitserve import lang
from splitserve.lang.sql import describe_schema, run_query, sql_grammar

SHOP_SQL = Path(__file__).resolve().parent.parent / "tests" / "data" / "text_to_sql" / "shop.sql"
SYSTEM = ("You translate questions into SQLite queries. Answer with one SQL query only, no "
          "explanation.")


@lang.function
def text_to_sql(s, question: str, schema: str, grammar: str | None = None):
    """Ask for one query answering ``question`` over ``schema`` (CREATE TABLE text); under
    ``grammar`` (``sql_grammar``), else free text up to the first ``;``."""
    s += lang.system(SYSTEM)
    s += lang.user(f"Database schema:\n{schema}\n\nQuestion: {question}")
    if grammar is not None:
        s += lang.assistant(lang.gen("sql", grammar=grammar, max_tokens=160))
    else:
        s += lang.assistant(lang.gen("sql", stop=";", max_tokens=160))


def extract_sql(text: str) -> str:
    """The query in a model's answer: inside a ```sql fence if it wrote one, without ``;``."""
    fenced = re.search(r"```(?:sql|SQL)?\s*(.*?)(?:```|$)", text, re.DOTALL)
    return (fenced.group(1) if fenced else text).strip().rstrip(";").strip()


def build_shop(path: Path) -> Path:
    """The sample shop database at ``path``, built from its SQL script."""
    conn = sqlite3.connect(path)
    conn.executescript(SHOP_SQL.read_text())
    conn.commit()
    conn.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("question", nargs="?", default="How many orders has each customer "
                        "placed? Give the customer name and the count.")
    parser.add_argument("--database", type=Path, help="a SQLite file (default: the sample shop)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a splitserve server")
    parser.add_argument("--no-grammar", action="store_true")
    args = parser.parse_args()
    database = args.database or build_shop(Path(tempfile.mkdtemp()) / "shop.db")
    lang.set_default_backend(lang.Endpoint(args.url))
    grammar = None if args.no_grammar else sql_grammar(database)
    s = text_to_sql.run(args.question, describe_schema(database), grammar, temperature=0)
    sql = extract_sql(s["sql"])
    print(sql)
    result = run_query(database, sql)
    if not result.ok:
        print("error:", result.error)
        return
    print(" | ".join(result.columns))
    for row in result.rows[:20]:
        print(" | ".join(str(v) for v in row))


if __name__ == "__main__":
    main()
