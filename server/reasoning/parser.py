"""A reasoning model's answer text -> (reasoning, content), incrementally, exact at any chunking.

One :class:`ReasoningParser` per choice. :meth:`~ReasoningParser.feed` takes the detokenized
text as it arrives and returns the ``(reasoning_delta, content_delta)`` it makes final;
:meth:`~ReasoningParser.finish` returns what was held back. The deltas of any split of a text
join to exactly the deltas of the whole text fed at once (:func:`split_reasoning`), because
every decision depends only on the text so far and text is held back only while it might still
be part of a marker: a partial end marker inside the thinking (``</thi``), a partial start
marker at the very start of the answer, and the whitespace right after the end marker (which
is no part of the content: ``</think>\\n\\nParis`` is content ``Paris``, as DeepSeek's API
answers it).

Where the answer starts (``PromptThinking`` of the rendered prompt):

- OPEN: inside the thinking. A start marker the model writes again first is dropped (some
  DeepSeek-R1 distills do).
- NONE: the model may open the block as the first thing it writes (after whitespace);
  otherwise the whole answer is content, byte for byte.
- CLOSED: the whole answer is content (no parser needed, but it is exact too).

An answer cut inside the thinking is all reasoning (its content empty), as vLLM reads it.

Reference: vLLM ``vllm/reasoning/basic_parsers.py`` (``BaseThinkingReasoningParser``); its
streaming variant looks at token ids, ours at text, so it works where the markers are several
tokens too.
"""

from __future__ import annotations

import enum

from splitserve.server.reasoning.formats import PromptThinking, ReasoningFormat

_WS = " \t\r\n"


class _State(enum.Enum):
    LEAD = "lead"  # the answer's start: a start marker may come (after whitespace)
    REASONING = "reasoning"  # inside the think block
    AFTER_END = "after_end"  # right after the end marker: whitespace is dropped
    CONTENT = "content"  # the answer proper


class ReasoningParser:
    """Splits one answer into reasoning and content.

    Args:
        fmt: the markers.
        thinking: where the rendered prompt leaves the block (``fmt.prompt_thinking``).
    """

    def __init__(self, fmt: ReasoningFormat, thinking: PromptThinking) -> None:
        self.fmt = fmt
        self.starts_inside = thinking is PromptThinking.OPEN
        self._state = _State.CONTENT if thinking is PromptThinking.CLOSED else _State.LEAD
        self._buf = ""
        self.reasoning = ""  # what has been made final so far, for callers that want it whole
        self.content = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the think block."""
        return self._state is _State.REASONING or (self._state is _State.LEAD
                                                    and self.starts_inside)

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning_delta, content_delta)`` made final by ``text`` (appended to what came
        before); either may be empty."""
        self._buf += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return self._out(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """``(reasoning_delta, content_delta)`` of what is still held at the end of the answer:
        a partial marker is text of the part it was found in."""
        reasoning, content = [], []
        buf, self._buf = self._buf, ""
        if self._state is _State.LEAD:
            (reasoning if self.starts_inside else content).append(buf)
        elif self._state is _State.REASONING:
            reasoning.append(buf)
        elif self._state is _State.CONTENT:
            content.append(buf)
        return self._out(reasoning, content)

    def _out(self, reasoning: list[str], content: list[str]) -> tuple[str, str]:
        r, c = "".join(reasoning), "".join(content)
        self.reasoning += r
        self.content += c
        return r, c

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current state can; False when it needs more text."""
        buf, fmt = self._buf, self.fmt
        if self._state is _State.LEAD:
            body = buf.lstrip(_WS)
            if body.startswith(fmt.start):
                self._buf = body[len(fmt.start):]
                self._state = _State.REASONING
                return True
            if fmt.start.startswith(body):
                return False  # whitespace, or a start marker so far: wait
            self._state = _State.REASONING if self.starts_inside else _State.CONTENT
            return True
        if self._state is _State.REASONING:
            at = buf.find(fmt.end)
            if at >= 0:
                reasoning.append(buf[:at])
                self._buf = buf[at + len(fmt.end):]
                self._state = _State.AFTER_END
                return True
            keep = _partial_suffix(buf, fmt.end)
            reasoning.append(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if self._state is _State.AFTER_END:
            body = buf.lstrip(_WS)
            self._buf = body
            if not body:
                return False
            self._state = _State.CONTENT
            return True
        content.append(buf)
        self._buf = ""
        return False


def split_reasoning(text: str, fmt: ReasoningFormat,
                    thinking: PromptThinking) -> tuple[str, str]:
    """The whole answer's ``(reasoning, content)``: exactly what streaming it would deliver."""
    parser = ReasoningParser(fmt, thinking)
    parser.feed(text)
    parser.finish()
    return parser.reasoning, parser.content


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that ``marker`` starts with (short of all of it)."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0
