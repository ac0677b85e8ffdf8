"""N-gram (prompt-lookup) drafts for speculative decoding: the tokens that followed the most
recent earlier occurrence of the sequence's last n tokens.

Prompt lookup (Saxena 2023, as vLLM's ``ngram`` proposer and llama.cpp's lookup decoding use it)
needs no draft model: code edits, JSON extraction and tool calls copy long spans of their prompt
or of their own earlier output, so the continuation of a repeated n-gram is often the next
tokens verbatim. The scheduler asks for drafts each decode step
(``sched.scheduler.Scheduler``); the runner verifies them in one forward pass
(``runner.verify``).
"""

from __future__ import annotations

from collections.abc import Callable


class NgramIndex:
    """For each n in ``[min_n, max_n]``: n-gram -> the position right after its latest occurrence
    that has a following token, kept up to date as the sequence grows.

    Indexing is incremental (each call indexes only the tokens added since the last one:
    ``max_n - min_n + 1`` dict stores per token), so a draft costs O(new tokens), not O(length).

    Args:
        max_n: longest n-gram matched; longer matches are tried first (they predict better).
        min_n: shortest n-gram matched.

    Raises:
        ValueError: ``1 <= min_n <= max_n`` does not hold.
    """

    __slots__ = ("_follow", "_indexed", "max_n", "min_n")

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._indexed = 0  # positions j < this are indexed (as "the position after an n-gram")

    def propose(self, tokens: Callable[[int, int], list[int]], length: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow a sequence of ``length`` tokens.

        Args:
            tokens: ``tokens(start, end)`` returns the sequence's token ids ``[start, end)``
                (``Req.tokens``); the sequence only ever grows between calls.
            length: the sequence's current length.
            k: most draft tokens wanted (``<= 0``: none).

        Returns:
            The tokens after the latest earlier occurrence of the longest matching suffix n-gram
            (fewer than ``k`` when that occurrence is near the end), or ``[]`` if none matches.
        """
        self._index(tokens, length)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._follow[n - self.min_n].get(tuple(tokens(length - n, length)))
            if start is not None:
                return tokens(start, min(start + k, length))
        return []

    def _index(self, tokens: Callable[[int, int], list[int]], length: int) -> None:
        # Position j (with a token at j, so j < length) follows the n-gram [j - n, j). The
        # suffix n-gram itself ends at ``length`` and is never indexed: a match is an earlier one.
        lo = max(self._indexed, self.min_n)
        if lo >= length:
            return
        window = tokens(max(0, lo - self.max_n), length)
        base = max(0, lo - self.max_n)
        for j in range(lo, length):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._follow[n - self.min_n][tuple(window[j - n - base : j - base])] = j
        self._indexed = length
