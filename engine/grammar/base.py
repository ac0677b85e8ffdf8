"""The grammar backend interface: compile a constraint once, then one matcher per request.

A scheduler never talks to xgrammar or outlines-core directly; it goes through these three
classes so that backends can be swapped (and chained, see ``service.py``) without touching the
sampling code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, get_args

import torch

from splitserve.engine.grammar.options import DEFAULT_OPTIONS, CompileOptions

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
# A compiled grammar's size where its backend gives no figure (llguidance's lexer and parser grow
# lazily, unmeasured), bytes: about what one llguidance grammar of the 70 real schemas added to a
# worker's RSS (bench/grammar_memory.py).
DEFAULT_GRAMMAR_BYTES = 1 << 20


class GrammarError(ValueError):
    """A constraint that no backend can compile; the message is meant for the API user (HTTP 400).

    A ``ValueError`` so that the server's existing "bad request" handling catches it.
    """


class BaseMatcher(ABC):
    """Per-request grammar state: which tokens may come next, and whether the output may end.

    Not thread-safe: one matcher belongs to one request and is driven by one thread.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher by one sampled token.

        Args:
            token_id: the token the sampler chose. A stop token is accepted only where the grammar
                may end, and then terminates the matcher.

        Returns:
            True if the token was allowed (the state advanced); False if not (the state is
            unchanged, so the caller may fail the request or roll back).
        """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into one row of a batch bitmask.

        Args:
            bitmask: int32 CPU tensor ``[B, ceil(V/32)]`` (see ``bitmask.allocate_bitmask``); bit
                ``t % 32`` of word ``t // 32`` is 1 when token ``t`` is allowed. Stop tokens are
                set only where ``can_end()`` is true.
            row: which row of ``bitmask`` belongs to this request.
        """

    @abstractmethod
    def can_end(self) -> bool:
        """Returns: True if the text so far is a complete match (a stop token is allowed now)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Returns: True once a stop token was accepted; no further token is allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (for speculative decoding / retries).

        Args:
            num_tokens: how many tokens to undo; at most ``max_rollback_tokens`` of the matcher.

        Raises:
            ValueError: if more tokens are rolled back than the matcher keeps history for.
        """

    @abstractmethod
    def reset(self) -> None:
        """Return to the start state, as if no token had been accepted."""

    @abstractmethod
    def copy(self) -> BaseMatcher:
        """Returns: an independent matcher in the same state (e.g. for ``n > 1`` sampling)."""

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next, e.g. ``{"name": "`` at the start of an object.

        The caller tokenizes it and feeds the tokens through ``accept_token`` without sampling.
        Backends that cannot tell return the empty string, which turns jump-forward off.

        Returns:
            The forced continuation, or ``""`` if there is a choice (or the backend cannot tell).
        """
        return ""

    def forced_token_ids(self) -> list[int]:
        """Token ids the grammar forces next as exactly these tokens (a marker the matcher
        knows by its ids, ``engine.grammar.think``), to be accepted before any forced string.

        Returns:
            The ids, or ``[]`` (the backends' grammars force text, not ids).
        """
        return []


class CompiledGrammar(ABC):
    """An immutable compiled constraint, shared by every request that uses the same (kind, text,
    options).

    ``ignored`` lists the schema keywords the backend compiled but does not enforce, as
    ``"keyword at /json/pointer"`` (set by ``service.GrammarService`` from the measured limits in
    ``splitserve.constraints.schema_limits``; empty when the output is held to the whole
    constraint).
    """

    backend_name: str
    vocab_size: int
    ignored: tuple[str, ...] = ()

    @abstractmethod
    def create_matcher(self, max_rollback_tokens: int = 0) -> BaseMatcher:
        """Start a matcher for one request.

        Args:
            max_rollback_tokens: how many accepted tokens ``rollback`` may undo.

        Returns:
            A fresh matcher at the start state.
        """

    def size_bytes(self) -> int:
        """What this grammar holds in memory, estimated (bytes): the compile service bounds its
        cache by the sum (``service.GrammarService``'s ``max_cache_bytes``). Backends override
        it with their own figure; the default is ``DEFAULT_GRAMMAR_BYTES``."""
        return DEFAULT_GRAMMAR_BYTES


class BaseGrammarBackend(ABC):
    """Compiles constraints for one tokenizer/vocabulary.

    Implementations must be safe to call ``compile`` from several threads at once (the service
    compiles on a thread pool).
    """

    name: str
    vocab_size: int

    @abstractmethod
    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> CompiledGrammar:
        """Compile one constraint.

        Args:
            kind: one of ``GRAMMAR_KINDS``. ``json_schema``: a JSON Schema document;
                ``json_object``: any JSON object (``text`` is ignored); ``regex``: a regular
                expression the whole output must match; ``ebnf``: a GBNF-style grammar with a
                ``root`` rule; ``choice``: a JSON list of strings, the output is exactly one;
                ``structural_tag``: xgrammar's structural tag JSON (``{"type": "structural_tag",
                "format": {...}}``: free text, tags with JSON-schema content, triggers; the
                tool-call envelope, ``server.tools.grammar``).
            text: the constraint source.
            options: whitespace between JSON tokens (``options.CompileOptions``); backends
                ignore ``strict``, which the service applies.

        Returns:
            The compiled grammar.

        Raises:
            GrammarError: if the constraint is malformed or uses a feature this backend lacks;
                the message names the problem.
        """

    def export(self, compiled: CompiledGrammar) -> Any:
        """What of ``compiled`` can cross a process boundary (``compile_pool``): a picklable
        value for :meth:`restore`, or None when nothing can (then :meth:`restore` compiles
        again; the child process only proved that the compile finishes in time)."""
        del compiled
        return None

    def restore(
        self, kind: GrammarKind, text: str, options: CompileOptions, exported: Any
    ) -> CompiledGrammar:
        """The compiled grammar from :meth:`export`'s value, in this process.

        Raises:
            GrammarError: as :meth:`compile`.
        """
        del exported
        return self.compile(kind, text, options)
