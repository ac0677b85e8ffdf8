"""A lower bound on a text's token count from its length in bytes, so that a prompt far over
the context is refused before it is tokenized (tokenizing 4 MB takes seconds of CPU).

The bound: a token of the model's tokenizer never covers more than ``max_bytes_per_token``
bytes of the text it was given, so a text of ``b`` bytes has at least ``ceil(b /
max_bytes_per_token)`` tokens (special tokens added around it only add more). It holds when
nothing in the tokenizer can consume input without a token for it, which is checked on the
tokenizer's own definition (its ``tokenizer.json``), step by step:

- **added tokens** match the raw text: each covers its content's bytes; one with ``lstrip`` or
  ``rstrip`` also eats the whitespace around it, as much as there is: no bound.
- **normalizer**: it may shrink the text before the model sees it. Unicode normalization shrinks
  by at most the factor in :data:`SHRINK` (NFD: a character's decomposition is at least 1/3 of
  its UTF-8 length, U+212A KELVIN SIGN -> ``K``; NFC: a text and its NFC form have the same NFD,
  so 3 x 3; NFKD, NFKC likewise with 4 and 11; ``tests/server/test_prompt_bound.py`` recomputes
  them from ``unicodedata``), lowercasing by 3 (KELVIN SIGN -> ``k``), a ``Replace`` of a
  literal by its length over the replacement's; ``Prepend`` only adds. Anything else
  (``Strip``, ``StripAccents``, a regex ``Replace``, sentencepiece's ``Precompiled`` map, BERT's
  cleaning) may delete characters: no bound.
- **pre-tokenizer**: ``ByteLevel`` maps each byte to one character, so a token covers as many
  bytes as it has characters; ``Metaspace``, ``Digits``, ``UnicodeScripts``, ``Split`` and
  ``Punctuation`` (unless their behaviour is ``removed``) only split or expand. Those that drop
  whitespace or delimiters (``Whitespace``, ``BertPreTokenizer``, ``CharDelimiterSplit``): no
  bound.
- **model**: BPE or Unigram with byte fallback has a token for every byte; behind ``ByteLevel``
  it has one for every byte whose character is in its vocabulary, and the others are dropped
  without a token (SmolLM2's vocabulary lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, ...: ``"a\x06b"``
  is the tokens of ``"a"`` and ``"b"``), so those bytes are not counted (:attr:`PromptBound.dropped`,
  :meth:`PromptBound.counted_bytes`). Otherwise unknown characters become one ``unk`` token
  however many there are (fused), or nothing: no bound. WordPiece and WordLevel map a whole word
  to ``unk``: no bound.

Where there is no bound, nothing is refused early (the count after tokenizing still is).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# The largest factor by which each Unicode normalization form can shrink a text's UTF-8 length
# (the module docstring says why; the test recomputes them).
SHRINK = {"NFD": 3.0, "NFKD": 4.0, "NFC": 9.0, "NFKC": 44.0, "Lowercase": 3.0}
_SPLITTERS = {"Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "ByteLevel"}


@dataclass(frozen=True, slots=True)
class PromptBound:
    """``max_bytes_per_token``: the most input bytes one token may cover (None: no bound,
    ``why`` says which part of the tokenizer prevents one); ``dropped``: the byte values the
    tokenizer drops without a token (not counted)."""

    max_bytes_per_token: float | None
    why: str = ""
    dropped: bytes = b""

    def counted_bytes(self, data: bytes) -> int:
        """The bytes of ``data`` that :meth:`min_tokens` may count: all but the dropped ones
        (one C pass over ``data``)."""
        return len(data.translate(None, self.dropped)) if self.dropped else len(data)

    def min_tokens(self, num_bytes: int) -> int:
        """The fewest tokens a text of ``num_bytes`` UTF-8 bytes can have (0 without a bound)."""
        if self.max_bytes_per_token is None:
            return 0
        return math.ceil(num_bytes / self.max_bytes_per_token)


def prompt_bound(tokenizer: Any) -> PromptBound:
    """The bound for a Hugging Face fast tokenizer (``tokenizer.backend_tokenizer``); a slow
    tokenizer, or one whose definition cannot be read, has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return PromptBound(None, "not a fast tokenizer")
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError) as exc:
        return PromptBound(None, f"tokenizer definition unreadable: {exc}")
    return bound_from_spec(spec)


def bound_from_spec(spec: dict[str, Any]) -> PromptBound:
    """The bound for a ``tokenizer.json`` document (the module docstring's rules)."""
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip"):
            return PromptBound(None, f"added token {added.get('content')!r} strips whitespace")
    shrink, why = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return PromptBound(None, why)
    pre = spec.get("pre_tokenizer")
    problem = _pre_tokenizer_problem(pre)
    if problem:
        return PromptBound(None, problem)
    byte_level = _has(pre, "ByteLevel")
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return PromptBound(None, f"{kind} model maps unknown words to one token")
    if not (byte_level or model.get("byte_fallback")):
        return PromptBound(None, f"{kind} model without byte fallback: unknown text becomes "
                           "one unk token, or none")
    tokens = _vocab_strings(model)
    dropped = b""
    if byte_level and not model.get("byte_fallback"):
        vocab = set(tokens)
        dropped = bytes(b for b, c in enumerate(_byte_level_chars()) if c not in vocab)
    # ByteLevel: one character per input byte; otherwise a token's UTF-8 length bounds the
    # normalized bytes it covers (Metaspace's 3-byte "▁" stands for a 1-byte space: looser).
    longest = max((len(t) if byte_level else len(t.encode()) for t in tokens), default=1)
    added = max((len(a.get("content", "").encode()) for a in spec.get("added_tokens") or ()),
                default=0)
    return PromptBound(max(longest * shrink, added, 1.0), dropped=dropped)


def _byte_level_chars() -> list[str]:
    """The character ``ByteLevel`` maps each byte value to (GPT-2's table: printable Latin-1
    bytes stand for themselves, the others for U+0100 on, in byte order)."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


def _normalizer_shrink(node: dict[str, Any] | None) -> tuple[float | None, str]:
    if node is None:
        return 1.0, ""
    kind = node.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in node.get("normalizers") or ():
            shrink, why = _normalizer_shrink(part)
            if shrink is None:
                return None, why
            total *= shrink
        return total, ""
    if kind in SHRINK:
        return SHRINK[kind], ""
    if kind == "Prepend":
        return 1.0, ""
    if kind == "Replace":
        pattern, content = node.get("pattern") or {}, node.get("content", "")
        literal = pattern.get("String")
        if literal is None or not content:
            return None, "normalizer Replace may delete text"
        return max(1.0, len(literal.encode()) / len(content.encode())), ""
    return None, f"normalizer {kind} may delete text"


def _pre_tokenizer_problem(node: dict[str, Any] | None) -> str:
    if node is None:
        return ""
    kind = node.get("type")
    if kind == "Sequence":
        return next((p for p in map(_pre_tokenizer_problem, node.get("pretokenizers") or ())
                     if p), "")
    if kind not in _SPLITTERS:
        return f"pre-tokenizer {kind} may drop text"
    if str(node.get("behavior", "")).lower() == "removed":
        return f"pre-tokenizer {kind} removes its delimiters"
    return ""


def _has(node: dict[str, Any] | None, kind: str) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has(p, kind) for p in node.get("pretokenizers") or ())
    return node.get("type") == kind


def _vocab_strings(model: dict[str, Any]) -> list[str]:
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        return list(vocab)
    return [entry[0] for entry in vocab]  # Unigram: [[piece, score], ...]
