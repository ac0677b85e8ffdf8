"""SQL for prompt programs: a grammar from a database's schema, and a read-only way to run
what the model wrote.

    from splitserve import lang
    from splitserve.lang.sql import sql_grammar, describe_schema, run_query

    grammar = sql_grammar("shop.db")   # or a SQLAlchemy URL
    s += lang.user(describe_schema("shop.db") + "\\n" + question)
    s += lang.assistant(lang.gen("sql", grammar=grammar, max_tokens=128))
    rows = run_query("shop.db", s["sql"]).rows

See ``docs/dsl.md`` (text-to-SQL).
"""

from __future__ import annotations

from pathlib import Path

from splitserve.lang.sql.grammar import schema_grammar
from splitserve.lang.sql.names import table_aliases
from splitserve.lang.sql.query import QueryResult, run_query
from splitserve.lang.sql.schema import Column, ForeignKey, Schema, Table, read_schema


def sql_grammar(database: str | Path | Schema, *, tables: list[str] | None = None,
                max_joins: int = 3, aliases: bool = True) -> str:
    """A GBNF grammar (for ``gen(grammar=...)``, the server's ``ebnf`` field) of read-only SQL
    over ``database``, in which only its tables and columns can be named, and only the columns
    of the tables the query reads (``lang.sql.grammar`` has the subset).

    Args:
        database: a SQLite file path, a SQLAlchemy URL (``postgresql://...``; needs
            ``splitserve[sql]``), or a :class:`Schema` already read.
        tables: only these tables may be queried (default: all).
        max_joins: at most this many ``JOIN``s per query, each over a declared foreign key.
        aliases: allow each table's short alias (``orders o``; see ``names.table_aliases``).

    Returns:
        The grammar text: one ``SELECT`` statement, an optional ``;``; never DML or DDL.

    Raises:
        FileNotFoundError: no SQLite file there. KeyError: ``tables`` names a missing table.
        ValueError: no table, or too many join scopes (restrict ``tables``/``max_joins``).
        ImportError: a URL without SQLAlchemy installed.
    """
    schema = database if isinstance(database, Schema) else read_schema(database)
    if tables is not None:
        schema = schema.restricted(tables)
    return schema_grammar(schema, max_joins=max_joins, aliases=aliases)


def describe_schema(database: str | Path | Schema, *, tables: list[str] | None = None,
                    aliases: bool = True) -> str:
    """The schema as ``CREATE TABLE`` statements with foreign keys, for a prompt; with
    ``aliases``, a last comment line names the alias :func:`sql_grammar` allows for each table
    (``-- table aliases: customers c, orders o``), so the model can use them."""
    schema = database if isinstance(database, Schema) else read_schema(database)
    if tables is not None:
        schema = schema.restricted(tables)
    text = schema.describe()
    if aliases:
        names = table_aliases(t.name for t in schema.tables)
        text += "\n-- table aliases: " + ", ".join(f"{t} {a}" for t, a in names.items())
    return text


__all__ = ["Column", "ForeignKey", "QueryResult", "Schema", "Table", "describe_schema",
           "read_schema", "run_query", "sql_grammar"]
