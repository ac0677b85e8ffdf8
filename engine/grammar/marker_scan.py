"""Where a marker (``</think>``) ends in a stream of tokens, found at the byte level.

A model may spell a marker in one token (Qwen3's ``</think>`` is one) or several (``</``,
``think``, ``>`` in a byte-level BPE that does not know it), so the think-first grammar
(``engine.grammar.think``) follows the text the tokens spell, one token at a time, with the
Knuth-Morris-Pratt automaton of the marker: its state is how much of the marker the text ends
with. A token that would complete the marker *before its own last byte* (``>\\n`` after
``</think``) is refused while thinking: then the marker always ends on a token boundary, and the
answer's grammar starts exactly at the next token.

Reference: Knuth, Morris, Pratt, "Fast pattern matching in strings" (SIAM J. Comput., 1977).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitserve.engine.grammar.bitmask import bitmask_width
from splitserve.engine.grammar.vocab import token_bytes


def vocab_text(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Every token id's bytes as the model writes them: text tokens as ``vocab.token_bytes``
    decodes them, special and added tokens as their content (a marker may be one), None for
    ids the tokenizer does not have."""
    out = token_bytes(tokenizer, vocab_size)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token_id < vocab_size and out[token_id] is None:
            out[token_id] = added.content.encode()
    return out


class MarkerScan:
    """The marker's automaton over one vocabulary.

    Args:
        marker: the marker's text (``</think>``); not empty.
        vocab: per token id its bytes (:func:`vocab_text`); None counts as no text.

    Raises:
        ValueError: an empty marker.
    """

    def __init__(self, marker: str, vocab: list[bytes | None]) -> None:
        if not marker:
            raise ValueError("a marker cannot be empty")
        self.marker = marker.encode()
        self.length = len(self.marker)
        self.vocab = vocab
        self.width = bitmask_width(len(vocab))
        self._failure = _failure_table(self.marker)
        last = self.marker[-1:]
        # Only tokens holding the marker's last byte can complete it.
        candidates = [i for i, b in enumerate(vocab) if b is not None and last in b]
        self._inside: list[frozenset[int]] = [
            frozenset(i for i in candidates if self._completes_inside(state, vocab[i]))
            for state in range(self.length)
        ]
        self._rows: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def advance(self, state: int, token_id: int) -> int:
        """The state after ``token_id``'s bytes (``length``: the marker ended with them)."""
        data = self.vocab[token_id] if 0 <= token_id < len(self.vocab) else None
        for byte in data or b"":
            state = self._step(state, byte)
            if state == self.length:
                return state
        return state

    def completes_inside(self, state: int) -> frozenset[int]:
        """The tokens that, from ``state``, would complete the marker before their last byte."""
        return self._inside[state]

    def thinking_row(self, state: int, refused: tuple[int, ...]) -> torch.Tensor:
        """The bitmask row (int32 ``[width]``) of the tokens allowed while thinking in
        ``state``: every token but :meth:`completes_inside` and ``refused`` (the stop tokens,
        where the answer may not end inside its thinking). Cached; do not modify."""
        key = (state, refused)
        row = self._rows.get(key)
        if row is None:
            words = np.full(self.width, -1, dtype=np.int64) & 0xFFFFFFFF
            for token_id in (*self._inside[state], *refused):
                if 0 <= token_id < len(self.vocab):
                    words[token_id // 32] &= ~(1 << (token_id % 32)) & 0xFFFFFFFF
            row = torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())
            self._rows[key] = row
        return row

    def _step(self, state: int, byte: int) -> int:
        if state == self.length:
            state = self._failure[state - 1]
        while state and self.marker[state] != byte:
            state = self._failure[state - 1]
        return state + 1 if self.marker[state] == byte else 0

    def _completes_inside(self, state: int, data: bytes | None) -> bool:
        for n, byte in enumerate(data or b""):
            state = self._step(state, byte)
            if state == self.length:
                return n < len(data) - 1  # type: ignore[arg-type]
        return False


def _failure_table(pattern: bytes) -> list[int]:
    """KMP's failure function: ``f[i]`` is the length of the longest proper prefix of
    ``pattern[: i + 1]`` that is also its suffix."""
    f = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = f[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        f[i] = k
    return f
