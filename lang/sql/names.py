"""Names in the SQL a grammar allows: quoted identifiers, each table's short alias, and the
column aliases (``AS total``) that may be any identifier but a reserved word."""

from __future__ import annotations

import re
from collections.abc import Iterable


def _words(text: str) -> list[str]:
    return text.split()


# SQLite's keywords (https://sqlite.org/lang_keywords.html): a table or column of one of these
# names is always written quoted.
SQLITE_KEYWORDS = frozenset(_words("""
abort action add after all alter always analyze and as asc attach autoincrement before begin
between by cascade case cast check collate column commit conflict constraint create cross current
current_date current_time current_timestamp database default deferrable deferred delete desc
detach distinct do drop each else end escape except exclude exclusive exists explain fail filter
first following for foreign from full generated glob group groups having if ignore immediate in
index indexed initially inner insert instead intersect into is isnull join key last left like
limit match materialized natural no not nothing notnull null nulls of offset on or order others
outer over partition plan pragma preceding primary query raise range recursive references regexp
reindex release rename replace restrict returning right rollback row rows savepoint select set
table temp temporary then ties to transaction trigger unbounded union unique update using vacuum
values view virtual when where window with without"""))

# The keywords SQLite refuses as a column alias (``SELECT x AS <word> FROM t`` fails to parse;
# tests/lang/test_sql_names.py re-derives this set from SQLite itself).
ALIAS_RESERVED = frozenset(_words("""
add all alter and as autoincrement between case check collate commit constraint create default
deferrable delete distinct drop else escape except exists foreign from group having in index
insert intersect into is isnull join limit not nothing notnull null on or order primary
references returning select set table then to transaction union unique update using values when
where"""))

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ALIAS_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


def quote_identifier(name: str, dialect: str = "sqlite") -> str:
    """``name`` as the SQL text that names it: bare when it is a plain identifier and no
    keyword, else quoted (backticks for MySQL/MariaDB, double quotes elsewhere)."""
    if _PLAIN.match(name) and name.lower() not in SQLITE_KEYWORDS:
        return name
    if dialect in ("mysql", "mariadb"):
        return "`" + name.replace("`", "``") + "`"
    return '"' + name.replace('"', '""') + '"'


def table_aliases(tables: Iterable[str]) -> dict[str, str]:
    """A short alias per table, unique and never a keyword: the initials of its ``_``-separated
    words (``order_items`` -> ``oi``), else a longer prefix of its name (``categories`` ->
    ``ca`` when ``c`` is taken), else initials and a number."""
    aliases: dict[str, str] = {}
    for table in tables:
        words = [w for w in re.split(r"[^A-Za-z0-9]+", table) if w] or ["t"]
        initials = "".join(w[0] for w in words).lower()
        plain = re.sub(r"[^A-Za-z0-9]", "", table).lower() or "t"
        candidates = [initials] + [plain[:k] for k in range(2, len(plain) + 1)]
        candidates += [f"{initials}{i}" for i in range(2, 1000)]
        aliases[table] = next(c for c in candidates if c[0].isalpha() and c not in
                              SQLITE_KEYWORDS and c not in aliases.values())
    return aliases


def char_class(chars: Iterable[str]) -> str:
    """A GBNF character class holding exactly ``chars``: ``[0-9A-Z_]``."""
    codes = sorted({ord(c) for c in chars})
    runs: list[tuple[int, int]] = []
    for code in codes:
        if runs and runs[-1][1] == code - 1:
            runs[-1] = (runs[-1][0], code)
        else:
            runs.append((code, code))
    parts = [chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in runs]
    return "[" + "".join(parts) + "]"


def alias_rules(name: str, reserved: Iterable[str] = ALIAS_RESERVED) -> dict[str, str]:
    """GBNF rules for a column alias: a lower-case identifier (``[a-z_][a-z0-9_]*``) that is
    none of ``reserved``. A context-free grammar cannot say "not these words" directly; the
    rules walk a trie of the reserved words, where leaving the trie at any point frees the rest
    and a word may end only at a node that is not a reserved word.

    Returns:
        rule name -> body; ``name`` is the start rule.
    """
    words = sorted({w.lower() for w in reserved})
    prefixes = sorted({w[:i] for w in words for i in range(len(w) + 1)})
    rule = {p: name if not p else f"{name}-{i}" for i, p in enumerate(prefixes)}
    tail = f"{name}-tail"
    rules = {tail: f"{char_class(_ALIAS_CHARS)}*"}
    for prefix in prefixes:
        nexts = sorted({w[len(prefix)] for w in words if w.startswith(prefix) and w != prefix})
        allowed = _ALIAS_CHARS if prefix else _ALIAS_CHARS.replace("0123456789", "")
        free = [c for c in allowed if c not in nexts]
        alts = [f"{char_class(free)} {tail}"] + [f'"{c}" {rule[prefix + c]}' for c in nexts]
        body = " | ".join(alts)
        rules[rule[prefix]] = body if (not prefix or prefix in words) else f"({body})?"
    return rules
