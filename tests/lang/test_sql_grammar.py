"""The SQL grammar from a schema, model-free, through the grammar engine's own matchers (the
backends the server compiles ``ebnf`` with): it accepts every reference query of the data set
and refuses what names a missing table or column, a column of a table the query does not
read, DML, DDL and a second statement."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from splitserve.engine.grammar import GrammarError, GrammarService
from splitserve.engine.grammar.llguidance_backend import LLGuidanceBackend
from splitserve.engine.grammar.outlines_backend import OutlinesBackend
from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend
from splitserve.lang.sql import run_query, sql_grammar
from tests.lang.sql_data import build_shop, questions

REFUSED = {
    "a missing table": "SELECT name FROM suppliers",
    "a missing column": "SELECT salary FROM customers",
    "a column of a table not read": "SELECT price FROM customers",
    "a column of a table not joined": "SELECT c.name, p.name FROM customers c JOIN orders o "
                                      "ON o.customer_id = c.id",
    "an alias the FROM did not declare": "SELECT o.name FROM customers c",
    "a table name once it is aliased": "SELECT customers.name FROM customers c",
    "a join on no foreign key": "SELECT c.name FROM customers c JOIN products p ON p.id = c.id",
    "an ambiguous bare column": "SELECT name FROM customers c JOIN orders o ON "
                                "o.customer_id = c.id JOIN order_items oi ON oi.order_id = "
                                "o.id JOIN products p ON oi.product_id = p.id",
    "a text literal for a number": "SELECT name FROM products WHERE price = 'cheap'",
    "a number for a date": "SELECT id FROM orders WHERE order_date > 2025",
    "a reserved word as an alias": "SELECT name AS from FROM customers",
    "DELETE": "DELETE FROM orders",
    "UPDATE": "UPDATE products SET price = 1",
    "INSERT": "INSERT INTO categories VALUES (9, 'x')",
    "DROP": "DROP TABLE orders",
    "a pragma": "PRAGMA table_info(orders)",
    "a second statement": "SELECT name FROM customers; SELECT name FROM products",
    "a statement after a query": "SELECT name FROM customers; DROP TABLE customers",
    "a subquery of two columns": "SELECT name FROM customers WHERE id IN (SELECT id, "
                                 "customer_id FROM orders)",
    "a correlated subquery": "SELECT c.name FROM customers c WHERE c.id IN (SELECT "
                             "o.customer_id FROM orders o WHERE o.customer_id = c.id)",
    "an ORDER BY position (maybe out of range)": "SELECT name FROM products ORDER BY 2",
    "a comment (SQL reads -- as one)": "SELECT name FROM products ORDER BY 10 --10",
    "a comment in a condition": "SELECT name FROM products WHERE price --1 > 2",
}


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    return build_shop(tmp_path_factory.mktemp("sql") / "shop.db")


@pytest.fixture(scope="module")
def compiled(shop: Path, tokenizer: Any) -> dict[str, Any]:
    grammar = sql_grammar(shop)
    return {"llguidance": LLGuidanceBackend(tokenizer).compile("ebnf", grammar),
            "xgrammar": XGrammarBackend(tokenizer).compile("ebnf", grammar)}


def accepts(compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether the matcher takes every token of ``text`` and may then end."""
    matcher = compiled.create_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.can_end()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_every_reference_query_is_accepted(backend: str, compiled: dict, tokenizer: Any) -> None:
    rejected = [q["sql"] for q in questions()
                if not accepts(compiled[backend], tokenizer, q["sql"])
                or not accepts(compiled[backend], tokenizer, q["sql"] + ";")]
    assert len(questions()) >= 36 and rejected == []


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_refuses_what_does_not_exist_writes_or_chains(backend: str, compiled: dict,
                                                      tokenizer: Any) -> None:
    accepted = [why for why, sql in REFUSED.items()
                if accepts(compiled[backend], tokenizer, sql)]
    assert accepted == []
    # Each refusal is the named fault, not a grammar that refuses everything near it.
    assert accepts(compiled[backend], tokenizer, "SELECT c.name, o.id FROM customers c JOIN "
                                                 "orders o ON o.customer_id = c.id")


def test_keyword_case_newlines_and_aliases(compiled: dict, tokenizer: Any) -> None:
    for sql in ["select count(*) as n from orders o where o.status = 'shipped'",
                ("SELECT ca.name AS category,\nCOUNT(*) AS num_products\nFROM categories AS ca\n"
                 "JOIN products AS p ON ca.id = p.category_id\nGROUP BY ca.name\n"
                 "ORDER BY COUNT(*) DESC"),
                "SELECT ROUND(AVG(price), 2) FROM products WHERE name NOT LIKE '%Book%'",
                "SELECT name FROM products WHERE (price > 10 OR stock = 0) AND NOT price >= 100",
                "SELECT id FROM orders LIMIT 5 OFFSET 10",
                "SELECT name FROM products WHERE price > (SELECT AVG(price) FROM products)",
                ("SELECT c.name FROM customers c WHERE c.id NOT IN (SELECT o.customer_id FROM "
                "orders o WHERE o.status = 'cancelled')")]:
        assert accepts(compiled["llguidance"], tokenizer, sql), sql


def test_allowed_tables_leave_the_others_out(shop: Path, tokenizer: Any) -> None:
    grammar = sql_grammar(shop, tables=["products", "categories"])
    compiled = LLGuidanceBackend(tokenizer).compile("ebnf", grammar)
    # Aliases are chosen among the tables allowed: categories is c now that customers is out.
    assert accepts(compiled, tokenizer, "SELECT p.name FROM products p JOIN categories c ON "
                                        "p.category_id = c.id")
    assert not accepts(compiled, tokenizer, "SELECT name FROM customers")
    with pytest.raises(KeyError, match="no table 'suppliers'"):
        sql_grammar(shop, tables=["suppliers"])


def test_the_chain_compiles_it_with_llguidance_and_outlines_refuses(shop: Path,
                                                                     tokenizer: Any) -> None:
    grammar = sql_grammar(shop)
    with pytest.raises(GrammarError):
        OutlinesBackend(tokenizer).compile("ebnf", grammar)
    service = GrammarService([LLGuidanceBackend(tokenizer), XGrammarBackend(tokenizer),
                              OutlinesBackend(tokenizer)], timeout_s=60.0)
    try:
        assert service.compile("ebnf", grammar).backend_name == "llguidance"
    finally:
        service.shutdown()


def test_keyword_names_are_quoted_and_untyped_columns_compare(tmp_path: Path,
                                                              tokenizer: Any) -> None:
    db = tmp_path / "quirks.db"
    conn = sqlite3.connect(db)
    conn.executescript('CREATE TABLE "order" (id INTEGER PRIMARY KEY, "group" TEXT, note);'
                       'CREATE TABLE line (id INTEGER, order_id INTEGER REFERENCES "order"(id),'
                       ' qty);')
    conn.close()
    grammar = sql_grammar(db)
    for name in ("llguidance", "xgrammar"):
        backend = LLGuidanceBackend if name == "llguidance" else XGrammarBackend
        compiled = backend(tokenizer).compile("ebnf", grammar)
        for sql in ['SELECT "group" FROM "order" WHERE note = \'x\' OR note > 3',
                    'SELECT o."group", l.qty FROM "order" o JOIN line l ON l.order_id = o.id']:
            assert accepts(compiled, tokenizer, sql), (name, sql)
            assert run_query(db, sql, explain_only=True).ok, sql
        assert not accepts(compiled, tokenizer, "SELECT group FROM order")
