"""``prog.trace(...)``: record a program's IR without calling a model.

The tracer hands the program a :class:`TracerState` with the same API as ``ProgramState``;
appends are recorded, forks record their branches. A model output has no value at trace time,
so the moment the program *uses* one (``if s["x"] == ...``, an f-string, ``s.text()``) the trace
stops there and is marked incomplete: what it holds up to that point is still exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from splitserve.lang.ir import Fork, Join, Node, RoleBegin, RoleEnd, flatten, is_model_call
from splitserve.lang.primitives import assistant, system, user


class StopTracing(Exception):
    """The program used a value only a model run can produce."""


class TracedValue:
    """A placeholder for ``s[name]``: any use of it stops the trace."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _stop(self, *_: Any) -> Any:
        raise StopTracing(f"the program uses the value of {self.name!r}")

    __str__ = __repr__ = __format__ = __add__ = __radd__ = __eq__ = __ne__ = _stop
    __bool__ = __int__ = __float__ = __len__ = __iter__ = __contains__ = __getitem__ = _stop
    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class Trace:
    """The recorded IR. ``complete`` is False when tracing stopped at ``stopped_at`` (why)."""

    nodes: list[Node]
    complete: bool = True
    stopped_at: str | None = None

    def constant_prefix(self) -> list[Node]:
        """The nodes before the first model call: text and roles every run sends first."""
        out = []
        for node in self.nodes:
            if is_model_call(node):
                break
            out.append(node)
        return out


class TracerState:
    """Records what a program appends. Mirrors ``ProgramState``'s API."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    def __iadd__(self, other: Any) -> Self:
        self.nodes.extend(flatten(other))
        return self

    def __getitem__(self, name: str) -> TracedValue:
        return TracedValue(name)

    def _stop(self, *_: Any, **__: Any) -> Any:
        raise StopTracing("the program reads its state (text/messages/meta)")

    text = messages = meta = variables = text_iter = _stop

    def system(self, content: Any = None) -> _TraceRole | None:
        return self._role("system", system, content)

    def user(self, content: Any = None) -> _TraceRole | None:
        return self._role("user", user, content)

    def assistant(self, content: Any = None) -> _TraceRole | None:
        return self._role("assistant", assistant, content)

    def _role(self, role: str, wrap: Any, content: Any) -> _TraceRole | None:
        if content is None:
            return _TraceRole(self, role)
        self += wrap(content)
        return None

    def fork(self, n: int) -> TraceForkGroup:
        node = Fork(n, [[] for _ in range(n)])
        self.nodes.append(node)
        return TraceForkGroup(self, len(self.nodes) - 1,
                              [TracerState(b) for b in node.branches])

    def join(self, forks: TraceForkGroup) -> list[TracerState]:
        return forks.join()


class TraceForkGroup(list):
    def __init__(self, parent: TracerState, fork_index: int, branches: list[TracerState]):
        super().__init__(branches)
        self.parent, self.fork_index = parent, fork_index

    def __iadd__(self, other: Any) -> Self:  # type: ignore[override]
        for b in self:
            b += other
        return self

    def join(self) -> list[TracerState]:
        self.parent.nodes.append(Join(self.fork_index))
        return list(self)


class _TraceRole:
    def __init__(self, state: TracerState, role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> TracerState:
        self.state += RoleBegin(self.role)
        return self.state

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.state += RoleEnd(self.role)


def trace(func: Any, *args: Any, **kwargs: Any) -> Trace:
    """Run ``func(state, *args, **kwargs)`` against a recorder."""
    nodes: list[Node] = []
    try:
        func(TracerState(nodes), *args, **kwargs)
    except StopTracing as stop:
        return Trace(nodes, complete=False, stopped_at=str(stop))
    return Trace(nodes)
