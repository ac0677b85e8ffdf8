"""The layout's rules, checked from the source: no import cycle between top-level packages
(nor between the engine's sub-packages), and nothing below the face imports it.

Imports are read with ``ast`` from every module, including imports inside functions and under
``TYPE_CHECKING``: a cycle that only a lazy import hides is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> dict[str, Path]:
    """Top-level import name -> folder, from pyproject's ``package-dir``."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = cfg["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in dirs.items() if name.count(".") <= 1}


def _module_name(path: Path, packages: dict[str, Path]) -> str:
    for name, folder in sorted(packages.items(), key=lambda kv: -len(str(kv[1]))):
        if path.is_relative_to(folder):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([name, *parts])
    raise AssertionError(f"{path} is in no package")


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of the ``splitserve`` modules ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return {n for n in out if n == "splitserve" or n.startswith("splitserve.")}


def _component(module: str, depth: int) -> str | None:
    """The part ``module`` belongs to: its first ``depth`` dotted parts, with every module of the
    face folder (``splitserve/cli.py`` ...) as one part, ``splitserve``; None for a module that
    sits above that depth (``engine/kv_pool.py`` when grouping the engine's sub-packages)."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] not in _packages_short():
        return "splitserve"  # a module of the face folder
    if len(parts) < depth:
        return None
    if depth > 2 and len(parts) == depth and not _is_package(module):
        return None
    return ".".join(parts[:depth])


def _packages_short() -> set[str]:
    return {name.split(".")[1] for name in _packages() if "." in name}


def _is_package(module: str) -> bool:
    packages = _packages()
    top = ".".join(module.split(".")[:2])
    rest = module.split(".")[2:]
    return (packages[top].joinpath(*rest) / "__init__.py").exists()


def _graph(depth: int, under: str | None = None) -> dict[str, set[str]]:
    """Edges between parts (see :func:`_component`), among modules under ``under`` if given."""
    packages = _packages()
    edges: dict[str, set[str]] = defaultdict(set)
    for folder in set(packages.values()):
        for path in folder.rglob("*.py"):
            module = _module_name(path, packages)
            if under and not module.startswith(under + "."):
                continue
            src = _component(module, depth)
            if src is None:
                continue
            for name in _imports(path, module):
                if under and not name.startswith(under + "."):
                    continue
                dst = _component(name, depth)
                if dst is not None and dst != src:
                    edges[src].add(dst)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_cycle_between_top_level_packages() -> None:
    assert _cycles(_graph(2)) == []


def test_nothing_below_the_face_imports_it() -> None:
    """The face (``splitserve/``: CLI, demo, default model) imports every part; no part imports
    it back."""
    edges = _graph(2)
    assert sorted(src for src, dsts in edges.items() if "splitserve" in dsts) == []


def test_no_cycle_between_engine_subpackages() -> None:
    assert _cycles(_graph(3, under="splitserve.engine")) == []


def test_checker_sees_a_cycle() -> None:
    """The checker itself: a two-package loop is reported."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_constraint_planning_imports_no_engine_server_or_torch() -> None:
    """``splitserve.constraints`` (the constraint planning the API server validates requests with)
    sits below both the server and the engine and imports neither, nor torch: the server's
    request path stays torch-free (run for real in ``tests/server/test_without_torch.py``)."""
    folder = _packages()["splitserve.constraints"]
    forbidden = ("torch", "splitserve.engine", "splitserve.server", "transformers")
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if any(n == f or n.startswith(f + ".") for f in forbidden)]
    assert found == []
