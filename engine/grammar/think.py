"""One grammar, thinking first: an optional think block, then the request's own constraint.

:class:`ThinkFirstMatcher` is a :class:`BaseMatcher` around the request's matcher (any
backend's, or none for free text) that a reasoning model's answer goes through:

=========  ===========================================================  =====================
phase      allowed next tokens                                          leaves
=========  ===========================================================  =====================
START      the constraint's, and the start marker's next token          the marker complete:
           (the model may open the block as its first tokens)          THINKING; another
                                                                        token: ANSWER
THINKING   anything but a token that completes the end marker before   the end marker ends
           its last byte, and, under a constraint, the stop tokens     a token: ANSWER; the
           (the answer cannot end before it started)                   budget spent: CLOSING
CLOSING    only the end marker's next token (the budget forces it)     the marker written:
                                                                        ANSWER
ANSWER     the constraint's, from its start state                      (the constraint's end)
=========  ===========================================================  =====================

A prompt that opened the block starts in THINKING (in CLOSING with a budget of 0). The
constraint thus starts right after the end marker, never before it, and thinking stays on when
JSON is asked for (vLLM #47027, #50948). The forced marker is jumped over as exact token ids
(:meth:`forced_token_ids`), then the constraint's own forced text (``{"name": "``): a decode
worker appends both without a forward pass, while the prefill worker, which samples one token,
samples the marker's first under a mask that allows nothing else. Either worker replays what the
other chose, so the budget counts across the handoff.

Where the start marker's first token is also one the constraint allows (``<`` of ``<think>``
and of ``<tool_call>`` in a tokenizer that knows neither), both readings live on until one
fails: the constraint's matcher is advanced too, and rolled back when the marker completes.

Reference: the reasoning-budget samplers of llama.cpp (``common/reasoning-budget.h``: count,
then force the end tokens) and vLLM v1 (``thinking_budget_state.py``); the composition is ours,
so every grammar backend keeps its own soundness (``constraints.chain``).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch

from splitserve.engine.grammar.base import BaseMatcher
from splitserve.engine.grammar.marker_scan import MarkerScan
from splitserve.ipc.messages import ReasoningParams


class Phase(enum.Enum):
    """Where the answer is (module docstring)."""

    START = "start"
    THINKING = "thinking"
    CLOSING = "closing"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """The matcher's own state before one accepted token (for rollback)."""

    phase: Phase
    pos: int
    inner_alive: bool
    state: int
    count: int
    inner_len: int
    epoch: int
    terminated: bool


class ThinkFirstMatcher(BaseMatcher):
    """A think block, then ``inner``.

    Args:
        inner: the constraint's matcher at its start state, or None for free text after the
            block (a budget without a constraint).
        params: the block's markers, whether the prompt opened it, and its budget.
        scan: the end marker's automaton over the model's vocabulary.
        stop_token_ids: the tokens that end the answer.
        max_rollback_tokens: how many accepted tokens :meth:`rollback` may undo (``inner``
            must allow this many plus the start marker's length).
    """

    def __init__(self, inner: BaseMatcher | None, params: ReasoningParams, scan: MarkerScan,
                 stop_token_ids: list[int], max_rollback_tokens: int = 64) -> None:
        self.inner = inner
        self.params = params
        self.scan = scan
        self.stops = frozenset(stop_token_ids)
        self._refused = tuple(sorted(self.stops)) if inner is not None else ()
        self._max_rollback = max_rollback_tokens
        self._history: deque[_Snapshot] = deque(maxlen=max_rollback_tokens)
        self._start_state()

    def _start_state(self) -> None:
        self.phase = Phase.START
        self.pos = 0  # START: start-marker tokens matched; CLOSING: end-marker tokens forced
        self.inner_alive = True  # START: the constraint's reading still lives
        self.state = 0  # THINKING: the end marker's automaton state
        self.count = 0  # THINKING, CLOSING: thinking tokens so far
        self.inner_len = 0  # tokens the inner matcher holds
        self.epoch = 0  # +1 each time the inner matcher is rolled back to its start
        self.terminated = False
        if self.params.opened:
            self._enter_thinking()
        elif not self.params.start_ids:  # no marker to open the block with: no block
            self._enter_answer()

    @property
    def thinking_tokens(self) -> int:
        """Tokens spent inside the block so far (the end marker not counted)."""
        return self.count

    # ---- BaseMatcher ---------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        snapshot = _Snapshot(self.phase, self.pos, self.inner_alive, self.state, self.count,
                             self.inner_len, self.epoch, self.terminated)
        ok = self._advance(token_id)
        if ok:
            self._history.append(snapshot)
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        phase = self.phase
        if phase is Phase.THINKING:
            bitmask[row].copy_(self.scan.thinking_row(self.state, self._refused))
        elif phase is Phase.CLOSING:
            bitmask[row].zero_()
            _set_bit(bitmask, row, self.params.end_ids[self.pos])
        elif phase is Phase.ANSWER or self.inner_alive:
            if self.inner is None:
                bitmask[row].fill_(-1)
            else:
                self.inner.fill_bitmask(bitmask, row)
            if phase is Phase.START:
                _set_bit(bitmask, row, self.params.start_ids[self.pos])
        else:  # START, only the marker's reading left
            bitmask[row].zero_()
            _set_bit(bitmask, row, self.params.start_ids[self.pos])

    def can_end(self) -> bool:
        if self.phase is Phase.THINKING:
            return self.inner is None
        if self.phase is Phase.CLOSING or (self.phase is Phase.START and not self.inner_alive):
            return False
        return self.inner is None or self.inner.can_end()

    def is_terminated(self) -> bool:
        if self.terminated:
            return True
        return (self.phase is Phase.ANSWER and self.inner is not None
                and self.inner.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens; "
                             f"{len(self._history)} kept")
        for _ in range(num_tokens):
            snapshot = self._history.pop()
        if self.inner is not None:
            if snapshot.epoch == self.epoch:
                if self.inner_len > snapshot.inner_len:
                    self.inner.rollback(self.inner_len - snapshot.inner_len)
            else:  # back before the start marker completed: the inner read it as text too
                if self.inner_len:
                    self.inner.rollback(self.inner_len)
                for token_id in self.params.start_ids[: snapshot.inner_len]:
                    self.inner.accept_token(token_id)
        (self.phase, self.pos, self.inner_alive, self.state, self.count, self.inner_len,
         self.epoch, self.terminated) = (
            snapshot.phase, snapshot.pos, snapshot.inner_alive, snapshot.state, snapshot.count,
            snapshot.inner_len, snapshot.epoch, snapshot.terminated)

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()
        self._history.clear()
        self._start_state()

    def copy(self) -> ThinkFirstMatcher:
        inner = None if self.inner is None else self.inner.copy()
        twin = ThinkFirstMatcher(inner, self.params, self.scan, list(self.stops),
                                 self._max_rollback)
        (twin.phase, twin.pos, twin.inner_alive, twin.state, twin.count, twin.inner_len,
         twin.epoch, twin.terminated) = (self.phase, self.pos, self.inner_alive, self.state,
                                         self.count, self.inner_len, self.epoch,
                                         self.terminated)
        twin._history = deque(self._history, maxlen=self._max_rollback)
        return twin

    def find_jump_forward_string(self) -> str:
        if self.phase is Phase.ANSWER and self.inner is not None:
            return self.inner.find_jump_forward_string()
        return ""

    def forced_token_ids(self) -> list[int]:
        """The end marker's remaining tokens once the budget is spent (or the start marker's,
        where only its reading is left): exact ids, appended without sampling."""
        if self.phase is Phase.CLOSING:
            return list(self.params.end_ids[self.pos:])
        if self.phase is Phase.START and not self.inner_alive:
            return list(self.params.start_ids[self.pos:])
        return []

    # ---- transitions ---------------------------------------------------------------------------

    def _advance(self, token_id: int) -> bool:
        phase = self.phase
        if phase is Phase.START:
            return self._start_token(token_id)
        if phase is Phase.THINKING:
            return self._thinking_token(token_id)
        if phase is Phase.CLOSING:
            if token_id != self.params.end_ids[self.pos]:
                return False
            self.pos += 1
            if self.pos == len(self.params.end_ids):
                self._enter_answer()
            return True
        return self._answer_token(token_id)

    def _start_token(self, token_id: int) -> bool:
        start_ids = self.params.start_ids
        marker_ok = token_id == start_ids[self.pos]
        inner_ok = False
        if self.inner_alive:
            inner_ok = self.inner is None or self.inner.accept_token(token_id)
            if inner_ok and self.inner is not None:
                self.inner_len += 1
        if not marker_ok:
            if not inner_ok:
                return False
            self.phase = Phase.ANSWER
            if self.inner is None and token_id in self.stops:
                self.terminated = True
            return True
        self.pos += 1
        self.inner_alive = inner_ok
        if self.pos == len(start_ids):
            if self.inner is not None and self.inner_len:
                self.inner.rollback(self.inner_len)
            self.inner_len = 0
            self.epoch += 1
            self._enter_thinking()
        return True

    def _thinking_token(self, token_id: int) -> bool:
        if token_id in self.stops:
            if self.inner is not None:
                return False  # the constraint's answer has not started
            self.terminated = True  # free text may end inside its thinking
            return True
        if token_id in self.scan.completes_inside(self.state):
            return False
        state = self.scan.advance(self.state, token_id)
        self.count += 1
        if state == self.scan.length:
            self._enter_answer()
            return True
        self.state = state
        budget = self.params.budget
        if 0 <= budget <= self.count:
            self.phase, self.pos = Phase.CLOSING, 0
        return True

    def _answer_token(self, token_id: int) -> bool:
        if self.inner is None:
            if token_id in self.stops:
                self.terminated = True
            return True
        if not self.inner.accept_token(token_id):
            return False
        self.inner_len += 1
        return True

    def _enter_thinking(self) -> None:
        self.phase, self.state, self.count, self.pos = Phase.THINKING, 0, 0, 0
        if self.params.budget == 0:
            self.phase = Phase.CLOSING

    def _enter_answer(self) -> None:
        self.phase, self.pos = Phase.ANSWER, 0


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Allow ``token_id`` in ``bitmask[row]`` (int32 words, bit ``t % 32`` of word ``t // 32``)."""
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
