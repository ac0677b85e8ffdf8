"""Each token's own text and bytes, as logprobs objects spell them (OpenAI: ``token`` and
``bytes``, the UTF-8 bytes of the token, which may be part of one character).

Byte-level BPE tokenizers (GPT-2's scheme: SmolLM2, Llama 3, Qwen2) store each token as
printable stand-ins for its bytes; the bytes are read back through GPT-2's byte-to-unicode table
(``transformers.convert_slow_tokenizer.bytes_to_unicode``). Other tokenizers fall back to the
token decoded alone, as UTF-8.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class TokenSpeller:
    """Spells token ids of one tokenizer. Keeps a bounded cache of spelled ids.

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_of_char = _byte_level_table(tokenizer)
        self.bytes_of = lru_cache(maxsize=1 << 16)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        if self._byte_of_char is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_of_char for c in piece):
                return bytes(self._byte_of_char[c] for c in piece)
        # Special tokens (written as themselves) and other tokenizer families.
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def text_of(self, token_id: int) -> str:
        """The token's text; bytes that are not whole UTF-8 characters become U+FFFD."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


def _byte_level_table(tokenizer: Any) -> dict[str, int] | None:
    """The inverse of GPT-2's byte-to-unicode table if ``tokenizer`` decodes byte-level, else
    None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}
