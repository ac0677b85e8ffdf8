"""The grammar backend factory and the compile service over the registered backends (names:
``splitserve.config.registry.GRAMMAR_BACKEND``, imported only when built, so that a missing
optional package disables only its backend)."""

from __future__ import annotations

from typing import Any

from splitserve.config.registry import GRAMMAR_BACKEND
from splitserve.engine.grammar.base import BaseGrammarBackend
from splitserve.engine.grammar.service import GrammarService

BACKEND_NAMES: tuple[str, ...] = GRAMMAR_BACKEND.names
DEFAULT_BACKEND = GRAMMAR_BACKEND.default


def create_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> BaseGrammarBackend:
    """Build one backend by name.

    Args:
        name: one of ``BACKEND_NAMES``.
        tokenizer: the Hugging Face tokenizer the model samples with.
        vocab_size: the model's logits width; defaults to ``len(tokenizer)``.
        stop_token_ids: tokens that end the output; defaults to the tokenizer's EOS.

    Returns:
        The backend.

    Raises:
        ValueError: for an unknown name. ImportError: if its package is not installed.
    """
    return GRAMMAR_BACKEND.load(name)(tokenizer, vocab_size, stop_token_ids)


def create_grammar_service(
    tokenizer: Any,
    vocab_size: int | None = None,
    default_backend: str = DEFAULT_BACKEND,
    fallback: bool = True,
    timeout_s: float = 30.0,
    num_threads: int = 2,
    stop_token_ids: list[int] | None = None,
    max_cache_bytes: int = 0,
) -> GrammarService:
    """Build the service with the default backend first and (if ``fallback``) the others after.

    Args:
        tokenizer: the Hugging Face tokenizer the model samples with.
        vocab_size: the model's logits width; defaults to ``len(tokenizer)``.
        default_backend: the backend tried first.
        fallback: also try the remaining backends when the default cannot compile.
        timeout_s: per-backend compile timeout.
        num_threads: compile threads.
        stop_token_ids: tokens that end the output (the model's EOS ids); defaults to the
            tokenizer's EOS.
        max_cache_bytes: the compiled-grammar cache's bound in bytes of size estimates (0: by
            count only; ``GrammarService``).

    Returns:
        The service. Backends whose package is missing are skipped (the default must exist).
    """
    names = [default_backend]
    if fallback:
        names += [n for n in BACKEND_NAMES if n != default_backend]
    backends = []
    for name in names:
        try:
            backends.append(create_backend(name, tokenizer, vocab_size, stop_token_ids))
        except ImportError:
            if name == default_backend:
                raise
    return GrammarService(backends, timeout_s=timeout_s, num_threads=num_threads,
                          max_cache_bytes=max_cache_bytes)
