"""xgrammar backend (the default): pushdown automaton with precomputed token masks, ~10 µs/token."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import xgrammar as xgr

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
    choices_to_ebnf,
    clean_backend_message,
    parse_choices,
    parse_json_schema,
    regex_problem,
)
from splitserve.engine.grammar.vocab import default_stop_token_ids, token_bytes


class XGrammarMatcher(BaseMatcher):
    """Wraps ``xgrammar.GrammarMatcher``; stop tokens come from the backend's TokenizerInfo."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def can_end(self) -> bool:
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        try:
            self._matcher.rollback(num_tokens)
        except Exception as exc:  # xgrammar raises RuntimeError past the first token
            raise ValueError(f"cannot roll back {num_tokens} tokens: {exc}") from exc

    def reset(self) -> None:
        self._matcher.reset()

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._matcher.fork())

    def find_jump_forward_string(self) -> str:
        return self._matcher.find_jump_forward_string()


class XGrammarCompiled(CompiledGrammar):
    """A ``xgrammar.CompiledGrammar``; matchers share its precomputed masks."""

    backend_name = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size

    def create_matcher(self, max_rollback_tokens: int = 0) -> XGrammarMatcher:
        # xgrammar >= 0.2 keeps unlimited history (its max_rollback_tokens is deprecated).
        del max_rollback_tokens
        return XGrammarMatcher(xgr.GrammarMatcher(self._compiled))

    def size_bytes(self) -> int:
        """xgrammar's own estimate of the grammar and its token masks (bytes)."""
        return int(self._compiled.memory_size_bytes)


class XGrammarBackend(BaseGrammarBackend):
    """Compiles every kind with xgrammar's ``GrammarCompiler``.

    The compiler's own cache is off: the compile service caches compiled grammars, bounded by
    count and bytes (``service.GrammarService``); a second, unbounded copy here kept every
    grammar ever compiled. A grammar compiled in a compile process is not shipped back
    (``export`` is None, so the worker compiles it again): ``serialize_json`` writes 1 to 60
    times the grammar's ``memory_size_bytes`` as JSON text (230 MiB for a 3.7 MiB grammar of
    JSONSchemaStore's project-1.0.0-rc1 on SmolLM2's vocabulary), and serializing and reading it
    back took GBs of transient memory and longer than the compile itself
    (``bench/grammar_memory.py``).

    Args:
        tokenizer: the Hugging Face tokenizer the model samples with.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)`` because of padding);
            defaults to ``len(tokenizer)``.
        stop_token_ids: tokens that end the output (allowed only where the grammar may end);
            defaults to the tokenizer's EOS.
        max_threads: threads xgrammar uses inside one compile.
        max_whitespace_cnt: with ``CompileOptions.whitespace_flexible``, at most this many
            whitespace characters in a row, so a model cannot loop on newlines forever. Without
            it, JSON is compact (``,`` and ``:``, no whitespace).
        strict_mode: if True, objects without ``additionalProperties`` admit no extra keys
            (tighter outputs, but valid instances with extra keys are refused).
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        stop_token_ids: list[int] | None = None,
        max_threads: int = 2,
        max_whitespace_cnt: int | None = 20,
        strict_mode: bool = False,
    ) -> None:
        self.vocab_size = vocab_size or len(tokenizer)
        stops = default_stop_token_ids(tokenizer) if stop_token_ids is None else stop_token_ids
        # Built from our own byte table (RAW) rather than from_huggingface, so special and added
        # tokens (<|im_start|> ...) are empty strings, which xgrammar never allows as text.
        encoded = [b or b"" for b in token_bytes(tokenizer, self.vocab_size)]
        self._info = xgr.TokenizerInfo(
            encoded,
            vocab_type=xgr.VocabType.RAW,
            vocab_size=self.vocab_size,
            stop_token_ids=stops,
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads,
                                             cache_enabled=False)
        # A structural tag may name special tokens as tokens (a tool-call marker such as
        # Mistral's [TOOL_CALLS] or DeepSeek's <｜tool▁calls▁begin｜>): xgrammar accepts no token
        # whose text is empty, so those compile against a vocabulary where exactly they have
        # their text (every other special token stays out of reach), built once per set.
        self._tokenizer, self._encoded, self._stops = tokenizer, encoded, stops
        self._max_threads = max_threads
        self._marker_compilers: dict[frozenset[int], xgr.GrammarCompiler] = {}
        self._marker_lock = threading.Lock()
        self._max_whitespace_cnt = max_whitespace_cnt
        self._strict_mode = strict_mode

    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> XGrammarCompiled:
        try:
            compiled = self._compile(kind, text, options)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with C++ context
            raise GrammarError(_describe(kind, text, clean_backend_message(str(exc)))) from exc
        return XGrammarCompiled(compiled, self.vocab_size)

    def _json_options(self, options: CompileOptions) -> dict[str, Any]:
        if options.whitespace_flexible:
            return {"any_whitespace": True, "max_whitespace_cnt": self._max_whitespace_cnt}
        return {"any_whitespace": False,
                "separators": (COMPACT_ITEM_SEPARATOR, COMPACT_KEY_SEPARATOR)}

    def _compile(
        self, kind: GrammarKind, text: str, options: CompileOptions
    ) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            parse_json_schema(text)  # a clear message for plain JSON syntax errors
            return self._compiler.compile_json_schema(
                text, strict_mode=self._strict_mode, **self._json_options(options)
            )
        if kind == "json_object":
            return self._compiler.compile_json_schema(
                JSON_OBJECT_SCHEMA, strict_mode=False, **self._json_options(options)
            )
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "ebnf":
            return self._compiler.compile_grammar(text)
        if kind == "choice":
            return self._compiler.compile_grammar(choices_to_ebnf(parse_choices(text)))
        if kind == "structural_tag":
            return self._structural_compiler(text).compile_structural_tag(text)
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def _structural_compiler(self, text: str) -> xgr.GrammarCompiler:
        """The compiler for a structural tag: the plain one, or, where the tag names special
        tokens (``token`` elements, token triggers), one whose vocabulary gives just those
        tokens their text."""
        try:
            named = _named_tokens(json.loads(text))
        except ValueError:
            return self._compiler  # xgrammar reports the syntax error
        markers = frozenset(t for t in named if 0 <= t < self.vocab_size
                            and not self._encoded[t] and t not in self._stops)
        if not markers:
            return self._compiler
        with self._marker_lock:
            compiler = self._marker_compilers.get(markers)
            if compiler is None:
                encoded = list(self._encoded)
                for token_id in markers:
                    encoded[token_id] = self._tokenizer.decode([token_id]).encode()
                info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW,
                                         vocab_size=self.vocab_size, stop_token_ids=self._stops)
                compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                               cache_enabled=False)
                self._marker_compilers[markers] = compiler
        return compiler


def _named_tokens(node: Any) -> set[int]:
    """The token ids a structural tag names: ``{"type": "token", "token": id}`` elements and
    ``trigger_tokens`` (ids only; a token named by its text is resolved by xgrammar)."""
    found: set[int] = set()
    if isinstance(node, dict):
        if node.get("type") == "token" and isinstance(node.get("token"), int):
            found.add(node["token"])
        for token in node.get("trigger_tokens") or ():
            if isinstance(token, int):
                found.add(token)
        for value in node.values():
            found |= _named_tokens(value)
    elif isinstance(node, list):
        for value in node:
            found |= _named_tokens(value)
    return found


def _describe(kind: GrammarKind, text: str, message: str) -> str:
    """Returns: the user-facing message for a failed xgrammar compile."""
    if kind == "regex":
        python_says = regex_problem(text)
        detail = f"{message} ({python_says})" if python_says else message
        return f"invalid or unsupported regex: {detail}"
    if kind == "ebnf":
        return f"EBNF grammar error: {message}"
    if kind == "json_schema":
        return f"unsupported or invalid JSON schema: {message}"
    if kind == "structural_tag":
        return f"tool-call grammar (structural tag) error: {message}"
    return f"{kind} constraint error: {message}"
