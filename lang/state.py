"""``ProgramState``: the ``s`` a program appends to.

Appending is asynchronous: ``s += ...`` queues nodes and returns, and a worker thread of the
state runs them in order (``lang.interpreter``). Reading (``s["x"]``, ``s.text()``) waits for
what it needs. That is what lets fork branches run in parallel with a plain ``for`` loop, and
``text_iter()`` stream while the program is still running.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

from splitserve.lang.backend import BaseBackend, ChatPrompt, Prompt, SamplingArgs, TextPrompt
from splitserve.lang.chat_template import ChatTemplate
from splitserve.lang.errors import BackendError, ProgramError
from splitserve.lang.ir import Gen, Node, RoleBegin, RoleEnd, Select, flatten
from splitserve.lang.primitives import assistant, system, user
from splitserve.lang.tool_calls import ToolCall


@dataclass(slots=True)
class RunContext:
    """What every state of one program run shares."""

    backend: BaseBackend
    program: str
    defaults: SamplingArgs
    stream: bool = False
    warm_forks: bool = True  # send a fork's shared prefix once before its branches
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None  # the program's own failure (stream mode)
    return_value: Any = None  # what the program function returned
    states: list[ProgramState] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class StepFailed(Exception):
    """Raised by the interpreter for a step that cannot run (e.g. text outside a role)."""


class ProgramState:
    """The state of one program run (or one fork branch of it)."""

    def __init__(self, ctx: RunContext, branch: str = "") -> None:
        self._ctx = ctx
        self._branch = branch
        self._cond = threading.Condition()
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._text = ""  # plain-text programs
        self._uses_roles = False
        self._closed: list[dict[str, Any]] = []  # role programs: finished messages
        self._open: tuple[str, str] | None = None  # role programs: (role, content so far)
        self._open_fields: dict[str, Any] = {}  # the open message's tool_calls / tool_call_id
        self._uses_tools = False  # the history holds tool turns: chat messages from here on
        self._calls: dict[str, list[ToolCall]] = {}
        self._reasoning: dict[str, str | None] = {}
        self._pending: deque[tuple[int, Node]] = deque()
        self._current: Node | None = None  # the step running now
        self._running = False
        self._num_steps = 0
        self._error: ProgramError | None = None
        self._log: list[tuple[str | None, str]] = []  # (variable or None, text delta)
        self._rendered = ""
        with ctx.lock:
            ctx.states.append(self)

    # ---- appending ----------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> Self:
        nodes = flatten(other)
        with self._cond:
            if self._error is not None:
                raise self._error
            for node in nodes:
                self._pending.append((self._num_steps, node))
                self._num_steps += 1
            if nodes and not self._running:
                self._running = True
                threading.Thread(target=self._drain, daemon=True,
                                 name=f"lang-{self._ctx.program}").start()
        return self

    def _drain(self) -> None:
        from splitserve.lang.interpreter import execute  # the interpreter imports this module

        while True:
            with self._cond:
                if not self._pending or self._error is not None:
                    self._pending.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                index, node = self._pending.popleft()
                self._current = node
            try:
                execute(self, node)
            except Exception as exc:  # noqa: BLE001 - any step failure is recorded, then raised to the program
                err = ProgramError(self._ctx.program, f"{type(exc).__name__}: {exc}",
                                   step_index=index, step=node.describe(), branch=self._branch)
                err.__cause__ = exc
                with self._cond:
                    self._error = err
            with self._cond:
                self._current = None
                self._cond.notify_all()

    def _sync(self) -> None:
        """Wait until every queued step ran. Raises the first step's error, if any."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            if self._error is not None:
                raise self._error

    # ---- roles --------------------------------------------------------------------------------

    def system(self, content: Any = None) -> _RoleScope | None:
        """Append a system message, or with no content open one: ``with s.system(): ...``."""
        return self._role("system", system, content)

    def user(self, content: Any = None) -> _RoleScope | None:
        return self._role("user", user, content)

    def assistant(self, content: Any = None) -> _RoleScope | None:
        return self._role("assistant", assistant, content)

    def _role(self, role: str, wrap: Any, content: Any) -> _RoleScope | None:
        if content is None:
            return _RoleScope(self, role)
        self += wrap(content)
        return None

    # ---- reading ------------------------------------------------------------------------------

    def _will_set(self, name: str) -> bool:
        """Whether a queued or running step captures ``name`` (call holding ``_cond``)."""
        steps = [n for _, n in self._pending] + [self._current]
        return any(isinstance(n, (Gen, Select)) and n.name == name for n in steps)

    def __getitem__(self, name: str) -> Any:
        """The value captured as ``name`` by the last step appended that captures it (a name
        generated again in a loop gives the new value); waits for that step."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self._will_set(name))
            if name in self._vars:
                return self._vars[name]
            if self._error is not None:
                raise self._error
            raise KeyError(f"no variable {name!r} was captured (have: {sorted(self._vars)})")

    def tool_calls(self, name: str) -> list[ToolCall]:
        """The calls the model made in ``gen(name, tools=...)`` (empty: it answered in text);
        waits for that step.

        Raises:
            KeyError: ``name`` was not captured by a gen with tools.
        """
        self[name]  # waits for the step (and raises its error)
        with self._cond:
            if name not in self._calls:
                raise KeyError(f"{name!r} was not generated with tools=[...]")
            return list(self._calls[name])

    def reasoning(self, name: str) -> str | None:
        """The thinking of ``gen(name, reasoning=True)``, apart from its answer ``s[name]``
        (None: the server split none off); waits for that step.

        Raises:
            KeyError: ``name`` was not captured by a gen with ``reasoning=True``.
        """
        self[name]  # waits for the step (and raises its error)
        with self._cond:
            if name not in self._reasoning:
                raise KeyError(f"{name!r} was not generated with reasoning=True")
            return self._reasoning[name]

    def __contains__(self, name: str) -> bool:
        self._sync()
        return name in self._vars

    def variables(self) -> dict[str, Any]:
        self._sync()
        return dict(self._vars)

    def meta(self, name: str) -> dict[str, Any]:
        """What the server reported for step ``name``: usage and ``finish_reason`` for a gen,
        ``scores`` (normalized), ``sums`` and ``num_tokens`` for a select."""
        self._sync()
        return self._meta[name]

    def text(self) -> str:
        """The whole prompt so far, as the model sees it (roles rendered by the template)."""
        self._sync()
        return self.render()

    def messages(self) -> list[dict[str, Any]]:
        """The role messages so far (an open one included, with its content so far), in
        OpenAI's shape: an assistant turn that called tools has ``tool_calls``, a tool turn its
        ``tool_call_id``."""
        self._sync()
        return self._all_messages()

    def _all_messages(self) -> list[dict[str, Any]]:
        msgs = [dict(m) for m in self._closed]
        if self._open is not None:
            msgs.append({"role": self._open[0], "content": self._open[1], **self._open_fields})
        return msgs

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Yield the text as it is produced (all of it, or only variable ``name``'s), until the
        program and this state are done. Raises the program's error at the end, if any."""
        pos = 0
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda seen=pos: len(self._log) > seen or self._is_done(), timeout=0.1)
                items, pos = self._log[pos:], len(self._log)
                done = self._is_done() and not items
            for var, delta in items:
                if name is None or var == name:
                    yield delta
            if done:
                break
        self._sync()
        if self._ctx.error is not None:
            raise self._ctx.error

    def _is_done(self) -> bool:
        return (self._ctx.done.is_set() and not self._running) or self._error is not None

    # ---- forks --------------------------------------------------------------------------------

    def fork(self, n: int) -> ForkGroup:
        """``n`` copies of this state that continue independently and run in parallel. Their
        shared prefix (this state's prompt) is sent once first, so the prefix cache serves it."""
        if n < 1:
            raise ValueError("fork needs n >= 1")
        self._sync()
        at = self._num_steps
        children = []
        for i in range(n):
            child = ProgramState(self._ctx, f"{self._branch}fork@{at}[{i}]")
            child._copy_from(self)
            children.append(child)
        if n > 1 and self._ctx.warm_forks:
            prompt = self.prefix_prompt()
            if prompt is not None:
                try:
                    self._ctx.backend.prefill(prompt)
                except BackendError as exc:
                    raise ProgramError(self._ctx.program, f"BackendError: {exc}", step_index=at,
                                       step=f"fork({n})", branch=self._branch) from exc
        return ForkGroup(children)

    def join(self, forks: list[ProgramState]) -> list[ProgramState]:
        """Wait for every branch; raises the first branch error."""
        for f in forks:
            f._sync()
        return list(forks)

    def _copy_from(self, other: ProgramState) -> None:
        self._vars = dict(other._vars)
        self._meta = dict(other._meta)
        self._text, self._uses_roles = other._text, other._uses_roles
        self._closed, self._open = list(other._closed), other._open
        self._open_fields, self._uses_tools = dict(other._open_fields), other._uses_tools
        self._calls = dict(other._calls)
        self._reasoning = dict(other._reasoning)
        self._rendered = other._rendered

    # ---- used by the interpreter --------------------------------------------------------------

    @property
    def return_value(self) -> Any:
        """What the program function returned (e.g. its fork branches)."""
        self._sync()
        return self._ctx.return_value

    @property
    def ctx(self) -> RunContext:
        return self._ctx

    def template(self) -> ChatTemplate | None:
        return self._ctx.backend.chat_template() if self._uses_roles else None

    def render(self) -> str:
        if not self._uses_roles:
            return self._text
        tmpl = self.template()
        if tmpl is None:  # chat-messages backend: a readable transcript
            text = "".join(_transcript_line(m) for m in self._all_messages())
            # The open message has no newline yet, so the transcript only ever grows at its end
            # (text_iter streams it as deltas).
            return text[:-1] if self._open is not None else text
        if self._open is not None:
            return tmpl.render_open(self._closed, *self._open)
        return tmpl.render(self._closed)

    def prompt(self) -> Prompt:
        """What the next gen/select continues: text through the chat template, or chat
        messages when the backend has no template or the history holds tool turns (only the
        server renders those as the model was trained to read them).

        Raises:
            StepFailed: chat messages cannot continue this (see message).
        """
        if not self._uses_roles:
            return TextPrompt(self._text)
        if self.template() is not None and not self._uses_tools:
            return TextPrompt(self.render(), templated=True)
        if (self._open is not None and self._open[0] == "assistant" and self._open[1]
                and self._ctx.backend.continues_assistant):
            # The text so far goes as the last, open assistant message (prefill).
            return ChatPrompt([*(_chat_message(m) for m in self._closed),
                               {"role": "assistant", "content": self._open[1]}])
        why = ("this program's history holds tool calls" if self._uses_tools else
               "this backend takes chat messages (no chat template)")
        return self.chat_prompt(why)

    def chat_prompt(self, why: str) -> ChatPrompt:
        """The closed messages, for a gen that opens an assistant message.

        Raises:
            StepFailed: the program is not at the start of an assistant message (``why``
                says why chat messages are needed).
        """
        if not self._uses_roles:
            raise StepFailed(f"{why}, so it needs a role program: put the gen in "
                             "lang.assistant(...)")
        if self._open is None or self._open[0] != "assistant" or self._open[1]:
            raise StepFailed(f"{why}, so gen must come first in an assistant message: it "
                             "cannot continue text inside a message")
        return ChatPrompt([_chat_message(m) for m in self._closed])

    def prefix_prompt(self) -> Prompt | None:
        """The prompt for warming the cache, or None when there is nothing to send."""
        try:
            prompt = self.prompt()
        except StepFailed:
            return ChatPrompt([_chat_message(m) for m in self._closed]) if self._closed else None
        return prompt if not isinstance(prompt, TextPrompt) or prompt.text else None

    def set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            with self._cond:
                self._vars[name] = value
                self._meta[name] = meta
                self._cond.notify_all()

    def set_tool_calls(self, name: str | None, calls: list[ToolCall]) -> None:
        """Attach ``calls`` to the open assistant message (before :meth:`set_var` of ``name``,
        so a reader of ``name`` sees them)."""
        if calls:
            self._open_fields["tool_calls"] = [c.as_openai() for c in calls]
            self._uses_tools = True
        if name is not None:
            with self._cond:
                self._calls[name] = list(calls)

    def set_reasoning(self, name: str | None, reasoning: str | None) -> None:
        """Record the thinking of step ``name`` (before :meth:`set_var` of ``name``)."""
        if name is not None:
            with self._cond:
                self._reasoning[name] = reasoning

    def apply_text(self, text: str, var: str | None = None) -> None:
        """Append ``text`` to the prompt (inside the open message in a role program)."""
        if self._uses_roles:
            if self._open is None:
                raise StepFailed("text outside a role: in a program that uses roles, put all "
                                 "text inside system/user/assistant")
            self._open = (self._open[0], self._open[1] + text)
        else:
            self._text += text
        self._log_change(var)

    def apply_role(self, node: RoleBegin | RoleEnd) -> None:
        if isinstance(node, RoleBegin):
            if self._open is not None:
                raise StepFailed(f"cannot begin {node.role}: the {self._open[0]} message is open")
            if not self._uses_roles and self._text:
                raise StepFailed("text before the first role: in a program that uses roles, "
                                 "put all text inside system/user/assistant")
            self._uses_roles = True
            self._open = (node.role, "")
            self._open_fields = {}
            if node.role == "tool":
                self._open_fields["tool_call_id"] = node.tool_call_id
                self._uses_tools = True
        else:
            if self._open is None or self._open[0] != node.role:
                raise StepFailed(f"end {node.role} without an open {node.role} message")
            self._closed.append({"role": node.role, "content": self._open[1],
                                 **self._open_fields})
            self._open, self._open_fields = None, {}
        self._log_change(None)

    def _log_change(self, var: str | None) -> None:
        new = self.render()
        # Templates render append-only as messages grow, so the delta is the new suffix.
        delta = new[len(self._rendered):]
        self._rendered = new
        if delta:
            with self._cond:
                self._log.append((var, delta))
                self._cond.notify_all()

    def __repr__(self) -> str:
        return f"ProgramState(program={self._ctx.program!r}, branch={self._branch!r})"


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message: an assistant turn that only called tools has ``content: null``."""
    if message.get("tool_calls") and not message["content"]:
        return {**message, "content": None}
    return dict(message)


def _transcript_line(message: dict[str, Any]) -> str:
    calls = "".join(f" [call {c['function']['name']}({c['function']['arguments']})]"
                    for c in message.get("tool_calls") or [])
    return f"{message['role']}: {message['content']}{calls}\n"


class ForkGroup(list):
    """The branches of ``s.fork(n)``; ``join()`` waits for all of them."""

    def __iadd__(self, other: Any) -> Self:  # type: ignore[override]
        """``forks += ...`` appends to every branch (not list extension)."""
        for f in self:
            f += other
        return self

    def join(self) -> list[ProgramState]:
        for f in self:
            f._sync()
        return list(self)


class _RoleScope:
    """``with s.user(): ...``: begins the role on enter, ends it on exit."""

    def __init__(self, state: ProgramState, role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> ProgramState:
        self.state += RoleBegin(self.role)
        return self.state

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.state += RoleEnd(self.role)
