"""Incremental detokenization: token ids in, text pieces out, safe for multi-byte characters.

Byte-level BPE splits one character (emoji, CJK) over several tokens; decoding a prefix of them
gives "\\ufffd". The prefix/read-offset technique (as in vLLM and TGI) decodes only a short window
of recent tokens and emits the window's new suffix once it no longer ends in "\\ufffd". The window
starts at the last point where the text was known complete, so each step costs O(window), not
O(output), and the pieces concatenate to ``tokenizer.decode(all_ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns the token ids of one request, pushed in order, into text pieces.

    ``prefix_offset`` is where the decode window starts, ``read_offset`` where the text already
    emitted ends (in tokens). Decoding the window twice (``[prefix, read)`` and ``[prefix, end)``)
    rather than the new ids alone keeps decoders that depend on context (SentencePiece's leading
    space, byte-level merges across token borders) correct.

    ``keep_tokens``: special token ids to write as the given text although special tokens are
    skipped (a tool-call marker such as Mistral's ``[TOOL_CALLS]``, which the tool parser must
    see); the text on either side of one is decoded apart.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 keep_tokens: Mapping[int, str] | None = None) -> None:
        # The Rust backend's decode skips the Python wrapper's overhead (about 3x faster).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        raw: Callable[[Sequence[int]], str]
        if backend is not None:
            raw = lambda ids: backend.decode(
                list(ids), skip_special_tokens=skip_special_tokens
            )
        else:
            raw = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens
            )
        self._decode: Callable[[Sequence[int]], str] = raw
        if keep_tokens:
            self._decode = lambda ids: _decode_keeping(raw, ids, keep_tokens)
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ``token_ids``; return the text that became complete (maybe ``""``)."""
        self.token_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self, cut: bool = False) -> str:
        """Return whatever is still held back, as the full decode would show it (an unfinished
        character decodes as "\\ufffd"). Call once, when the request ends.

        Args:
            cut: the output was cut (``max_tokens``): an unfinished character at its end is
                dropped rather than shown as "\\ufffd" (its bytes are a fragment, not text).
        """
        return self._emit(final=True, cut=cut)

    def _emit(self, final: bool, cut: bool = False) -> str:
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        # Hold back while the window ends inside a character; more bytes may complete it.
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        if cut:
            new_text = new_text.rstrip(_REPLACEMENT)
        return new_text[len(prefix_text) :]


def _decode_keeping(raw: Callable[[Sequence[int]], str], ids: Sequence[int],
                    keep: Mapping[int, str]) -> str:
    """``raw(ids)``, but each id of ``keep`` written as its text (the runs between decoded
    apart)."""
    parts, start = [], 0
    for i, tok in enumerate(ids):
        if tok in keep:
            parts += [raw(ids[start:i]), keep[tok]]
            start = i + 1
    if start == 0:
        return raw(ids)
    parts.append(raw(ids[start:]))
    return "".join(parts)
