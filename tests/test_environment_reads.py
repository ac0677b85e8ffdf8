"""The environment is read in one module, ``config/env.py``; the rest of the package gets its
settings from the typed config (or from a function of ``config.env``).

Checked from the source (``ast``) of every module of every folder pyproject maps, except
``config/env.py``; tests and benchmarks are not the package and are not checked.

Forbidden: ``os.getenv`` / ``os.getenvb``, ``os.environb``, ``from os import environ`` (or
``getenv``...), and any use of ``os.environ`` other than the two below: ``.get``, ``[NAME]`` read,
``in``, ``.setdefault``, ``.pop``, ``.copy()``, iteration, passing it to a function...

Allowed, as they read no variable:

- handing the whole environment to a child process as the base of its own, as the first
  argument of ``dict(os.environ, ...)`` or unpacked first in ``{**os.environ, ...}`` (what is
  added comes from the config: the launcher's ``extra_env``, the API key, the CPU pinning);
- setting a variable, ``os.environ[NAME] = value``, for a library or a child to read.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_MODULE = ROOT / "config" / "env.py"
OS_READERS = {"getenv", "getenvb", "environb", "environ", "unsetenv", "putenv"}


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_os(node: ast.AST, os_names: set[str]) -> bool:
    """``node`` is ``os.<one of OS_READERS>`` (``os`` under any name it was imported as)."""
    return isinstance(node, ast.Attribute) and node.attr in OS_READERS \
        and isinstance(node.value, ast.Name) and node.value.id in os_names


def _allowed(node: ast.Attribute, parent: ast.AST) -> bool:
    """``node`` (an ``os.environ``) handed whole to a child's environment, or written to."""
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) \
            and parent.func.id == "dict" and parent.args[:1] == [node]:
        return True
    if isinstance(parent, ast.Dict) and parent.keys[:1] == [None] and parent.values[:1] == [node]:
        return True
    return isinstance(parent, ast.Subscript) and parent.value is node \
        and isinstance(parent.ctx, ast.Store)


def environment_reads(source: str, name: str = "<source>") -> list[str]:
    """``"line: what"`` for each forbidden use of the environment in ``source`` (see above)."""
    tree = ast.parse(source, name)
    parents = _parents(tree)
    os_names = {a.asname or "os" for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names if a.name == "os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in OS_READERS]
        elif _is_os(node, os_names) and (
                node.attr != "environ" or not _allowed(node, parents[node])):
            found.append(f"{node.lineno}: {ast.unparse(parents[node])[:80]}")
    return found


def test_the_environment_is_read_only_in_config_env() -> None:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = []
    for folder in sorted(set(dirs["package-dir"].values())):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ENV_MODULE:
                rel = path.relative_to(ROOT)
                found += [f"{rel}:{hit}" for hit in environment_reads(path.read_text(), str(rel))]
    assert found == []


def test_the_check_tells_reads_from_hand_downs() -> None:
    source = """
import os
import os as system
from os import getenv
a = os.environ.get("A")
b = os.environ["B"]
c = "C" in os.environ
d = system.getenv("D")
os.environ.setdefault("E", "1")
f = dict(os.environ)
g = {**os.environ, "G": "1"}
os.environ["H"] = "1"
i = {"I": "1", **os.environ}
j = dict(x=1, **os.environ)
"""
    lines = sorted(int(hit.split(":")[0]) for hit in environment_reads(source))
    assert lines == [4, 5, 6, 7, 8, 9, 13, 14]  # f, g and H (lines 10-12) hand down or write
