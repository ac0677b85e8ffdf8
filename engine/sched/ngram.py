"""N-gram (prompt-lookup) drafts for speculative decoding: the tokens that followed the most
recent earlier occurrence of the sequence's last n tokens.

Prompt lookup (Saxena 2023, as vLLM's ``ngram`` proposer and llama.cpp's lookup decoding use it)
needs no draft model: code edits, JSON extraction and tool calls copy long spans of their prompt
or of their own earlier output, so the continuation of a repeated n-gram is often the next
tokens verbatim. The scheduler asks for drafts each decode step (:func:`draft_tokens`, from
``sched.scheduler.Scheduler``); the runner verifies them in one forward pass
(``runner.verify``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.engine.kv_pool import pages_for

if TYPE_CHECKING:  # request.py names NgramIndex in its annotations
    from splitserve.engine.kv_pool import PageAllocator
    from splitserve.engine.sched.request import Req


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


def draft_tokens(
    req: Req, num_draft: int, allocator: PageAllocator, page_size: int, num_running: int
) -> list[int]:
    """Draft tokens for a decoding ``req`` whose one missing token has its page.

    N-gram drafts (its :class:`NgramIndex`, made at its first call), capped so that the kept
    drafts and the token after them fit ``max_new_tokens``, and trimmed to the pages that are
    free without evicting or retracting anything (a draft is a bet; it never costs another
    request its pages). A constrained row's draft is cut where its grammar stops accepting it
    (its masks at every drafted position are filled by the runner). Rows scoring prompt
    logprobs, asking for ``top_logprobs``, penalties, ``logit_bias`` or ``min_tokens`` are not
    drafted.

    Args:
        req: the decoding request; gets the pages its draft needs appended to ``page_ids``.
        num_draft: most draft tokens per row (``--num-speculative-tokens``).
        allocator: the pool's allocator the draft's pages come from.
        page_size: tokens per page.
        num_running: running requests: a page of admission headroom each stays free.

    Returns: the draft token ids (``[]``: none; the row decodes plainly).
    """
    s = req.sampling
    # Penalties, biases and alternatives are per position of the output so far: those rows
    # decode plainly (runner.penalties reads the token lists of one position per step).
    if s.wants_prompt_logprobs or s.top_logprobs or s.has_penalties or s.min_tokens:
        return []
    room = req.sampling.max_new_tokens - len(req.output_ids) - 1
    if room <= 0:
        return []
    if req.ngrams is None:
        req.ngrams = NgramIndex()
    draft = req.ngrams.propose(req.tokens, req.seq_len, min(num_draft, room))
    if draft and req.grammar is not None:
        draft = draft[: req.grammar.accepted_prefix(draft)]
    if not draft:
        return []
    need = pages_for(req.seq_len + len(draft), page_size) - len(req.page_ids)
    if need > 0:
        # Leave the admission headroom (a page per running request) untouched.
        got = min(need, max(0, allocator.num_free - num_running))
        if got:
            req.page_ids.extend(allocator.alloc(got))
        draft = draft[: len(req.page_ids) * page_size - req.seq_len]
    return draft
