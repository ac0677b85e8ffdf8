"""A GBNF grammar for read-only SQL over one schema, in which only the tables and columns that
exist can be named, and only the columns of the tables a query reads.

A query's ``SELECT`` list comes before the ``FROM`` that says which tables it reads, so a
context-free grammar cannot check one against the other by remembering names. It enumerates
instead: one copy of the query rules per *scope* (a set of tables joined over declared foreign
keys, ``scopes.join_scopes``) and per way to qualify columns (by table name, or by each table's
alias, ``names.table_aliases``). Every copy starts with ``SELECT``; the grammar engine keeps all
copies alive while the select list is written and only the ones whose ``FROM`` matches survive
it: PICARD's effect (Scholak et al., 2021, constrained decoding for text-to-SQL), with the
grammar engine's matcher in place of an incremental parser.

The subset: ``SELECT [DISTINCT]`` columns, ``*``, ``t.*``, aggregates (``COUNT``, ``SUM``,
``AVG``, ``MIN``, ``MAX``, ``ROUND``), arithmetic, column aliases; ``FROM`` one table or
``JOIN``/``INNER JOIN``/``LEFT [OUTER] JOIN ... ON`` a declared foreign key, tables optionally
aliased; ``WHERE`` comparisons, ``AND``/``OR``/``NOT``, parentheses, ``IN (...)``, ``LIKE``,
``BETWEEN``, ``IS [NOT] NULL``, with literals typed by the column (integers for integer
columns, numbers for real ones, quoted strings for text, ``'YYYY-MM-DD'`` for dates);
``GROUP BY``, ``HAVING``, ``ORDER BY ... ASC|DESC``, ``LIMIT``/``OFFSET``; one statement, an
optional ``;``. Subqueries of one column, not correlated (each names the tables of its own
``FROM``): ``x [NOT] IN (SELECT ...)``, ``x > (SELECT ...)``. SQLite's
``strftime('%Y', date_column)`` where the dialect is SQLite. No DML, no DDL, no ``UNION``.
Column aliases cannot be referred to later (a grammar cannot remember an arbitrary name):
``ORDER BY`` repeats the expression, and never takes a result column's position (a grammar
cannot count the select list to keep it in range).
Lists are bounded (``MAX_ITEMS``...), so a model that starts repeating itself must finish.
"""

from __future__ import annotations

from collections.abc import Iterator

from splitserve.lang.sql.gbnf import Rules, alternatives, literal
from splitserve.lang.sql.names import alias_rules, quote_identifier, table_aliases
from splitserve.lang.sql.schema import ForeignKey, Schema
from splitserve.lang.sql.scopes import Scope, join_scopes

KINDS = ("integer", "real", "text", "date", "blob")
DATE_FORMATS = ("%Y", "%m", "%d", "%Y-%m", "%Y-%m-%d")
# Lengths a query may reach: a small model that starts repeating (``c.city, c.city, ...``) must
# move on to FROM while its max_tokens still leave room to finish the statement.
MAX_ITEMS = 10  # select list
MAX_TERMS = 8  # operands of one arithmetic expression; AND-ed / OR-ed conditions
MAX_KEYS = 4  # GROUP BY and ORDER BY keys, HAVING conditions
MAX_LIST = 20  # values of IN (...)


def schema_grammar(schema: Schema, max_joins: int = 3, aliases: bool = True) -> str:
    """The GBNF grammar of the SQL subset over ``schema``.

    Args:
        schema: the tables, columns and foreign keys that may be named.
        max_joins: at most this many ``JOIN``s in one query.
        aliases: also allow each table's alias (``FROM orders AS o`` / ``orders o``, columns
            then ``o.id``); its name is fixed per table (``names.table_aliases``).

    Returns:
        The grammar text (``root`` first), for the server's ``ebnf`` field.

    Raises:
        ValueError: the schema has no table, or too many join scopes (``scopes.MAX_SCOPES``).
    """
    if not schema.tables:
        raise ValueError("the schema has no table to query")
    rules = Rules()
    rules.add("root", "query \";\"?")
    _common_rules(rules)
    alias_of = table_aliases(t.name for t in schema.tables)
    queries, subqueries = [], []
    for i, scope in enumerate(join_scopes(schema, max_joins)):
        quote = {t: quote_identifier(t, schema.dialect) for t in scope.tables}
        modes = [("", quote)] + ([("a", {t: alias_of[t] for t in scope.tables})]
                                 if aliases else [])
        for tag, qualifier in modes:
            builder = _ScopeRules(rules, f"s{i}{tag}", schema, scope, qualifier, bool(tag))
            query, subquery = builder.build()
            queries.append(query)
            subqueries.append(subquery)
    rules.add("query", alternatives(queries))
    rules.add("subquery", alternatives(subqueries))
    return rules.text()


def _common_rules(rules: Rules) -> None:
    rules.add("br", '" " | "\\n"')
    rules.add("comma", '"," br?')
    rules.add("cmp", alternatives([literal(op) for op in ("=", "!=", "<>", "<=", ">=", "<", ">")]))
    rules.add("aop", alternatives([literal(op) for op in "+-*/"]))
    rules.add("int", '"-"? [0-9]{1,18}')
    rules.add("uint", "[0-9]{1,9}")
    rules.add("unum", '[0-9]{1,18} ("." [0-9]{1,12})?')
    rules.add("num", '"-"? unum')
    rules.add("str", "\"'\" ([^'\\n] | \"''\")* \"'\"")
    rules.add("date", "\"'\" [0-9]{4} \"-\" [0-9]{2} \"-\" [0-9]{2} "
                      "(\" \" [0-9]{2} \":\" [0-9]{2} (\":\" [0-9]{2})?)? \"'\"")
    rules.update(alias_rules("alias"))
    kw = rules.keyword
    rules.add("join", alternatives([kw("JOIN"), f'{kw("INNER")} " " {kw("JOIN")}',
                                    f'{kw("LEFT")} " " ({kw("OUTER")} " ")? {kw("JOIN")}']))


class _ScopeRules:
    """The query rules of one scope and qualifier mode, named ``<prefix>-...``."""

    def __init__(self, rules: Rules, prefix: str, schema: Schema, scope: Scope,
                 qualifier: dict[str, str], aliased: bool) -> None:
        self.rules, self.p, self.schema, self.scope = rules, prefix, schema, scope
        self.qualifier, self.aliased = qualifier, aliased
        self.kinds = {kind: self._column_rule(kind) for kind in KINDS}
        self.dates_fn = schema.dialect == "sqlite" and self.kinds["date"] is not None

    def name(self, part: str) -> str:
        return f"{self.p}-{part}"

    def ident(self, name: str) -> str:
        return quote_identifier(name, self.schema.dialect)

    def _refs(self, kind: str) -> Iterator[str]:
        """Every way to name each column of ``kind`` in scope: qualified, and bare where no
        other table in scope has a column of that name."""
        counts: dict[str, int] = {}
        for t in self.scope.tables:
            for col in self.schema.table(t).columns:
                counts[col.name] = counts.get(col.name, 0) + 1
        for t in self.scope.tables:
            for col in self.schema.table(t).columns:
                if col.kind == kind:
                    yield f"{self.qualifier[t]}.{self.ident(col.name)}"
                    if counts[col.name] == 1:
                        yield self.ident(col.name)

    def _column_rule(self, kind: str) -> str | None:
        refs = [literal(r) for r in self._refs(kind)]
        return self.rules.add(self.name(f"c{kind}"), alternatives(refs)) if refs else None

    def _union(self, part: str, kinds: tuple[str, ...], extra: tuple[str, ...] = ()
               ) -> str | None:
        items = [self.kinds[k] for k in kinds if self.kinds[k]] + list(extra)
        return self.rules.add(self.name(part), alternatives(items)) if items else None

    def build(self) -> tuple[str, str]:
        """Add every rule of the scope. Returns: the names of its query rule and of its
        one-column subquery rule (``IN (SELECT ...)``, ``> (SELECT ...)``)."""
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        self.col = self._union("col", KINDS)
        self.cnum = self._union("cnum", ("integer", "real"))
        dfun = self._date_function() if self.dates_fn else None
        self.cother = self._union("cother", ("text", "date", "blob"), (dfun,) if dfun else ())
        self._expressions()
        where = self._conditions()
        tail = (f'(br {kw("WHERE")} " " {where})? '
                f'(br {kw("GROUP")} " " {kw("BY")} " " {self._group_by()} '
                f'(br {kw("HAVING")} " " {self._having()})?)? '
                f'(br {kw("ORDER")} " " {kw("BY")} " " {self._order_by()})? '
                f'(br {kw("LIMIT")} " " uint (" " {kw("OFFSET")} " " uint)?)?')
        rest = add(n("rest"), f'br {kw("FROM")} " " {self._from()} {tail}')
        head = f'{kw("SELECT")} " " ({kw("DISTINCT")} " ")?'
        one = f'{head} {n("value")} (" " {kw("AS")} " " alias)? {rest}'
        return add(n("q"), f"{head} {self._select()} {rest}"), add(n("sub"), one)

    def _date_function(self) -> str:
        fmts = alternatives([literal(f) for f in DATE_FORMATS])
        return self.rules.add(self.name("dfun"), f'{self.rules.keyword("strftime")} '
                                                 f'"(\'" ({fmts}) "\', " {self.kinds["date"]} ")"')

    def _expressions(self) -> None:
        """Numeric expressions. Only the first term may carry a sign: after ``-`` a signed
        literal would make ``--``, which SQL reads as the start of a comment."""
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        terms = ([self.cnum] if self.cnum else []) + ["unum", f'"(" " "? {n("nexpr")} " "? ")"']
        add(n("nterm"), alternatives(terms))
        add(n("nexpr"), f'"-"? {n("nterm")} (" "? aop " "? {n("nterm")}){{0,{MAX_TERMS - 1}}}')
        add(n("arith"), f'{n("nterm")} (" "? aop " "? {n("nterm")})+')
        minmax = alternatives([n("nexpr")] + ([self.cother] if self.cother else []))
        add(n("agg"), alternatives([
            f'{kw("COUNT")} "(*)"',
            f'{kw("COUNT")} "(" ({kw("DISTINCT")} " ")? {self.col} ")"',
            f'({kw("SUM")} | {kw("AVG")}) "(" {n("nexpr")} ")"',
            f'({kw("MIN")} | {kw("MAX")}) "(" ({minmax}) ")"',
            f'{kw("ROUND")} "(" {n("gexpr")} ("," " "? uint)? ")"']))
        add(n("gterm"), alternatives([n("agg"), n("nterm")]))
        add(n("gexpr"), f'"-"? {n("gterm")} (" "? aop " "? {n("gterm")}){{0,{MAX_TERMS - 1}}}')
        add(n("value"), alternatives([n("gexpr")] + ([self.cother] if self.cother else [])))
        if self.kinds["text"]:
            text = self.kinds["text"]
            add(n("texpr"), f'{text} | ({kw("LOWER")} | {kw("UPPER")}) "(" {text} ")"')

    def _select(self) -> str:
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        stars = ['"*"'] + [literal(f"{self.qualifier[t]}.*") for t in self.scope.tables]
        item = f'{alternatives(stars)} | {n("value")} (" " {kw("AS")} " " alias)?'
        add(n("item"), item)
        return add(n("sel"), f'{n("item")} (comma {n("item")}){{0,{MAX_ITEMS - 1}}}')

    def _conditions(self) -> str:
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        neg = f'({kw("NOT")} " ")? '
        add(n("pred"), alternatives(self._predicates()))
        add(n("atom"), f'{neg}({n("pred")} | "(" " "? {n("cond")} " "? ")")')
        add(n("conj"), f'{n("atom")} (br {kw("AND")} br {n("atom")}){{0,{MAX_TERMS - 1}}}')
        more = f'(br {kw("OR")} br {n("conj")}){{0,{MAX_TERMS - 1}}}'
        return add(n("cond"), f'{n("conj")} {more}')

    def _predicates(self) -> list[str]:
        kw, n, k = self.rules.keyword, self.name, self.kinds
        neg = f'({kw("NOT")} " ")? '
        isin = f'{neg}{kw("IN")} " ("'
        between = f'{neg}{kw("BETWEEN")} " "'
        preds = [f'{n("arith")} " "? cmp " "? {n("nexpr")}',
                 f'{self.col} " " {isin} subquery ")"',
                 f'{n("nexpr")} " "? cmp " "? "(" subquery ")"',
                 f'{n("nexpr")} " " {between} {n("nexpr")} " " {kw("AND")} " " {n("nexpr")}',
                 f'{self.col} " " {kw("IS")} " " {neg}{kw("NULL")}']
        if k["integer"]:
            cnum = self.cnum
            preds += [f'{k["integer"]} " "? cmp " "? (int | {cnum})',
                      f'{k["integer"]} " " {isin} int (comma int){{0,{MAX_LIST - 1}}} ")"']
        if k["real"]:
            preds.append(f'{k["real"]} " "? cmp " "? (num | {self.cnum})')
        if k["text"]:
            preds += [f'{n("texpr")} " "? cmp " "? (str | {k["text"]})',
                      f'{n("texpr")} " " {isin} str (comma str){{0,{MAX_LIST - 1}}} ")"',
                      f'{n("texpr")} " " {neg}{kw("LIKE")} " " str']
        if k["date"]:
            preds += [f'{k["date"]} " "? cmp " "? (date | {k["date"]})',
                      f'{k["date"]} " " {between} date " " {kw("AND")} " " date',
                      f'{k["date"]} " " {neg}{kw("LIKE")} " " str']
        if k["blob"]:  # no declared type: SQLite compares whatever the value is
            preds.append(f'{k["blob"]} " "? cmp " "? (num | str | {k["blob"]})')
        if self.dates_fn:
            preds.append(f'{n("dfun")} " "? cmp " "? str')
        return preds

    def _group_by(self) -> str:
        items = [self.col] + ([self.name("dfun")] if self.dates_fn else [])
        self.rules.add(self.name("gitem"), alternatives(items))
        return self.rules.add(self.name("grp"), f'{self.name("gitem")} (comma '
                                                f'{self.name("gitem")}){{0,{MAX_KEYS - 1}}}')

    def _having(self) -> str:
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        add(n("hpred"), f'{n("gexpr")} " "? cmp " "? {n("gexpr")}')
        more = f'(br ({kw("AND")} | {kw("OR")}) br {n("hpred")}){{0,{MAX_KEYS - 1}}}'
        return add(n("hcond"), f'{n("hpred")} {more}')

    def _order_by(self) -> str:
        """``ORDER BY`` keys: expressions, never a bare integer (SQLite reads it as a result
        column's position, an error past the last: a grammar cannot count the select list)."""
        kw, add, n = self.rules.keyword, self.rules.add, self.name
        op = f'" "? aop " "? {n("gterm")}'
        first = [n("agg"), f'"(" " "? {n("nexpr")} " "? ")"'] + ([self.cnum] if self.cnum else [])
        keys = [f'({alternatives(first)}) ({op}){{0,{MAX_TERMS - 1}}}',
                f'num ({op}){{1,{MAX_TERMS - 1}}}'] + ([self.cother] if self.cother else [])
        add(n("oitem"), f'({alternatives(keys)}) (" " ({kw("ASC")} | {kw("DESC")}))?')
        return add(n("ord"), f'{n("oitem")} (comma {n("oitem")}){{0,{MAX_KEYS - 1}}}')

    def _from(self) -> str:
        """The ``FROM`` clause's text, to inline in the query rule: in a rule of its own,
        GBNF-to-Lark conversion (llguidance) would make ``orders o`` one greedy lexeme, which
        then swallows the space of ``orders WHERE``."""
        kw = self.rules.keyword
        tables = {t: self._table(t) for t in self.scope.tables}
        orders = []
        for first, steps in self.scope.orders:
            parts = [tables[first]]
            for step in steps:
                on = alternatives([self._on(fk) for fk in step.on])
                parts.append(f'br join " " {tables[step.table]} " " {kw("ON")} " " ({on})')
            orders.append(" ".join(parts))
        return f"({alternatives(orders)})"

    def _table(self, table: str) -> str:
        name = literal(self.ident(table))
        if not self.aliased:
            return name
        return f'{name} " " ({self.rules.keyword("AS")} " ")? {literal(self.qualifier[table])}'

    def _on(self, fk: ForeignKey) -> str:
        """The rule for ``ON`` over ``fk``, either side first (shared by every scope of this
        qualifier mode: one lexeme, as nothing else may follow ``ON``)."""
        index = self.schema.foreign_keys.index(fk)
        a = literal(f"{self.qualifier[fk.table]}.{self.ident(fk.column)}")
        b = literal(f"{self.qualifier[fk.ref_table]}.{self.ident(fk.ref_column)}")
        return self.rules.add(f"on{index}{'a' if self.aliased else ''}",
                              f'{a} " "? "=" " "? {b} | {b} " "? "=" " "? {a}')
