"""Every relative link in the README, bench/README.md and docs/*.md resolves: the file exists and,
where the link names an ``#anchor`` in a Markdown file, that file has a heading with that anchor
(GitHub's rule: the heading's text lower-cased, punctuation dropped, spaces as hyphens, ``-1``,
``-2`` ... after repeats). Links to web pages are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs and explicit HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose_lines(path.read_text()):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file's prose (not inside code)."""
    out = []
    for line in _prose_lines(path.read_text()):
        out += _LINK.findall(_INLINE_CODE.sub("", line))
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links that name a missing file or anchor, each with the reason."""
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {_shown(dest)}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title: the `b` part\n\n## Again\n\n## Again\n")
    page = tmp_path / "a.md"
    page.write_text(
        "# A\n\n[ok](b.md#title-the-b-part) [ok](b.md#again-1) [ok](#a) [web](https://x.y/z)\n"
        "[gone](c.md) [no anchor](b.md#nope) `[in code](d.md)`\n\n```\n[fenced](e.md)\n```\n")
    assert broken_links(page) == [
        "c.md: no such file", f"b.md#nope: no heading with that anchor in {tmp_path / 'b.md'}"]
