"""The expressions a program appends: ``gen``, ``select`` and the role wrappers."""

from __future__ import annotations

from typing import Any

from splitserve.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, flatten


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | None = None,
    choices: list[str] | None = None,
    dtype: type | None = None,
) -> Gen:
    """A generation step; its text is appended and stored in ``s[name]``.

    Args:
        name: variable to capture the output in (``None``: append only).
        max_tokens: at most this many new tokens (default: the run's, else 128).
        stop: string(s) that end the generation; not included in the output.
        temperature, top_p, seed: sampling (default: the run's, else the server's).
        regex: the output matches this regular expression.
        json_schema: the output is JSON valid under this schema (dict or JSON text).
        choices: the output is exactly one of these strings.
        dtype: ``int``, ``float`` or ``bool`` constrain the output to a literal of that type
            and store the parsed value; ``str`` (default) stores the text.

    Raises:
        ValueError: more than one constraint, or an unsupported ``dtype``.
    """
    from splitserve.lang.constraints import check_one_constraint

    node = Gen(
        name=name,
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else stop,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
        choices=list(choices) if choices is not None else None,
        dtype=dtype,
    )
    check_one_constraint(node)
    return node


def select(name: str | None, choices: list[str]) -> Select:
    """Append whichever of ``choices`` the model scores highest (mean logprob of the choice's
    tokens given the prompt) and store it in ``s[name]``; the scores are in ``s.meta(name)``.

    Raises:
        ValueError: ``choices`` is empty or holds a non-string.
    """
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select needs a non-empty list of strings")
    return Select(name, list(choices))


def _role(role: str, content: Any) -> Seq:
    return Seq([RoleBegin(role), *flatten(content), RoleEnd(role)])


def system(content: Any = "") -> Seq:
    """A system message holding ``content`` (text, gen, or a sum of them)."""
    return _role("system", content)


def user(content: Any = "") -> Seq:
    """A user message holding ``content``."""
    return _role("user", content)


def assistant(content: Any = "") -> Seq:
    """An assistant message holding ``content``; usually ``assistant(gen("answer"))``."""
    return _role("assistant", content)
