"""A GBNF grammar under construction: named rules in order, literals escaped, keywords in
either case (the syntax llama.cpp's grammars/README.md defines; rule names use letters, digits
and ``-`` only, as llama.cpp requires)."""

from __future__ import annotations


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def alternatives(items: list[str]) -> str:
    """``a | b | c``, each item a GBNF expression."""
    return " | ".join(items)


class Rules:
    """Rules by name, written out in the order they were first added."""

    def __init__(self) -> None:
        self._rules: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        """Define ``name ::= body`` (again: the same body only). Returns: ``name``.

        Raises:
            ValueError: ``name`` is already defined with another body.
        """
        if self._rules.setdefault(name, body) != body:
            raise ValueError(f"rule {name} defined twice")
        return name

    def update(self, rules: dict[str, str]) -> None:
        for name, body in rules.items():
            self.add(name, body)

    def keyword(self, word: str) -> str:
        """The rule for SQL keyword ``word`` written in upper or lower case (``kw-group-by``
        for ``GROUP BY``). Returns: its name."""
        name = "kw-" + word.lower().replace(" ", "-")
        return self.add(name, f"{literal(word.upper())} | {literal(word.lower())}")

    def __contains__(self, name: str) -> bool:
        return name in self._rules

    def __len__(self) -> int:
        return len(self._rules)

    def text(self) -> str:
        """The grammar, one rule per line, starting with ``root``."""
        order = ["root"] + [n for n in self._rules if n != "root"]
        return "".join(f"{name} ::= {self._rules[name]}\n" for name in order)
