"""llguidance backend: an Earley parser over a lazy lexer, masks computed per step (~50 µs).

Its JSON-schema front end refuses a keyword it does not implement (``Unimplemented keys``)
rather than dropping it, which is what makes it the chain's sound first choice (MaskBench: no
accepted-invalid instance); its Lark front end also reads llama.cpp's GBNF (empty alternatives,
``\\xNN`` escapes, ``{m,n}`` repetition).

Reference: guidance-ai/llguidance ``python/llguidance/_lib.pyi`` (``LLMatcher``, ``LLTokenizer``)
and ``docs/json_schema.md`` (the ``x-guidance`` options).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import torch

from splitserve.engine.grammar.base import (
    BaseGrammarBackend,
    BaseMatcher,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
)
from splitserve.engine.grammar.options import (
    COMPACT_ITEM_SEPARATOR,
    COMPACT_KEY_SEPARATOR,
    DEFAULT_OPTIONS,
    CompileOptions,
)
from splitserve.engine.grammar.sources import (
    JSON_OBJECT_SCHEMA,
    parse_choices,
    parse_json_schema,
    regex_problem,
)
from splitserve.engine.grammar.vocab import default_stop_token_ids

# At most this many whitespace characters in a row with ``whitespace_flexible`` (as xgrammar's
# ``max_whitespace_cnt``), so a model cannot loop on newlines forever.
MAX_WHITESPACE_RUN = 20


class LLGuidanceMatcher(BaseMatcher):
    """Wraps ``llguidance.LLMatcher``.

    llguidance enters a permanent error state on a refused token, so a token is checked with
    ``validate_tokens`` before it is consumed: a refusal leaves the state as it was, as the
    interface requires. ``is_terminated`` is tracked here (a stop token was accepted), because
    llguidance's ``is_stopped`` is also true when only a stop token may follow.
    """

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: list[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._is_terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._is_terminated or self._matcher.is_error():
            return False
        if token_id in self._stop_token_ids:
            if not self._matcher.is_accepting():
                return False
            self._is_terminated = True  # not consumed: llguidance knows one EOS id per matcher
            return True
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        if self._is_terminated or self._matcher.is_error():
            words.zero_()
            return
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        # llguidance sets its own EOS bit(s) where the grammar may end; the model may have more.
        can_end = self._matcher.is_accepting()
        for token_id in self._stop_token_ids:
            bit = _int32_bit(token_id % 32)
            word = int(words[token_id // 32])
            words[token_id // 32] = (word | bit) if can_end else (word & ~bit)

    def can_end(self) -> bool:
        return not self._is_terminated and self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._is_terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._is_terminated:
            self._is_terminated = False  # the stop token never reached the matcher
            num_tokens -= 1
        if num_tokens > 0 and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def reset(self) -> None:
        self._matcher.reset()
        self._is_terminated = False

    def copy(self) -> LLGuidanceMatcher:
        twin = LLGuidanceMatcher(self._matcher.deep_copy(), self._stop_token_ids)
        twin._is_terminated = self._is_terminated
        return twin

    def find_jump_forward_string(self) -> str:
        if self._is_terminated or self._matcher.is_error():
            return ""
        forced = self._matcher.compute_ff_bytes()
        # A forced run may end inside a UTF-8 character; only whole characters are text.
        return forced.decode("utf-8", errors="ignore") if forced else ""


class LLGuidanceCompiled(CompiledGrammar):
    """A checked llguidance grammar and a matcher at its start state, copied for each request
    (``deep_copy`` shares the built grammar and lexer; building it again would cost ms)."""

    backend_name = "llguidance"

    def __init__(
        self, prototype: llguidance.LLMatcher, vocab_size: int, stop_token_ids: list[int]
    ) -> None:
        self._prototype = prototype
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids

    def create_matcher(self, max_rollback_tokens: int = 0) -> LLGuidanceMatcher:
        del max_rollback_tokens  # llguidance keeps the whole history
        return LLGuidanceMatcher(self._prototype.deep_copy(), self._stop_token_ids)


class LLGuidanceBackend(BaseGrammarBackend):
    """Compiles every kind with llguidance (JSON schema, regex, Lark or GBNF, choice).

    Args:
        tokenizer: the Hugging Face (fast) tokenizer the model samples with.
        vocab_size: the model's logits width; defaults to ``len(tokenizer)``.
        stop_token_ids: tokens that end the output (allowed only where the grammar may end);
            defaults to the tokenizer's EOS.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.vocab_size = vocab_size or len(tokenizer)
        stops = default_stop_token_ids(tokenizer) if stop_token_ids is None else stop_token_ids
        if not stops:
            raise ValueError("llguidance needs at least one stop token id")
        self._stop_token_ids = list(stops)
        # Special tokens become 0xFF-prefixed byte strings there, which no grammar text matches.
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=self._stop_token_ids
        )

    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> LLGuidanceCompiled:
        grammar = self._grammar(kind, text, options)
        # log_level 0: a refused token is an expected event here, not a line on stderr.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_describe(kind, text, matcher.get_error()))
        return LLGuidanceCompiled(matcher, self.vocab_size, self._stop_token_ids)

    def _grammar(self, kind: GrammarKind, text: str, options: CompileOptions) -> str:
        """Returns: the llguidance grammar (its JSON form) for a constraint."""
        if kind in ("json_schema", "json_object"):
            schema_text = JSON_OBJECT_SCHEMA if kind == "json_object" else text
            parse_json_schema(schema_text)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    schema_text, overrides=_json_options(options)
                )
            except ValueError as exc:
                raise GrammarError(f"unsupported or invalid JSON schema: {exc}") from exc
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            try:
                return llguidance.grammar_from("gbnf", text)
            except ValueError as exc:
                raise GrammarError(f"EBNF grammar error: {exc}") from exc
        if kind == "choice":
            # json.dumps writes a double-quoted literal with escapes Lark reads the same way.
            choices = parse_choices(text)
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise GrammarError(f"unknown constraint kind {kind!r}")


def _json_options(options: CompileOptions) -> dict[str, Any]:
    """llguidance's ``x-guidance`` options; as overrides, a schema's own cannot loosen them."""
    if options.whitespace_flexible:
        return {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE_RUN}}}"}
    return {
        "whitespace_flexible": False,
        "item_separator": COMPACT_ITEM_SEPARATOR,
        "key_separator": COMPACT_KEY_SEPARATOR,
    }


def _int32_bit(bit: int) -> int:
    """Returns: ``1 << bit`` as a signed int32 value (bit 31 is negative)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def _describe(kind: GrammarKind, text: str, message: str) -> str:
    """Returns: the user-facing message for a failed llguidance compile."""
    message = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if kind == "regex":
        python_says = regex_problem(text)
        detail = f"{message} ({python_says})" if python_says else message
        return f"invalid or unsupported regex: {detail}"
    if kind == "ebnf":
        return f"EBNF grammar error: {message}"
    if kind == "json_schema":
        return f"unsupported or invalid JSON schema: {message}"
    return f"{kind} constraint error: {message}"
