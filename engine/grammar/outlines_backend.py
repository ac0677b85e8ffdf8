"""outlines-core backend (the fallback): regex -> DFA over tokens (an ``Index``).

It covers regular languages only: JSON Schema is first turned into one regex (so recursive
schemas are unrolled to a fixed depth), and EBNF grammars are refused.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from splitserve.engine.grammar.base import (
    BaseGrammarBackend,
    BaseMatcher,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
)
from splitserve.engine.grammar.bitmask import bitmask_width
from splitserve.engine.grammar.options import DEFAULT_OPTIONS, CompileOptions
from splitserve.engine.grammar.sources import (
    JSON_OBJECT_SCHEMA,
    choices_to_regex,
    parse_choices,
    parse_json_schema,
    regex_problem,
)
from splitserve.engine.grammar.vocab import default_stop_token_ids, token_bytes


def _int32_bit(bit: int) -> int:
    """Returns: ``1 << bit`` as a signed int32 value (bit 31 is negative)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


class OutlinesMatcher(BaseMatcher):
    """Walks an outlines-core ``Guide``; stop tokens are handled here so any of several may end.

    outlines-core knows a single EOS id; the model may have more stop tokens, so their bits are
    rewritten after the Guide fills a row, and accepting one only sets ``is_terminated``.
    """

    def __init__(self, guide: outlines_core.Guide, stop_token_ids: list[int]) -> None:
        self._guide = guide
        self._stop_token_ids = stop_token_ids
        self._is_terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._is_terminated:
            return False
        if token_id in self._stop_token_ids:
            if not self._guide.is_finished():
                return False
            self._is_terminated = True
            return True
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # "No next state found": the token is not allowed here
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        if self._is_terminated:
            words.zero_()
            return
        # The Guide writes the whole row (clearing it first) straight into the tensor's memory.
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        can_end = self._guide.is_finished()
        for token_id in self._stop_token_ids:
            bit = _int32_bit(token_id % 32)
            word = int(words[token_id // 32])
            words[token_id // 32] = (word | bit) if can_end else (word & ~bit)

    def can_end(self) -> bool:
        return not self._is_terminated and self._guide.is_finished()

    def is_terminated(self) -> bool:
        return self._is_terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._is_terminated:
            self._is_terminated = False  # the stop token never advanced the Guide
            num_tokens -= 1
        if num_tokens > 0:
            try:
                self._guide.rollback_state(num_tokens)
            except ValueError as exc:
                raise ValueError(f"cannot roll back {num_tokens} tokens: {exc}") from exc

    def reset(self) -> None:
        self._guide.reset()
        self._is_terminated = False

    def copy(self) -> OutlinesMatcher:
        twin = OutlinesMatcher(copy.deepcopy(self._guide), self._stop_token_ids)
        twin._is_terminated = self._is_terminated
        return twin


class OutlinesCompiled(CompiledGrammar):
    """An outlines-core ``Index`` (token-level DFA) plus the regex it came from.

    ``size``: the Index's size in bytes if known (a compile process measured it); else it is
    measured at the first :meth:`size_bytes`.
    """

    backend_name = "outlines"

    def __init__(
        self, index: outlines_core.Index, regex: str, vocab_size: int, stop_token_ids: list[int],
        size: int | None = None,
    ) -> None:
        self._index = index
        self.regex = regex
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._size = size

    def size_bytes(self) -> int:
        """The pickled Index's length (its transition table, which is what it holds)."""
        if self._size is None:
            self._size = len(pickle.dumps(self._index)) + len(self.regex)
        return self._size

    def create_matcher(self, max_rollback_tokens: int = 0) -> OutlinesMatcher:
        # Guide keeps max_rollback past states; it needs room for at least one.
        guide = outlines_core.Guide(self._index, max_rollback=max(1, max_rollback_tokens))
        return OutlinesMatcher(guide, self._stop_token_ids)


class OutlinesBackend(BaseGrammarBackend):
    """Compiles json_schema, json_object, regex and choice with outlines-core (no EBNF).

    Args:
        tokenizer: the Hugging Face tokenizer the model samples with.
        vocab_size: the model's logits width; defaults to ``len(tokenizer)``.
        stop_token_ids: tokens that end the output; defaults to the tokenizer's EOS.
        whitespace_pattern: regex for whitespace between JSON tokens with
            ``CompileOptions.whitespace_flexible``; None keeps outlines' default (``[ ]?``: no
            whitespace or one space), which bounds the DFA's size. Without it, JSON is compact.
        max_regex_len: refuse regexes longer than this. Index building cannot be interrupted
            and grows steeply with the regex (a schema with untyped ``{}`` values becomes a 40 kB
            regex that takes over a minute), so such schemas fail fast instead of holding a
            compile thread. None: no limit.
    """

    name = "outlines"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        stop_token_ids: list[int] | None = None,
        whitespace_pattern: str | None = None,
        max_regex_len: int | None = 10_000,
    ) -> None:
        self.vocab_size = vocab_size or len(tokenizer)
        stops = default_stop_token_ids(tokenizer) if stop_token_ids is None else stop_token_ids
        if not stops:
            raise ValueError("outlines-core needs at least one stop token id")
        self._stop_token_ids = list(stops)
        self._whitespace_pattern = whitespace_pattern
        self._max_regex_len = max_regex_len
        token_map: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(token_bytes(tokenizer, self.vocab_size)):
            if raw and token_id not in self._stop_token_ids:
                token_map.setdefault(raw, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(self._stop_token_ids[0], token_map)
        self._bitmask_width = bitmask_width(self.vocab_size)

    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> OutlinesCompiled:
        regex = self._to_regex(kind, text, options)
        if self._max_regex_len is not None and len(regex) > self._max_regex_len:
            raise GrammarError(
                f"{kind} constraint too complex for outlines-core: its regex has {len(regex)} "
                f"characters (limit {self._max_regex_len}); untyped or deeply nested values "
                "are the usual cause"
            )
        try:
            index = outlines_core.Index(regex, self._vocabulary)
        except Exception as exc:  # ValueError("Failed to build DFA ...") and Rust panics
            raise GrammarError(_describe(kind, text, str(exc))) from exc
        return OutlinesCompiled(index, regex, self.vocab_size, self._stop_token_ids)

    def export(self, compiled: CompiledGrammar) -> tuple[Any, str, int]:
        """The ``Index`` (outlines-core pickles it), its regex and its size."""
        return (compiled._index, compiled.regex,  # type: ignore[attr-defined]
                compiled.size_bytes())

    def restore(
        self, kind: GrammarKind, text: str, options: CompileOptions, exported: Any
    ) -> OutlinesCompiled:
        """The shipped ``Index``, unpickled (no compile)."""
        del kind, text, options
        index, regex, size = exported
        return OutlinesCompiled(index, regex, self.vocab_size, self._stop_token_ids, size)

    def _to_regex(self, kind: GrammarKind, text: str, options: CompileOptions) -> str:
        """Returns: the regex for a constraint. Raises: GrammarError if it has none."""
        if kind == "regex":
            return text
        if kind == "choice":
            return choices_to_regex(parse_choices(text))
        if kind == "ebnf":
            raise GrammarError(
                "EBNF grammars are not supported by the outlines backend "
                "(outlines-core compiles regular expressions only, no context-free grammars)"
            )
        if kind == "structural_tag":
            raise GrammarError(
                "structural tags (the tool-call grammar) are not supported by the outlines "
                "backend (xgrammar compiles them)"
            )
        if kind not in ("json_schema", "json_object"):
            raise GrammarError(f"unknown constraint kind {kind!r}")
        schema_text = JSON_OBJECT_SCHEMA if kind == "json_object" else text
        parse_json_schema(schema_text)
        try:
            # "" between tokens: compact JSON (outlines joins its separators with this pattern).
            whitespace = self._whitespace_pattern if options.whitespace_flexible else ""
            return build_regex_from_schema(schema_text, whitespace)
        except Exception as exc:  # ValueError naming the unsupported keyword/type
            raise GrammarError(f"unsupported or invalid JSON schema: {exc}") from exc


def _describe(kind: GrammarKind, text: str, message: str) -> str:
    """Returns: the user-facing message for a failed Index build."""
    if kind == "regex":
        python_says = regex_problem(text)
        detail = f"{message} ({python_says})" if python_says else message
        return f"invalid or unsupported regex: {detail}"
    return f"{kind} constraint could not be compiled to a token automaton: {message}"
