"""The text between a document's generated-section markers, for the tests that hold a generated
table equal to the code it comes from (``tests/server/test_fields.py``, ``test_nested_fields.py``:
the field tables of ``docs/api.md``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"


def generated_section(marker: str, path: Path = API_DOC) -> str:
    """What stands between ``<!-- MARKER:start ... -->`` (its line) and ``<!-- MARKER:end -->``
    in ``path``."""
    text = path.read_text()
    start = text.index(f"<!-- {marker}:start")
    return text[text.index("\n", start) + 1:text.index(f"<!-- {marker}:end -->")]
