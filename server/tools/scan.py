"""Scanning helpers the tool-call parsers share: markers held back while partial, literals after
whitespace, and where a JSON value ends, a chunk at a time."""

from __future__ import annotations

from dataclasses import dataclass

WS = " \t\r\n"
NEED, MISMATCH = -1, -2  # scan results besides "matched up to index i"


@dataclass(slots=True)
class ValueScanner:
    """Finds where one JSON value ends, a chunk at a time (strings, escapes, nesting)."""

    depth: int = 0
    started: bool = False
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False

    def feed(self, text: str) -> tuple[int, bool]:
        """``(characters of text that belong to the value, whether the value is complete)``."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch in WS:
                    continue
                self.started = True
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth = 1
                else:
                    self.scalar = True
                continue
            if self.scalar:
                if ch in WS + ",}]":
                    return i, True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, True
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


def first_trigger(buf: str, triggers: list[str]) -> tuple[int, str]:
    """The earliest position of any trigger in ``buf`` and which one (-1 if none)."""
    best, which = -1, ""
    for t in triggers:
        at = buf.find(t)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, t
    return best, which


def partial_suffix(buf: str, triggers: list[str]) -> int:
    """Length of the longest end of ``buf`` that a trigger starts with."""
    best = 0
    for t in triggers:
        for n in range(min(len(t) - 1, len(buf)), best, -1):
            if buf.endswith(t[:n]):
                best = n
                break
    return best


def skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in WS:
        i += 1
    return i


def match_literal(buf: str, i: int, literal: str) -> int:
    """After optional whitespace, ``literal`` at ``buf[i:]``: the index after it, or NEED /
    MISMATCH."""
    i = skip_ws(buf, i)
    avail = buf[i: i + len(literal)]
    if not literal.startswith(avail):
        return MISMATCH
    if len(avail) < len(literal):
        return NEED
    return i + len(literal)
