"""pyproject's hand list of packages against the source tree (setuptools cannot discover them
under the ``package-dir`` mapping: ``packages.find`` names packages relative to the folder it
searches, without the ``splitserve.`` prefix).

Every folder of modules under a mapped folder must be a regular package (``__init__.py``) and be
listed; every listed package must be such a folder; every non-Python file in a package folder
must either ship as package data (the code reads it at run time) or be named below as not shipped
(documentation for readers of the source). ``test_wheel_install.py`` checks the built wheel and
sdist for real.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# Non-Python files in package folders that are not read at run time, so not shipped.
NOT_SHIPPED = {"kv_transfer/README.md", "lang/README.md"}


def _package_folders(root: Path = ROOT,
                     package_dir: dict[str, str] = SETUPTOOLS["package-dir"]) -> dict[str, Path]:
    """Package name -> folder, for every folder holding Python modules under a mapped folder."""
    found: dict[str, Path] = {}
    for top, folder in package_dir.items():
        for module in (root / folder).rglob("*.py"):
            rel = module.parent.relative_to(root / folder)
            if "__pycache__" not in rel.parts:
                found[".".join([top, *rel.parts])] = module.parent
    return found


def _owner(path: Path, folders: dict[str, Path]) -> str:
    """The package whose folder holds ``path`` most closely."""
    return max((name for name, f in folders.items() if path.is_relative_to(f)),
               key=lambda name: len(folders[name].parts))


def test_every_folder_of_modules_is_a_listed_regular_package() -> None:
    folders = _package_folders()
    assert sorted(n for n, f in folders.items() if not (f / "__init__.py").exists()) == []
    listed = set(SETUPTOOLS["packages"])
    assert sorted(set(folders) - listed) == [], "packages missing from pyproject's list"
    assert sorted(listed - set(folders)) == [], "listed packages with no folder of modules"
    assert SETUPTOOLS.get("include-package-data") is False  # only package-data ships


def test_every_data_file_ships_or_is_named_as_not_shipped() -> None:
    folders = _package_folders()
    patterns: dict[str, list[str]] = SETUPTOOLS["package-data"]
    unaccounted, unused = [], {(pkg, p) for pkg, ps in patterns.items() for p in ps}
    for folder in SETUPTOOLS["package-dir"].values():
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") \
                    or "__pycache__" in path.parts:
                continue
            pkg = _owner(path, folders)
            rel = path.relative_to(folders[pkg]).as_posix()
            hits = {(pkg, p) for p in patterns.get(pkg, []) if fnmatch.fnmatch(rel, p)}
            unused -= hits
            if not hits and path.relative_to(ROOT).as_posix() not in NOT_SHIPPED:
                unaccounted.append(path.relative_to(ROOT).as_posix())
    assert unaccounted == [], "add each to package-data (read at run time) or to NOT_SHIPPED"
    assert sorted(unused) == [], "package-data patterns that match no file"


def test_the_check_sees_a_nested_package(tmp_path: Path) -> None:
    """The check itself: a sub-folder of modules two levels down is found under its mapped name
    (what the hand list once left out: ``server/tools``, ``engine/model/gguf``)."""
    for name in ("server/__init__.py", "server/tools/request.py", "server/tools/README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    found = _package_folders(tmp_path, {"splitserve.server": "server"})
    assert sorted(found) == ["splitserve.server", "splitserve.server.tools"]
