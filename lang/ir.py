"""The program IR: what ``s += ...`` appends, and what ``prog.trace(...)`` records.

A program is a list of nodes. Text and role boundaries are data; ``Gen`` and ``Select`` are the
steps that call a model; ``Fork`` holds the node lists of its branches and ``Join`` ends them.
Nodes combine with ``+`` (``"Q: " + gen("a")``) into a :class:`Seq`, so one ``s += ...`` may add
several nodes; the interpreter and the tracer both flatten it with :func:`flatten`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class Node:
    """Base of every IR node. ``a + b`` builds a :class:`Seq`."""

    def __add__(self, other: Any) -> Seq:
        return Seq([*flatten(self), *flatten(other)])

    def __radd__(self, other: Any) -> Seq:
        return Seq([*flatten(other), *flatten(self)])

    def describe(self) -> str:
        """A short label for error messages: ``gen 'answer'``."""
        return type(self).__name__


@dataclass(slots=True)
class Seq(Node):
    """Several nodes appended in order."""

    nodes: list[Node]

    def describe(self) -> str:
        return " + ".join(n.describe() for n in self.nodes)


@dataclass(slots=True)
class ConstantText(Node):
    text: str

    def describe(self) -> str:
        short = self.text if len(self.text) <= 24 else self.text[:21] + "..."
        return f"text {short!r}"


@dataclass(slots=True)
class RoleBegin(Node):
    """Opens a message. A ``tool`` message answers the call ``tool_call_id``."""

    role: str
    tool_call_id: str | None = None

    def describe(self) -> str:
        return f"begin {self.role}"


@dataclass(slots=True)
class RoleEnd(Node):
    role: str

    def describe(self) -> str:
        return f"end {self.role}"


@dataclass(slots=True)
class Gen(Node):
    """Generate text into variable ``name``. ``dtype`` and ``choices`` become constraints
    (``lang.constraints``); at most one of ``regex``, ``json_schema``, ``choices``,
    ``grammar`` (GBNF text) and a non-str ``dtype`` may be set. ``None`` sampling fields take
    the run's defaults.
    ``tools`` (OpenAI function specs) make it a chat request that may return tool calls;
    ``tool_choice`` and ``parallel_tool_calls`` are sent as given (None: the server's default).
    ``reasoning`` makes it a chat request whose thinking (``reasoning_content``) is kept apart
    from the answer; ``reasoning_effort`` is sent as given."""

    name: str | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    dtype: type | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: bool = False
    reasoning_effort: str | None = None

    def describe(self) -> str:
        return f"gen {self.name!r}" if self.name else "gen"


@dataclass(slots=True)
class Select(Node):
    """Append the choice with the best length-normalized logprob; store it in ``name``."""

    name: str | None
    choices: list[str]

    def describe(self) -> str:
        return f"select {self.name!r}"


@dataclass(slots=True)
class Fork(Node):
    """``s.fork(n)``: ``branches[i]`` holds what the program appended to branch ``i``."""

    n: int
    branches: list[list[Node]] = field(default_factory=list)

    def describe(self) -> str:
        return f"fork({self.n})"


@dataclass(slots=True)
class Join(Node):
    """The program waited for the branches of the fork recorded at node ``fork_index``."""

    fork_index: int

    def describe(self) -> str:
        return "join"


def flatten(item: Any) -> list[Node]:
    """The nodes of ``item``: a node, a :class:`Seq`, a string (constant text) or a list.

    Raises:
        TypeError: ``item`` is none of those (e.g. a number: format it as text first).
    """
    if isinstance(item, Seq):
        return [n for node in item.nodes for n in flatten(node)]
    if isinstance(item, Node):
        return [item]
    if isinstance(item, str):
        return [ConstantText(item)] if item else []
    if isinstance(item, (list, tuple)):
        return [n for x in item for n in flatten(x)]
    raise TypeError(
        f"cannot append {type(item).__name__} to a program state; append text (str), "
        "gen(...), select(...) or a role"
    )


def is_model_call(node: Node) -> bool:
    """Whether running ``node`` calls the model (the end of a prompt's constant prefix)."""
    return isinstance(node, (Gen, Select, Fork))
