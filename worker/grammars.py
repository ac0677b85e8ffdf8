"""A worker's grammar side: the compile service for its model, and the requests waiting on it.

Compiles run on the service's threads; the worker loop calls :meth:`WorkerGrammars.poll` each
iteration and gets back the requests whose compile finished, each with its ``RequestGrammar``
attached or an error message. A request still compiling simply is not in the batch yet, so it
never holds up the others.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from splitserve.engine.grammar.base import CompiledGrammar
from splitserve.engine.grammar.compile_pool import BackendSpec, CompileBusy, CompilePool
from splitserve.engine.grammar.marker_scan import MarkerScan, vocab_text
from splitserve.engine.grammar.options import CompileOptions
from splitserve.engine.grammar.registry import DEFAULT_BACKEND, create_grammar_service
from splitserve.engine.grammar.request_grammar import RequestGrammar
from splitserve.engine.grammar.service import GrammarService
from splitserve.engine.grammar.think import ThinkFirstMatcher
from splitserve.engine.sched.request import Req

logger = logging.getLogger(__name__)

MAX_ROLLBACK_TOKENS = 64  # room to undo a refused jump-forward (outlines keeps bounded history)


@dataclass(slots=True)
class CompileDone:
    """A finished compile: ``req.grammar`` is set, or ``error`` says why it could not be
    (``code`` 400: the constraint is at fault; 503: no compile process for it now, a full queue
    or one that would not start, so retry; 500: ours)."""

    req: Req
    error: str | None = None
    code: int = 400


class WorkerGrammars:
    """Grammar compilation for one worker.

    Args:
        service: compiles and caches (kind, text) constraints.
        vocab_size: the model's logits width (from the model config; may exceed the tokenizer's).
        stop_token_ids: the model's EOS ids, which the grammar allows only where it may end.
        tokenizer: the model's tokenizer (tokenizes jump-forward strings).
        jump_forward: give requests the tokenizer so that they may jump forward.
    """

    def __init__(
        self,
        service: GrammarService,
        vocab_size: int,
        stop_token_ids: list[int],
        tokenizer: Any,
        jump_forward: bool = True,
    ) -> None:
        self.service = service
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer
        self._encode = None
        if jump_forward:
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self._pending: dict[str, tuple[Req, Future[CompiledGrammar | None], tuple | None]] = {}
        self._vocab: list[bytes | None] | None = None  # token bytes, made at the first think block
        self._scans: dict[str, MarkerScan] = {}  # end marker -> its automaton

    def submit(self, req: Req) -> None:
        """Start compiling ``req``'s constraint (a think block alone compiles nothing); it is
        returned by a later :meth:`poll`."""
        constraint = req.sampling.constraint
        if not req.sampling.needs_grammar:
            raise ValueError(f"request {req.rid} has no constraint")
        future: Future[CompiledGrammar | None]
        key: tuple | None = None
        if constraint is None:
            future = Future()
            future.set_result(None)
        else:
            options = CompileOptions(
                whitespace_flexible=constraint.whitespace_flexible, strict=constraint.strict
            )
            key = (constraint.kind, constraint.text, options)
            future = self.service.submit(*key)  # type: ignore[arg-type,assignment]
        self._pending[req.rid] = (req, future, key)

    def is_pending(self, rid: str) -> bool:
        """Whether ``rid``'s constraint is still compiling."""
        return rid in self._pending

    def pending(self) -> list[Req]:
        """The requests whose constraint is still compiling, in submission order."""
        return [req for req, _, _ in self._pending.values()]

    def discard(self, rid: str) -> None:
        """Forget an aborted request; its compile is dropped if it has not started and no other
        request waits for it (a running one goes on and is cached)."""
        entry = self._pending.pop(rid, None)
        if entry is not None and entry[2] is not None and not entry[1].done():
            self.service.release(*entry[2])

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stop the compile service's threads (the worker is shutting down)."""
        self.service.shutdown()

    def poll(self) -> list[CompileDone]:
        """Returns: the requests whose compile finished since the last poll, in arrival order."""
        done: list[CompileDone] = []
        for rid, (req, future, _) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                compiled = future.result()
            except CompileBusy as exc:  # a full queue, or no process would start: retry later
                done.append(CompileDone(req, f"grammar compiler busy: {exc}; retry shortly", 503))
                continue
            except ValueError as exc:  # GrammarError: the user's constraint is at fault
                done.append(CompileDone(req, str(exc)))
                continue
            except Exception as exc:  # a backend bug must fail the request, not the worker
                logger.exception("grammar compile of %s crashed", rid)
                done.append(CompileDone(req, f"grammar compile failed: {exc}", 500))
                continue
            reasoning = req.sampling.reasoning
            # Inside a think block's matcher (engine.grammar.think), the constraint's may also
            # have to undo the start marker's tokens, which it read as text too.
            room = MAX_ROLLBACK_TOKENS + (len(reasoning.start_ids) if reasoning else 0)
            matcher = None if compiled is None else compiled.create_matcher(
                max_rollback_tokens=room)
            if reasoning is not None:
                matcher = ThinkFirstMatcher(matcher, reasoning, self.marker_scan(reasoning.end_text),
                                            self.stop_token_ids, MAX_ROLLBACK_TOKENS)
            assert matcher is not None
            req.grammar = RequestGrammar(
                matcher, self.vocab_size, self.stop_token_ids, self._encode
            )
            if compiled is not None:  # what this worker compiled, for its first output
                req.grammar_report = (compiled.backend_name, tuple(compiled.ignored))
            done.append(CompileDone(req))
        return done

    def marker_scan(self, marker: str) -> MarkerScan:
        """The automaton of a think block's end marker over this model's vocabulary (built at
        its first use, then kept)."""
        scan = self._scans.get(marker)
        if scan is None:
            if self._vocab is None:
                self._vocab = vocab_text(self.tokenizer, self.vocab_size)
            scan = self._scans[marker] = MarkerScan(marker, self._vocab)
        return scan


def create_worker_grammars(
    model_path: str,
    vocab_size: int,
    eos_token_ids: list[int],
    jump_forward: bool = True,
    default_backend: str = DEFAULT_BACKEND,
    compile_procs: int = 2,
    compile_timeout_s: float = 30.0,
    compile_queue: int = 256,
    test_slow: str = "",
    cache_bytes: int = 512 * 2**20,
) -> WorkerGrammars:
    """Load the model's tokenizer and build the compile service (``default_backend`` first,
    then the other registered backends).

    Args:
        model_path: the model folder (its tokenizer files).
        vocab_size: the model's logits width, from its config.
        eos_token_ids: the model config's EOS ids; the tokenizer's EOS is added if different.
        jump_forward: tokenize forced continuations (see ``RequestGrammar.forced_tokens``).
        default_backend: a name of ``splitserve.config.registry.GRAMMAR_BACKEND``.
        compile_procs: compile processes (``engine.grammar.compile_pool``); 0: compile on
            threads in this process (a compile past its deadline cannot be stopped).
        compile_timeout_s: each backend's deadline for one compile, from its start.
        compile_queue: compiles that may wait for a process; more get 503.
        test_slow: ``"MARKER=SECONDS"``: tests only (``CompilePool``'s slow hook).
        cache_bytes: the compiled-grammar cache's bound, bytes of size estimates (0: none).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stops = list(dict.fromkeys([*eos_token_ids, *_tokenizer_eos(tokenizer)]))
    service = create_grammar_service(
        tokenizer, vocab_size, default_backend=default_backend, stop_token_ids=stops,
        timeout_s=compile_timeout_s, max_cache_bytes=cache_bytes,
    )
    if compile_procs:
        marker, _, seconds = test_slow.partition("=")
        spec = BackendSpec(tuple(b.name for b in service.backends), tokenizer, vocab_size,
                           tuple(stops), marker, float(seconds or 0))
        service.compile_pool = CompilePool(spec, compile_procs, compile_timeout_s, compile_queue)
    logger.info("grammar backends: %s", ", ".join(b.name for b in service.backends))
    return WorkerGrammars(service, vocab_size, stops, tokenizer, jump_forward)


def _tokenizer_eos(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else [int(eos)]
