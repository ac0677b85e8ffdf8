"""One answer's text -> its output items, and the streamed events that build them.

:class:`OutputBuilder` is fed the answer as it comes, as pairs of deltas (the thinking and the
visible text; a model without a reasoning parser only ever has text) and returns the events
those deltas make, in OpenAI's order; the items it built are :attr:`OutputBuilder.items`. The
non-streamed answer is the same builder with its events dropped, so a streamed answer
reassembles to exactly the stored one.

- thinking -> one ``reasoning`` item (``response.reasoning_text.delta``), closed when the
  visible answer starts;
- text -> an assistant ``message`` item with one ``output_text`` part
  (``response.output_text.delta``, with each delta's tokens' logprobs when asked);
- with tools, the text goes through the chat path's call extractor (``server.tools.extract``):
  each call is a ``function_call`` item (``response.function_call_arguments.delta``), text
  between calls a message item of its own; no call markup reaches the text.

Every item opens with ``response.output_item.added`` (and ``response.content_part.added``) and
closes with its ``.done`` events and ``response.output_item.done``. Events here carry no
``sequence_number``: the stream numbers them (``server.responses_api.run``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.server.responses_api import items
from splitserve.server.tools.events import ToolEvent
from splitserve.server.tools.formats import ToolCallFormat
from splitserve.server.tools.parsers import create_parser

Event = dict[str, Any]


@dataclass(slots=True)
class _OpenItem:
    """The item being written: its kind, place, id and what it holds so far."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int
    item_id: str
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    namespace: str | None = None


class OutputBuilder:
    """Builds one answer's output items and events.

    Args:
        tool_format: the call envelope to parse out of the text (None: the text is all
            message; no tools, or ``tool_choice`` none).
        logprobs: whether text deltas carry their tokens' logprobs.
        split_name: the called name as ``(namespace, name)`` (default: no namespace).
        functions: name -> ``parameters`` of the request's functions (the XML and pythonic
            formats read calls by them: ``server.tools.parsers.create_parser``).
    """

    def __init__(self, tool_format: ToolCallFormat | None, logprobs: bool = False,
                 split_name: Callable[[str], tuple[str | None, str]] | None = None,
                 functions: dict[str, dict[str, Any]] | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self.logprobs = logprobs
        self._split_name = split_name or (lambda name: (None, name))
        self._calls = (create_parser(tool_format, functions) if tool_format is not None
                       else None)
        self._open: _OpenItem | None = None

    @property
    def made_calls(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    def feed(self, text: str, reasoning: str = "",
             logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """The events of the next deltas: ``reasoning`` (thinking) comes before ``text`` (the
        visible answer); ``logprobs``: the logprobs of the tokens that brought ``text``."""
        events: list[Event] = []
        if reasoning:
            events += self._write("reasoning", reasoning)
        if text or (logprobs and self.logprobs and self._calls is None):
            # Tokens whose text is held back (a split character, the end-of-text token) still
            # bring their logprobs, in a delta of no text, as chat's chunks carry them.
            if self._calls is None:
                events += self._write("message", text, logprobs)
            else:
                for ev in self._calls.feed(text):
                    events += self._tool_event(ev)
        return events

    def finish(self, truncated: bool) -> list[Event]:
        """The events that close the answer: what the extractor held back, then the open item
        (``incomplete`` when ``truncated``: cut by ``max_output_tokens``). An answer with no
        item at all gets an empty message, so ``output`` always says what was answered."""
        events: list[Event] = []
        if self._calls is not None:
            for ev in self._calls.finish(cut=truncated):
                events += self._tool_event(ev)
        if not self.items and self._open is None:
            events += self._start("message")
        events += self._close("incomplete" if truncated else "completed")
        return events

    # ---- items -----------------------------------------------------------------------------

    def _tool_event(self, ev: ToolEvent) -> list[Event]:
        if ev.content is not None:
            return self._write("message", ev.content)
        if ev.name is not None:
            assert ev.call_id is not None
            events = self._close("completed")
            return events + self._start("function_call", call_id=ev.call_id, name=ev.name)
        assert self._open is not None and self._open.kind == "function_call", ev
        self._open.text += ev.arguments or ""
        return [{"type": "response.function_call_arguments.delta",
                 "item_id": self._open.item_id, "output_index": self._open.index,
                 "delta": ev.arguments or ""}]

    def _write(self, kind: str, text: str,
               logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """``text`` into an item of ``kind``: the open one, or a new one after closing it."""
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close("completed")
            events += self._start(kind)
        item = self._open
        assert item is not None
        item.text += text
        delta: Event = {"item_id": item.item_id, "output_index": item.index,
                        "content_index": 0, "delta": text}
        if kind == "reasoning":
            return [*events, {"type": "response.reasoning_text.delta", **delta}]
        lps = (logprobs or []) if self.logprobs else []
        item.logprobs += lps
        return [*events, {"type": "response.output_text.delta", **delta, "logprobs": lps}]

    def _start(self, kind: str, call_id: str = "", name: str = "") -> list[Event]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        namespace, name = self._split_name(name) if name else (None, name)
        item = _OpenItem(kind, len(self.items), items.new_id(prefix), call_id=call_id, name=name,
                         namespace=namespace)
        self._open = item
        self.items.append(self._item(item, "in_progress"))
        events: list[Event] = [{"type": "response.output_item.added", "output_index": item.index,
                                "item": self._shell(item)}]
        part = self._part(item, empty=True)
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item.item_id,
                           "output_index": item.index, "content_index": 0, "part": part})
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        done = self._item(item, status)
        self.items[item.index] = done
        where = {"item_id": item.item_id, "output_index": item.index}
        events: list[Event] = []
        if item.kind == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item.name, "arguments": item.text})
        else:
            text_done: Event = {"type": ("response.reasoning_text.done" if item.kind == "reasoning"
                                         else "response.output_text.done"),
                                **where, "content_index": 0, "text": item.text}
            if item.kind == "message":
                text_done["logprobs"] = item.logprobs
            events += [text_done, {"type": "response.content_part.done", **where,
                                   "content_index": 0, "part": self._part(item)}]
        events.append({"type": "response.output_item.done", "output_index": item.index,
                       "item": done})
        return events

    # ---- shapes ----------------------------------------------------------------------------

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        if item.kind == "function_call":
            return items.function_call(item.item_id, item.call_id, item.name, item.text, status,
                                       item.namespace)
        if item.kind == "reasoning":
            return items.reasoning(item.item_id, item.text, status)
        return items.message(item.item_id, item.text, status, item.logprobs)

    def _shell(self, item: _OpenItem) -> dict[str, Any]:
        """The item as ``output_item.added`` shows it: in progress, nothing written yet."""
        shell = self._item(item, "in_progress")
        if item.kind != "function_call":
            shell["content"] = []
        return shell

    def _part(self, item: _OpenItem, empty: bool = False) -> dict[str, Any] | None:
        if item.kind == "function_call":
            return None
        text = "" if empty else item.text
        if item.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return items.text_part(text, [] if empty else item.logprobs)
