"""The reasoning parser (``server.reasoning``): where a rendered prompt leaves the think block,
the split of whole answers, and streaming split at every position of each reference answer
reassembling to exactly the whole answer's split, with no marker in any delta."""

from __future__ import annotations

import pytest

from splitserve.server.reasoning import (
    EFFORT_BUDGETS,
    NO_BUDGET,
    PromptThinking,
    ReasoningParser,
    detect_reasoning_format,
    split_reasoning,
    thinking_budget,
)
from splitserve.server.reasoning.formats import DEEPSEEK_R1, QWEN3

OPEN, NONE, CLOSED = PromptThinking.OPEN, PromptThinking.NONE, PromptThinking.CLOSED

CASES = [
    # (format, where the prompt leaves the block, answer, reasoning, content)
    (QWEN3, OPEN, "Let me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
    (QWEN3, NONE, "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    (QWEN3, NONE, "  <think>a</think>b", "a", "b"),
    (QWEN3, NONE, "Paris, no thinking.", "", "Paris, no thinking."),
    (QWEN3, NONE, "<thin is no marker", "", "<thin is no marker"),
    (QWEN3, NONE, "\n\nParis.", "", "\n\nParis."),  # content byte for byte
    (QWEN3, OPEN, "<think>again</think>x", "again", "x"),  # a repeated start marker dropped
    (QWEN3, OPEN, "cut off inside </thi", "cut off inside </thi", ""),
    (QWEN3, OPEN, "a < b </ c</think>{\"x\": 1}", "a < b </ c", '{"x": 1}'),
    (QWEN3, OPEN, "</think>", "", ""),
    (QWEN3, CLOSED, "<think>not thinking</think>x", "", "<think>not thinking</think>x"),
    (QWEN3, OPEN, "x</think>Answer with </think> inside", "x", "Answer with </think> inside"),
    (DEEPSEEK_R1, DEEPSEEK_R1.prompt_thinking("<｜Assistant｜>"), "plan</think>\n\n42", "plan",
     "42"),
]


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), CASES)
def test_whole_answers(fmt, thinking, text: str, reasoning: str, content: str) -> None:
    assert split_reasoning(text, fmt, thinking) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), CASES)
def test_streamed_at_every_split(fmt, thinking, text: str, reasoning: str, content: str) -> None:
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser = ReasoningParser(fmt, thinking)
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(r for r, _ in deltas) == reasoning, pieces
        assert "".join(c for _, c in deltas) == content, pieces
        if text.count(fmt.end) <= 1 and thinking is not CLOSED:  # no marker in any delta
            for r, c in deltas:
                assert fmt.end not in r and fmt.start not in c


def test_prompt_thinking() -> None:
    assert QWEN3.prompt_thinking("<|im_start|>assistant\n<think>\n") is OPEN
    assert QWEN3.prompt_thinking("<|im_start|>assistant\n") is NONE
    # Qwen3's enable_thinking=false writes an empty block into the generation prompt.
    assert QWEN3.prompt_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") is CLOSED
    # An earlier turn's thinking does not open this one.
    assert QWEN3.prompt_thinking("<think>a</think>b<|im_start|>assistant\n") is NONE
    assert DEEPSEEK_R1.prompt_thinking("<｜Assistant｜>") is OPEN


def test_detect_from_the_template() -> None:
    assert detect_reasoning_format("{{ '<think>\\n' }} ... </think>") is QWEN3
    assert detect_reasoning_format("<｜Assistant｜><think>\\n ... </think>") is DEEPSEEK_R1
    assert detect_reasoning_format("{{ message.content }}") is None
    assert detect_reasoning_format(None) is None


def test_budgets() -> None:
    assert thinking_budget(None, None) == NO_BUDGET
    assert thinking_budget(None, None, 77) == 77
    assert thinking_budget("low", None) == EFFORT_BUDGETS["low"] == 1024
    assert thinking_budget("none", None) == 0
    assert thinking_budget(None, 5, 77) == 5
    with pytest.raises(ValueError, match="not both"):
        thinking_budget("low", 5)
