"""Reading a schema (sqlite3, and SQLAlchemy where installed), the names a grammar writes, and
running a model's SQL read-only; no model, no grammar engine."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from splitserve.lang.sql import describe_schema, read_schema, run_query
from splitserve.lang.sql.names import (
    ALIAS_RESERVED,
    SQLITE_KEYWORDS,
    quote_identifier,
    table_aliases,
)
from splitserve.lang.sql.schema import ForeignKey
from splitserve.lang.sql.scopes import join_scopes
from tests.lang.sql_data import build_shop

SHOP_FKS = {ForeignKey("products", "category_id", "categories", "id"),
            ForeignKey("orders", "customer_id", "customers", "id"),
            ForeignKey("order_items", "order_id", "orders", "id"),
            ForeignKey("order_items", "product_id", "products", "id")}


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    return build_shop(tmp_path_factory.mktemp("sql") / "shop.db")


def test_sqlite_schema_tables_kinds_and_foreign_keys(shop: Path) -> None:
    schema = read_schema(shop)
    assert [t.name for t in schema.tables] == ["customers", "categories", "products", "orders",
                                               "order_items"]
    assert set(schema.foreign_keys) == SHOP_FKS
    kinds = {c.name: c.kind for c in schema.table("orders").columns}
    assert kinds == {"id": "integer", "customer_id": "integer", "order_date": "date",
                     "status": "text"}
    assert schema.table("products").column("price").kind == "real"
    text = describe_schema(shop)
    assert "FOREIGN KEY (customer_id) REFERENCES customers(id)" in text
    assert text.endswith("-- table aliases: customers c, categories ca, products p, orders o, "
                         "order_items oi")


def test_sqlalchemy_url_reads_the_same_schema(shop: Path) -> None:
    pytest.importorskip("sqlalchemy")
    via_url = read_schema(f"sqlite:///{shop}")
    direct = read_schema(shop)
    assert [t.name for t in via_url.tables] == sorted(t.name for t in direct.tables)
    assert set(via_url.foreign_keys) == SHOP_FKS
    for table in direct.tables:
        assert [(c.name, c.kind) for c in via_url.table(table.name).columns] == [
            (c.name, c.kind) for c in table.columns]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no SQLite database"):
        read_schema(tmp_path / "nope.db")


def test_alias_reserved_words_are_what_sqlite_refuses() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")

    def refused(word: str) -> bool:
        try:
            conn.execute(f"EXPLAIN SELECT x AS {word} FROM t WHERE x = 1")
        except sqlite3.Error:
            return True
        return False

    assert {w for w in SQLITE_KEYWORDS if refused(w)} == ALIAS_RESERVED


def test_identifiers_and_aliases() -> None:
    assert quote_identifier("orders") == "orders"
    assert quote_identifier("order") == '"order"'
    assert quote_identifier("unit price") == '"unit price"'
    assert quote_identifier("order", "mysql") == "`order`"
    assert table_aliases(["customers", "categories", "order_items", "orders", "in"]) == {
        "customers": "c", "categories": "ca", "order_items": "oi", "orders": "o", "in": "i"}


def test_join_scopes_follow_foreign_keys(shop: Path) -> None:
    scopes = join_scopes(read_schema(shop), max_joins=3)
    sets = [set(s.tables) for s in scopes]
    assert len(sets) == 5 + 4 + 3 + 2  # a chain of five tables
    assert {"customers", "order_items"} not in sets  # not linked directly
    three = next(s for s in scopes if set(s.tables) == {"customers", "orders", "order_items"})
    assert sorted(first for first, _ in three.orders) == ["customers", "order_items", "orders",
                                                          "orders"]
    with pytest.raises(ValueError, match="max_joins"):
        join_scopes(read_schema(shop), max_joins=-1)


def test_run_query_reads_and_never_writes(shop: Path) -> None:
    out = run_query(shop, "SELECT c.name, o.id FROM customers c JOIN orders o ON "
                          "o.customer_id = c.id WHERE o.id = 1;")
    assert out.ok and out.columns == ["name", "id"] and len(out.rows) == 1
    assert out.columns_read == {("customers", "name"), ("customers", "id"), ("orders", "id"),
                                ("orders", "customer_id")}
    for sql in ["DELETE FROM orders", "DROP TABLE orders", "UPDATE products SET price = 0",
                "ATTACH DATABASE ':memory:' AS x", "SELECT 1; DELETE FROM orders"]:
        assert not run_query(shop, sql).ok, sql
    assert run_query(shop, "SELECT COUNT(*) FROM orders").rows == [(48,)]
    missing = run_query(shop, "SELECT salary FROM customers", explain_only=True)
    assert "no such column: salary" in missing.error
