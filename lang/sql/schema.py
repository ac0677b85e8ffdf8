"""A database's schema as plain data: tables, typed columns and foreign keys, read from a SQLite
file (``sqlite3``, opened read-only) or from any database SQLAlchemy reaches (a URL; SQLAlchemy
is imported only then: ``pip install 'splitserve[sql]'``)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# What a literal compared with the column must look like (SQLite's type affinity rules,
# https://sqlite.org/datatype3.html section 3.1, with dates split off NUMERIC: they are stored as
# ISO-8601 text).
ValueKind = Literal["integer", "real", "text", "date", "blob"]


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, declared type (as written, may be empty) and value kind."""

    name: str
    declared_type: str
    kind: ValueKind


@dataclass(frozen=True, slots=True)
class ForeignKey:
    """``table.column REFERENCES ref_table(ref_column)``."""

    table: str
    column: str
    ref_table: str
    ref_column: str


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]

    def column(self, name: str) -> Column:
        """Raises KeyError for a column the table lacks."""
        for col in self.columns:
            if col.name == name:
                return col
        raise KeyError(f"table {self.name!r} has no column {name!r}")


@dataclass(frozen=True, slots=True)
class Schema:
    """Tables in the database's order, their foreign keys, and the SQL dialect's name
    (``sqlite``, or SQLAlchemy's dialect name: ``postgresql``, ``mysql``...)."""

    tables: tuple[Table, ...]
    foreign_keys: tuple[ForeignKey, ...]
    dialect: str = "sqlite"

    def table(self, name: str) -> Table:
        """Raises KeyError for a table the schema lacks."""
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no table {name!r} (have: {', '.join(t.name for t in self.tables)})")

    def restricted(self, names: list[str] | tuple[str, ...]) -> Schema:
        """The schema with only the tables ``names`` and the foreign keys among them.

        Raises:
            KeyError: a name is not a table of the schema.
        """
        keep = [self.table(n) for n in names]
        kept = {t.name for t in keep}
        fks = tuple(fk for fk in self.foreign_keys if fk.table in kept and fk.ref_table in kept)
        return Schema(tuple(keep), fks, self.dialect)

    def describe(self) -> str:
        """The schema as ``CREATE TABLE`` statements (for a prompt): columns with their declared
        types and the foreign keys."""
        parts = []
        for table in self.tables:
            lines = [f"  {c.name} {c.declared_type}".rstrip() for c in table.columns]
            lines += [f"  FOREIGN KEY ({fk.column}) REFERENCES {fk.ref_table}({fk.ref_column})"
                      for fk in self.foreign_keys if fk.table == table.name]
            parts.append(f"CREATE TABLE {table.name} (\n" + ",\n".join(lines) + "\n);")
        return "\n".join(parts)


def value_kind(declared_type: str) -> ValueKind:
    """The kind of literal a column of ``declared_type`` takes: SQLite's affinity rules (an
    ``INT`` anywhere: integer; ``CHAR``/``CLOB``/``TEXT``: text; ``BLOB`` or none: blob;
    ``REAL``/``FLOA``/``DOUB``: real), with ``DATE``/``TIME`` types as dates and other
    NUMERIC types (``DECIMAL``, ``NUMERIC``, ``BOOLEAN``) as real."""
    t = declared_type.upper()
    if "INT" in t:
        return "integer"
    if "CHAR" in t or "CLOB" in t or "TEXT" in t:
        return "text"
    if "DATE" in t or "TIME" in t:
        return "date"
    if "BLOB" in t or not t:
        return "blob"
    return "real"


def read_schema(database: str | Path) -> Schema:
    """Read a database's schema.

    Args:
        database: a SQLite file path, or a SQLAlchemy URL (``postgresql://...``,
            ``sqlite:///file.db``: anything with ``://``).

    Returns:
        The schema: every table (SQLite's internal ``sqlite_*`` tables left out) and every
        declared foreign key whose referenced column is named (or is the referenced table's
        one-column primary key).

    Raises:
        FileNotFoundError: the SQLite file does not exist.
        ImportError: a URL was given and SQLAlchemy is not installed.
        sqlite3.DatabaseError: the file is not a SQLite database.
    """
    text = str(database)
    if "://" in text:
        from splitserve.lang.sql.sqlalchemy_schema import read_sqlalchemy_schema

        return read_sqlalchemy_schema(text)
    return read_sqlite_schema(Path(text))


def read_sqlite_schema(path: Path) -> Schema:
    """The schema of the SQLite file at ``path`` (opened read-only). See :func:`read_schema`."""
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite database at {path}")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY rowid")]
        tables, fks = [], []
        for name in names:
            info = conn.execute(f"PRAGMA table_info({_quote(name)})").fetchall()
            cols = tuple(Column(r[1], r[2] or "", value_kind(r[2] or "")) for r in info)
            tables.append(Table(name, cols))
            for row in conn.execute(f"PRAGMA foreign_key_list({_quote(name)})"):
                ref_table, column, ref_column = row[2], row[3], row[4]
                if ref_column is None:  # REFERENCES t with no column: t's primary key
                    ref_column = _primary_key(conn, ref_table)
                if ref_column is not None:
                    fks.append(ForeignKey(name, column, ref_table, ref_column))
    finally:
        conn.close()
    known = set(names)
    return Schema(tuple(tables), tuple(fk for fk in fks if fk.ref_table in known), "sqlite")


def _primary_key(conn: sqlite3.Connection, table: str) -> str | None:
    rows = [r for r in conn.execute(f"PRAGMA table_info({_quote(table)})") if r[5]]
    return rows[0][1] if len(rows) == 1 else None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
