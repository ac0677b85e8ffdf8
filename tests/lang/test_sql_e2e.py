"""Text to SQL against a launched disaggregated cluster (the default model): every query the
example's program (examples/text_to_sql.py) writes under the schema's grammar parses with SQLite
and names only tables and columns that exist, under run_batch and fork and through both
backends. The model is small: the tests check validity, not answers."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from splitserve import lang
from splitserve.lang.sql import describe_schema, read_schema, run_query, sql_grammar
from splitserve.lang.sql.names import SQLITE_KEYWORDS, table_aliases
from tests.lang.sql_data import build_shop, questions

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "text_to_sql.py"
FUNCTIONS = {"count", "sum", "avg", "min", "max", "round", "lower", "upper", "strftime"}


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("text_to_sql_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    return build_shop(tmp_path_factory.mktemp("sql") / "shop.db")


def unknown_names(sql: str, shop: Path) -> list[str]:
    """Identifiers in ``sql`` that are no keyword, function, table, table alias, column of a
    table, or column alias the query declares (``AS x``); ``t.c`` must name a column of ``t``."""
    schema = read_schema(shop)
    alias_of = table_aliases(t.name for t in schema.tables)
    table_of = {**{t.name: t.name for t in schema.tables}, **{a: t for t, a in alias_of.items()}}
    columns = {t.name: {c.name for c in t.columns} for t in schema.tables}
    text = re.sub(r"'(?:[^']|'')*'", "''", sql)
    declared = set(re.findall(r"(?i)\bAS\s+([a-z_]\w*)", text))
    bad = [f"{q}.{c}" for q, c in re.findall(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)", text)
           if q not in table_of or c not in columns[table_of[q]]]
    bare = re.findall(r"(?<![.\w])([A-Za-z_]\w*)(?![\w.])", text)
    known = SQLITE_KEYWORDS | FUNCTIONS | set(table_of) | declared | set().union(
        *columns.values())
    return bad + [w for w in bare if w.lower() not in known and w not in known]


def check_valid(sql: str, shop: Path) -> None:
    assert re.match(r"(?i)select\b", sql), sql
    parsed = run_query(shop, sql, explain_only=True)
    assert parsed.ok, (sql, parsed.error)
    assert unknown_names(sql, shop) == [], sql


def test_unknown_names_finds_what_is_missing(shop: Path) -> None:
    assert unknown_names("SELECT c.name AS who, COUNT(*) FROM customers c WHERE c.city = 'x y'"
                         " GROUP BY who", shop) == []
    assert unknown_names("SELECT o.salary, bogus FROM orders o", shop) == ["o.salary", "bogus"]


def test_run_batch_queries_parse_and_name_existing_columns(endpoint, example, shop) -> None:
    assert endpoint.capabilities().grammar
    grammar, schema = sql_grammar(shop), describe_schema(shop)
    batch = questions()[::5]  # 8 questions, single tables to four-table joins
    states = example.text_to_sql.run_batch(
        [{"question": q["question"], "schema": schema, "grammar": grammar} for q in batch],
        backend=endpoint, temperature=0)
    for state in states:
        assert isinstance(state, lang.ProgramState), state
        assert state.meta("sql")["finish_reason"] == "stop", state["sql"]
        check_valid(example.extract_sql(state["sql"]), shop)


def test_fork_branches_each_decode_under_the_grammar(endpoint, shop) -> None:
    grammar = sql_grammar(shop, tables=["products", "categories"])

    @lang.function
    def two_drafts(s):
        s += lang.user(describe_schema(shop, tables=["products", "categories"]) +
                       "\n\nWrite a SQL query: the most expensive product of each category.")
        forks = s.fork(2)
        forks += lang.assistant(lang.gen("sql", grammar=grammar, max_tokens=96,
                                         temperature=1.0))
        forks.join()
        return [f["sql"] for f in forks]

    for sql in two_drafts.run(backend=endpoint, seed=7).return_value:
        check_valid(sql, shop)
        assert "customers" not in sql and "orders" not in sql  # tables left out


def test_openai_compatible_backend_on_the_chat_endpoint(lang_cluster, shop) -> None:
    backend = lang.OpenAICompatible(lang_cluster.config.url + "/v1", "default")

    @lang.function
    def ask(s):
        s += lang.user(describe_schema(shop) + "\n\nHow many orders were cancelled?")
        s += lang.assistant(lang.gen("sql", grammar=sql_grammar(shop), max_tokens=96))

    check_valid(ask.run(backend=backend, temperature=0)["sql"], shop)
    assert backend.grammar_refusal(chat=True) is None
