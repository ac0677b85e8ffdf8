"""The think-first grammar (``engine.grammar.think``) over the default tokenizer, no model: a
constraint starts only after the end marker, thinking stays free (stop tokens aside), the budget
forces the end marker as exact ids, the marker is found whatever tokens spell it and never ends
inside a token, the start marker shares a first token with the constraint (``<``), and rollback
crosses every phase."""

from __future__ import annotations

import json
from typing import Any

import pytest

from splitserve.engine.grammar.bitmask import allocate_bitmask
from splitserve.engine.grammar.marker_scan import MarkerScan, vocab_text
from splitserve.engine.grammar.request_grammar import RequestGrammar
from splitserve.engine.grammar.think import Phase, ThinkFirstMatcher
from splitserve.ipc.messages import ReasoningParams

SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"], "additionalProperties": False})


@pytest.fixture(scope="module")
def scan(tokenizer: Any, xgrammar_backend: Any) -> MarkerScan:
    return MarkerScan("</think>", vocab_text(tokenizer, xgrammar_backend.vocab_size))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _params(tokenizer: Any, opened: bool = True, budget: int = -1) -> ReasoningParams:
    return ReasoningParams(start_ids=_ids(tokenizer, "<think>"),
                           end_ids=_ids(tokenizer, "</think>"), end_text="</think>",
                           opened=opened, budget=budget)


def _matcher(backend: Any, tokenizer: Any, scan: MarkerScan, kind: str | None = "json_schema",
             text: str = SCHEMA, **params: Any) -> ThinkFirstMatcher:
    inner = None if kind is None else backend.compile(kind, text).create_matcher(
        max_rollback_tokens=80)
    return ThinkFirstMatcher(inner, _params(tokenizer, **params), scan,
                             [tokenizer.eos_token_id])


def _accept_all(matcher: ThinkFirstMatcher, ids: list[int]) -> bool:
    return all(matcher.accept_token(t) for t in ids)


def _allowed(matcher: ThinkFirstMatcher, vocab_size: int) -> set[int]:
    mask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(mask, 0)
    words = mask[0].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def test_marker_scan_follows_bytes_and_refuses_a_marker_ending_inside_a_token() -> None:
    vocab = [b"</", b"think", b">", b"</think>", b">\n", b"x", None, b"</th", b"ink>"]
    scan = MarkerScan("</think>", vocab)
    state = 0
    for token in (0, 1):
        state = scan.advance(state, token)
    assert state == len("</think")
    assert 4 in scan.completes_inside(state)  # ">\n" would end the marker before its last byte
    assert 2 not in scan.completes_inside(state)
    assert scan.advance(state, 2) == scan.length
    assert scan.advance(0, 3) == scan.length  # one token
    assert scan.advance(scan.advance(0, 7), 8) == scan.length  # split elsewhere
    assert scan.advance(state, 6) == state  # no text: no change
    assert scan.advance(scan.advance(0, 5), 0) == 2  # "x</" is a start again


def test_constraint_starts_after_the_thinking(xgrammar_backend, tokenizer, scan) -> None:
    m = _matcher(xgrammar_backend, tokenizer, scan)
    eos = tokenizer.eos_token_id
    assert m.phase is Phase.THINKING
    # JSON-looking text and EOS: thinking is free text, but the answer cannot end in it.
    assert _accept_all(m, _ids(tokenizer, 'Hmm, {"city": 1} is not it.'))
    assert not m.accept_token(eos) and not m.can_end()
    assert eos not in _allowed(m, xgrammar_backend.vocab_size)
    assert _accept_all(m, _ids(tokenizer, "</think>"))
    assert m.phase is Phase.ANSWER
    assert not m.accept_token(_ids(tokenizer, "Paris")[0])  # the schema's turn: not text
    assert _accept_all(m, _ids(tokenizer, '{"city":"Paris"}'))
    assert m.can_end() and m.accept_token(eos) and m.is_terminated()


def test_end_marker_found_whatever_spells_it_never_inside_a_token(xgrammar_backend, tokenizer,
                                                                  scan) -> None:
    m = _matcher(xgrammar_backend, tokenizer, scan)
    for piece in ("</", "th", "ink"):  # not the tokenizer's own split of the marker
        assert _accept_all(m, _ids(tokenizer, piece))
    assert m.phase is Phase.THINKING
    allowed = _allowed(m, xgrammar_backend.vocab_size)
    inside = scan.completes_inside(m.state)
    assert inside and not inside & allowed  # e.g. ">\n": the marker would end mid-token
    assert not m.accept_token(next(iter(inside)))
    assert m.accept_token(_ids(tokenizer, ">")[0]) and m.phase is Phase.ANSWER


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_forces_the_end_marker_as_exact_ids(xgrammar_backend, tokenizer, scan,
                                                   budget: int) -> None:
    m = _matcher(xgrammar_backend, tokenizer, scan, budget=budget)
    end_ids = _ids(tokenizer, "</think>")
    thought = _ids(tokenizer, "one two three four five six seven")
    assert _accept_all(m, thought[:budget])
    assert m.phase is Phase.CLOSING and m.thinking_tokens == budget
    assert _allowed(m, xgrammar_backend.vocab_size) == {end_ids[0]}  # what a prefill worker samples
    assert not m.accept_token(thought[budget])
    grammar = RequestGrammar(m, xgrammar_backend.vocab_size, [tokenizer.eos_token_id],
                             lambda s: _ids(tokenizer, s))
    forced = grammar.forced_tokens(limit=100)
    # The marker, then the schema's forced text ('{"city":"' less its held-back last token).
    assert forced[: len(end_ids)] == end_ids
    assert tokenizer.decode(forced[len(end_ids):]) == '{"city":"'[: len(tokenizer.decode(
        forced[len(end_ids):]))]
    assert m.phase is Phase.ANSWER


def test_a_decode_worker_replays_the_prefill_workers_first_token(xgrammar_backend, tokenizer,
                                                                 scan) -> None:
    # Budget 1 across the handoff: the first token (sampled on the prefill worker) is replayed
    # into a fresh matcher on the decode worker, which then forces the marker.
    prefill = _matcher(xgrammar_backend, tokenizer, scan, budget=1)
    first = _ids(tokenizer, "Let")[0]
    assert first in _allowed(prefill, xgrammar_backend.vocab_size) and prefill.accept_token(first)
    decode = _matcher(xgrammar_backend, tokenizer, scan, budget=1)
    assert decode.accept_token(first)
    assert decode.forced_token_ids() == prefill.forced_token_ids() == _ids(tokenizer, "</think>")


def test_prompt_that_does_not_open_the_block(llguidance_backend, tokenizer, scan) -> None:
    # A regex whose first token is the start marker's too ("<"): both readings live on.
    regex = "<b>[a-z]+</b>"
    m = _matcher(llguidance_backend, tokenizer, scan, "regex", regex, opened=False)
    assert m.phase is Phase.START
    lt = _ids(tokenizer, "<think>")[0]
    assert lt == _ids(tokenizer, "<b>")[0]
    assert m.accept_token(lt) and m.phase is Phase.START and m.inner_alive
    assert _accept_all(m, _ids(tokenizer, "<think>")[1:]) and m.phase is Phase.THINKING
    assert _accept_all(m, _ids(tokenizer, "plan</think>")) and m.phase is Phase.ANSWER
    assert _accept_all(m, _ids(tokenizer, "<b>ok</b>")) and m.can_end()
    # No thinking: the constraint's reading wins at its second token.
    m = _matcher(llguidance_backend, tokenizer, scan, "regex", regex, opened=False)
    assert _accept_all(m, _ids(tokenizer, "<b>ok</b>")) and m.phase is Phase.ANSWER
    assert m.can_end()


def test_rollback_crosses_the_start_marker(llguidance_backend, tokenizer, scan) -> None:
    m = _matcher(llguidance_backend, tokenizer, scan, "regex", "<b>[a-z]+</b>", opened=False)
    start = _ids(tokenizer, "<think>")
    rest = _ids(tokenizer, "x</think>") + _ids(tokenizer, "<b>")  # not "><": ends mid-token
    assert _accept_all(m, start + rest)
    assert m.phase is Phase.ANSWER
    m.rollback(len(start) + len(rest) - 1)  # back to after "<"
    assert m.phase is Phase.START and m.pos == 1 and m.inner_alive
    assert _accept_all(m, _ids(tokenizer, "<b>ok</b>")[1:]) and m.can_end()  # the inner's "<"
    twin = m.copy()
    assert twin.phase is m.phase and twin.can_end()


def test_free_text_after_the_block_and_end_inside_it(xgrammar_backend, tokenizer, scan) -> None:
    eos = tokenizer.eos_token_id
    m = _matcher(xgrammar_backend, tokenizer, scan, kind=None, budget=2)
    assert eos in _allowed(m, xgrammar_backend.vocab_size)  # without a constraint it may end
    assert _accept_all(m, _ids(tokenizer, "a b") + _ids(tokenizer, "</think>"))
    assert m.phase is Phase.ANSWER and m.can_end()
    assert _accept_all(m, _ids(tokenizer, "Paris")) and m.accept_token(eos) and m.is_terminated()
    m.reset()
    assert m.phase is Phase.THINKING and m.accept_token(eos) and m.is_terminated()
