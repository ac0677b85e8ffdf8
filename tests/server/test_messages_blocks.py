"""``BlockStream``: ``(reasoning, content)`` pairs -> Anthropic content-block events, and those
gathered into the full answer's blocks. Checked at every chunk boundary: however the model's
text is split into pieces, the blocks are the same, and no call markup reaches a text delta."""

from __future__ import annotations

import pytest

from splitserve.server.messages_api.blocks import BlockStream, gather_blocks
from splitserve.server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL

ANSWERS = {
    HERMES: ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
             'ris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
             "</tool_call>"),
    LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\""}}',
    MISTRAL: ('Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
}
WANT = {
    HERMES: [{"type": "text", "text": "Let me look."},
             ("get_weather", {"city": "Paris"}), ("get_time", {})],
    LLAMA3_JSON: [("get_weather", {"city": 'Paris, "FR"'})],
    MISTRAL: [{"type": "text", "text": "Sure"},
              ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
}


def _run(fmt, pieces: list[tuple[str, str]]) -> list[dict]:
    stream = BlockStream(fmt)
    events = []
    for reasoning, content in pieces:
        events += stream.feed(content, reasoning)
    return events + stream.finish()


def _shape(blocks: list[dict]) -> list:
    """Blocks with tool_use ids left out (fresh per answer)."""
    return [(b["name"], b["input"]) if b["type"] == "tool_use" else b for b in blocks]


def _check_events(events: list[dict]) -> None:
    """Each block opens, gets deltas of its own kind, closes, in index order."""
    delta_kind = {"text": "text_delta", "thinking": "thinking_delta",
                  "tool_use": "input_json_delta"}
    open_block, next_index = None, 0
    for ev in events:
        if ev["type"] == "content_block_start":
            assert open_block is None and ev["index"] == next_index
            open_block, next_index = ev["content_block"]["type"], next_index + 1
        elif ev["type"] == "content_block_delta":
            assert ev["index"] == next_index - 1 and ev["delta"]["type"] == delta_kind[open_block]
        else:
            assert ev == {"type": "content_block_stop", "index": next_index - 1}
            open_block = None
    assert open_block is None


@pytest.mark.parametrize("fmt", list(ANSWERS), ids=lambda f: f.name)
def test_every_split_gives_the_same_blocks(fmt) -> None:
    text = ANSWERS[fmt]
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]],
                       [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            events = _run(fmt, [("", p) for p in pieces])
            _check_events(events)
            assert _shape(gather_blocks(events)) == WANT[fmt], (cut, pieces)
            texts = "".join(e["delta"].get("text", "") for e in events
                            if e["type"] == "content_block_delta")
            assert "tool_call" not in texts.lower() and '"name"' not in texts


def test_character_by_character() -> None:
    text = ANSWERS[HERMES]
    events = _run(HERMES, [("", ch) for ch in text])
    _check_events(events)
    assert _shape(gather_blocks(events)) == WANT[HERMES]


def test_reasoning_then_content_are_a_thinking_block_then_text() -> None:
    events = _run(None, [("Let me ", ""), ("think.", "The"), ("", " answer"), ("", "."),
                         ("More?", "!")])
    _check_events(events)
    assert gather_blocks(events) == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "The answer."},
        {"type": "thinking", "thinking": "More?", "signature": ""},
        {"type": "text", "text": "!"}]


def test_thinking_before_a_call() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    events = _run(HERMES, [("I will call f.", ""), ("", call[:20]), ("", call[20:])])
    assert _shape(gather_blocks(events)) == [
        {"type": "thinking", "thinking": "I will call f.", "signature": ""}, ("f", {"x": 1})]


def test_a_call_cut_off_in_its_input_keeps_its_name_with_no_input() -> None:
    events = _run(HERMES, [("", '<tool_call>\n{"name": "f", "arguments": {"x": ')])
    assert _shape(gather_blocks(events)) == [("f", {})]
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            ] == ['{"x": ']  # the fragment the model wrote still streams
