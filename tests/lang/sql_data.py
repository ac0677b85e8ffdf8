"""The text-to-SQL data set (tests/data/text_to_sql, CC0): the shop database, built from its
SQL script, and the questions with their reference queries."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from tests.conftest import DATA

TEXT_TO_SQL = DATA / "text_to_sql"


def build_shop(path: Path) -> Path:
    """Create the shop database at ``path`` from ``shop.sql``. Returns: ``path``."""
    conn = sqlite3.connect(path)
    try:
        conn.executescript((TEXT_TO_SQL / "shop.sql").read_text())
        conn.commit()
    finally:
        conn.close()
    return path


def questions() -> list[dict[str, Any]]:
    """``[{id, question, sql}]``."""
    return json.loads((TEXT_TO_SQL / "questions.json").read_text())["questions"]
