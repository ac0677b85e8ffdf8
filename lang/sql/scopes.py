"""The table sets a query may read (its scope) and the orders in which ``FROM ... JOIN ... ON``
can name them: every table alone, and every set of up to ``max_joins + 1`` tables connected by
declared foreign keys, each joined table linked to one named before it."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.lang.sql.schema import ForeignKey, Schema

MAX_SCOPES = 2000  # a larger grammar would not compile within the grammar layer's budget


@dataclass(frozen=True, slots=True)
class JoinStep:
    """``JOIN table ON <one of on>``: each foreign key links ``table`` to an earlier one."""

    table: str
    on: tuple[ForeignKey, ...]


@dataclass(frozen=True, slots=True)
class Scope:
    """A set of tables (in schema order) and every way to write its ``FROM`` clause: the
    first table, then its join steps."""

    tables: tuple[str, ...]
    orders: tuple[tuple[str, tuple[JoinStep, ...]], ...]


def join_scopes(schema: Schema, max_joins: int) -> list[Scope]:
    """Every scope with at most ``max_joins`` joins, single tables first, in schema order.

    Raises:
        ValueError: ``max_joins`` is negative, or the schema has more than ``MAX_SCOPES``
            scopes (restrict ``tables`` or lower ``max_joins``).
    """
    if max_joins < 0:
        raise ValueError(f"max_joins must be >= 0, got {max_joins}")
    position = {t.name: i for i, t in enumerate(schema.tables)}
    by_set: dict[frozenset[str], list[tuple[str, tuple[JoinStep, ...]]]] = {}
    frontier = [(t.name, ()) for t in schema.tables]
    for depth in range(max_joins + 1):
        for first, steps in frontier:
            by_set.setdefault(frozenset([first, *(s.table for s in steps)]), []).append(
                (first, steps))
        if len(by_set) > MAX_SCOPES:
            raise ValueError(f"the schema has more than {MAX_SCOPES} join scopes with "
                             f"max_joins={max_joins}: pass tables=[...] or a lower max_joins")
        if depth < max_joins:
            frontier = [(first, (*steps, step)) for first, steps in frontier
                        for step in _next_steps(schema, [first, *(s.table for s in steps)])]
    scopes = [Scope(tuple(sorted(names, key=position.__getitem__)), tuple(orders))
              for names, orders in by_set.items()]
    return sorted(scopes, key=lambda s: (len(s.tables), [position[t] for t in s.tables]))


def _next_steps(schema: Schema, named: list[str]) -> list[JoinStep]:
    """The tables not yet named that a foreign key links to a named one."""
    steps = []
    for table in schema.tables:
        if table.name in named:
            continue
        on = tuple(fk for fk in schema.foreign_keys
                   if (fk.table == table.name and fk.ref_table in named)
                   or (fk.ref_table == table.name and fk.table in named))
        if on:
            steps.append(JoinStep(table.name, on))
    return steps
