"""Token id -> raw bytes for a Hugging Face tokenizer (what a byte-level matcher needs).

xgrammar does this itself (``TokenizerInfo.from_huggingface``); outlines-core needs the map built
for it, because its ``Vocabulary.from_pretrained`` downloads from the Hub, which a serving machine
may not reach.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, reversed (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Decode every token id to the bytes it stands for.

    Args:
        tokenizer: a Hugging Face tokenizer (byte-level BPE such as GPT-2/SmolLM, or SentencePiece
            with ``▁`` for spaces and ``<0xHH>`` byte tokens).
        vocab_size: the model's vocabulary size (logits width); ids past the tokenizer's are None.

    Returns:
        ``result[i]`` is token ``i``'s bytes, or None for special tokens and unused ids (a grammar
        never produces those as text). Added tokens not marked special are their text.
    """
    special = set(tokenizer.all_special_ids)
    special.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    vocab: dict[str, int] = tokenizer.get_vocab()
    decoder = _byte_decoder()
    is_byte_level = all(c in decoder for tok, i in vocab.items() if i not in special for c in tok)
    result: list[bytes | None] = [None] * vocab_size
    for tok, token_id in vocab.items():
        if token_id >= vocab_size or token_id in special:
            continue
        if is_byte_level:
            result[token_id] = bytes(decoder[c] for c in tok)
        elif match := _SPM_BYTE.match(tok):
            result[token_id] = bytes([int(match.group(1), 16)])
        else:
            result[token_id] = tok.replace("▁", " ").encode()
    # Added tokens that are not special are text the model writes (Qwen2.5's ``<tool_call>``):
    # they keep their content, so a grammar allows them where that text may appear.
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        is_text = not getattr(added, "special", True) and token_id not in tokenizer.all_special_ids
        if token_id < vocab_size and is_text:
            result[token_id] = added.content.encode()
    return result


def default_stop_token_ids(tokenizer: Any) -> list[int]:
    """Returns: the tokenizer's EOS id as a one-element list (empty if it has none)."""
    eos = tokenizer.eos_token_id
    return [] if eos is None else [int(eos)]
