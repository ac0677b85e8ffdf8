"""Run a model's SQL against a SQLite file, read-only: the file is opened read-only and an
authorizer (``sqlite3.Connection.set_authorizer``) lets a statement only read, so whatever the
text says (with or without a grammar) it cannot change the database."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What a read-only statement may ask the authorizer for (sqlite3 action codes).
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}


@dataclass(slots=True)
class QueryResult:
    """What running one statement gave: the result columns and rows (``rows`` is None when it
    failed), the error text otherwise, and every ``(table, column)`` the statement read (from
    the authorizer, so only names SQLite resolved)."""

    columns: list[str] = field(default_factory=list)
    rows: list[tuple[Any, ...]] | None = None
    error: str | None = None
    columns_read: set[tuple[str, str]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.error is None


def connect_read_only(database: str | Path) -> sqlite3.Connection:
    """A connection to the SQLite file that can only read.

    Raises:
        FileNotFoundError: no file there. ValueError: ``database`` is a URL (only SQLite files
        are run here; read a schema from a URL with ``read_schema``).
    """
    if "://" in str(database):
        raise ValueError("run_query runs SQLite files only; pass the file's path")
    path = Path(database)
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite database at {path}")
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                           check_same_thread=False)


def run_query(database: str | Path, sql: str, *, explain_only: bool = False,
              max_rows: int = 10_000, timeout_s: float = 10.0) -> QueryResult:
    """Run one read-only statement.

    Args:
        database: the SQLite file.
        sql: the statement (a trailing ``;`` is fine; two statements are an error).
        explain_only: only prepare it (``EXPLAIN``): it parses and names what exists.
        max_rows: keep at most this many rows.
        timeout_s: stop a statement that runs longer (an error).

    Returns:
        The result; a statement that fails to parse, names something missing, writes, or
        times out has ``error`` set (never raised).

    Raises:
        FileNotFoundError, ValueError: as :func:`connect_read_only`.
    """
    conn = connect_read_only(database)
    result = QueryResult()
    deadline = time.monotonic() + timeout_s

    def authorize(action: int, arg1: Any, arg2: Any, *_: Any) -> int:
        if action == sqlite3.SQLITE_READ and arg1 is not None and arg2:
            result.columns_read.add((arg1, arg2))
        return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY

    conn.set_authorizer(authorize)
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        cursor = conn.execute(("EXPLAIN " if explain_only else "") + sql)
        if not explain_only:
            result.columns = [d[0] for d in cursor.description or []]
            result.rows = cursor.fetchmany(max_rows)
    except (sqlite3.Error, sqlite3.Warning) as exc:  # Warning: more than one statement
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return result
