"""Stop strings: cut the output before the first occurrence of any of them.

While streaming, text that could be the start of a stop string is held back until the next piece
shows whether it is one, so a partial stop string never reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters the text of one request, piece by piece.

    After a match ``stopped`` is True, ``matched`` is the stop string found, and the matcher
    emits nothing more; the caller then aborts the request in the engine and reports finish
    reason ``"stop"``.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        # An empty stop string would match at once and end every request; ignore it.
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the part of ``held + text`` that is safe to emit now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The request ended without a match: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string.

        Everything before that suffix can never be part of a match, so it can be emitted."""
        for k in range(min(len(buf), self._max_held), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
