"""``prog.trace(...)``: record a program's IR without calling a model.

The tracer hands the program a :class:`TracerState` with the same API as ``ProgramState``;
appends are recorded, forks record their branches. A model output has no value at trace time,
so the moment the program *uses* one (``if s["x"] == ...``, an f-string, ``s.text()``) the trace
stops there and is marked incomplete: what it holds up to that point is still exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from splitserve.lang.ir import Fork, Join, Node, RoleBegin, RoleEnd, flatten, is_model_call
from splitserve.lang.primitives import assistant, system, user


class StopTracing(BaseException):
    """The program used a value only a model run can produce.

    A ``BaseException`` so that a program's own ``except Exception`` cannot swallow it and
    carry on down a path the real run would not take.
    """


def _stop_on_use(self: TracedValue, *_: Any) -> Any:
    raise StopTracing(f"the program uses the value of {self._name!r}")


# Every operator a value can take part in: each one is data-dependent, so each stops the trace.
_OPERATORS = (
    "__str__", "__repr__", "__format__", "__bytes__", "__hash__", "__bool__", "__int__",
    "__float__", "__complex__", "__index__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__len__", "__iter__", "__reversed__", "__contains__", "__getitem__", "__call__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__neg__", "__pos__", "__abs__", "__invert__",
    *(f"__{side}{op}__" for side in ("", "r") for op in (
        "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow",
        "lshift", "rshift", "and", "or", "xor")),
)


def _stopping_on(names: tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator: each operator in ``names`` stops the trace."""
    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, _stop_on_use)
        return cls
    return decorate


@_stopping_on(_OPERATORS)
class TracedValue:
    """A placeholder for ``s[name]``: any use of it (an operator, a conversion, an attribute such
    as ``.strip``) stops the trace."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # protocol probes (copy, hasattr(x, "__html__")): absent
            raise AttributeError(attr)
        raise StopTracing(f"the program uses the value of {self._name!r} (.{attr})")


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
    """Records what a program appends. Mirrors ``ProgramState``'s API: appends and forks are
    recorded; reading a value gives a :class:`TracedValue`; any other read of the state (text,
    messages, meta, tool calls, ``"x" in s``) stops the trace."""

    def __init__(self, nodes: list[Node], reads: list[str]) -> None:
        self.nodes = nodes
        self.reads = reads  # names of the model outputs read so far, shared by all branches

    def __iadd__(self, other: Any) -> Self:
        self.nodes.extend(flatten(other))
        return self

    def __getitem__(self, name: str) -> TracedValue:
        self.reads.append(name)
        return TracedValue(name)

    def __contains__(self, name: str) -> bool:
        raise StopTracing(f"the program asks whether {name!r} was captured")

    def __getattr__(self, attr: str) -> Any:
        # text(), messages(), meta(), variables(), tool_calls(), return_value...: only a run has
        # them. (Only called for attributes this class does not define.)
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise StopTracing(f"the program reads its state (s.{attr})")

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
                              [TracerState(b, self.reads) for b in node.branches])

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
    """Run ``func(state, *args, **kwargs)`` against a recorder.

    Tracing stops at the first data-dependent operation: a use of a model output
    (:class:`StopTracing`), or any exception raised once the program has read one (``" ".join``
    over placeholders raises ``TypeError`` inside ``str.join``, where no hook can intercept it).
    Either way the nodes recorded so far are exact, and the trace is marked incomplete.

    Raises:
        Exception: whatever the program raised before it read any model output (its own error,
            which a real run would raise too).
    """
    nodes: list[Node] = []
    state = TracerState(nodes, [])
    try:
        func(state, *args, **kwargs)
    except StopTracing as stop:
        return Trace(nodes, complete=False, stopped_at=str(stop))
    except Exception as exc:
        if not state.reads:
            raise
        why = f"{type(exc).__name__}: {exc} (after reading {', '.join(map(repr, state.reads))})"
        return Trace(nodes, complete=False, stopped_at=why)
    return Trace(nodes)
