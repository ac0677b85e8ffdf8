"""Stop strings: the cut, the streaming hold-back, several stops, stops spanning tokens."""

from __future__ import annotations

import random

import pytest

from splitserve.server.detokenizer import IncrementalDetokenizer
from splitserve.server.stop_strings import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Feed ``pieces``; flush unless stopped. Returns what was emitted per piece (+ flush)."""
    m = StopStringMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return out, m.stopped


def expected(text: str, stops: list[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(cuts)] if cuts else text


def test_cut_before_first_occurrence() -> None:
    out, stopped = run(["END"], ["one END two END"])
    assert "".join(out) == "one " and stopped


def test_no_match_passes_everything() -> None:
    out, stopped = run(["zzz"], ["hello ", "world"])
    assert out == ["hello ", "world", ""] and not stopped


def test_partial_stop_is_held_back_char_by_char() -> None:
    text = "Hello STOP world"
    m = StopStringMatcher(["STOP"])
    emitted = ""
    for ch in text:
        emitted += m.feed(ch)
        assert "S" not in emitted  # no prefix of "STOP" ever leaks
    assert emitted == "Hello " and m.stopped and m.flush() == ""


def test_false_alarm_is_released() -> None:
    out, stopped = run(["STOP"], ["a ST", "O", "rm", " ST"])
    assert out == ["a ", "", "STOrm", " ", "ST"] and not stopped


def test_earliest_of_several_stops_wins() -> None:
    out, _ = run(["world", "lo"], ["hel", "lo wor", "ld"])
    assert "".join(out) == "hel"
    out, _ = run(["ab", "b"], ["xab"])
    assert "".join(out) == "x"


def test_empty_stop_string_is_ignored() -> None:
    out, stopped = run(["", "!"], ["hi", "!"])
    assert "".join(out) == "hi" and stopped


def test_nothing_after_stop() -> None:
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == "a"
    assert m.feed("more") == "" and m.flush() == ""


@pytest.mark.parametrize("seed", range(30))
def test_streaming_equals_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 40)))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(3)]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(5, len(text) + 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, _ = run(stops, pieces)
    assert "".join(out) == expected(text, stops)
    # Whatever was emitted so far is always a prefix of the final answer.
    assert expected(text, stops).startswith("".join(out[:-1]))


def test_stop_spanning_tokens(tokenizer) -> None:
    text = "héllo 世界 🚀 and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ["世界", "🚀", "lo 世"]:
        det, m = IncrementalDetokenizer(tokenizer), StopStringMatcher([stop])
        emitted = ""
        for tok in ids:
            emitted += m.feed(det.push([tok]))
            if m.stopped:
                break
        assert m.stopped and emitted == text[: text.index(stop)], stop
