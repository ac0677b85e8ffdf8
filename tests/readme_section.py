"""The text between a README's generated-section markers, for the tests that hold a generated
table equal to the code it comes from (``tests/server/test_fields.py``, ``test_nested_fields.py``)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def generated_section(marker: str) -> str:
    """What stands between ``<!-- MARKER:start ... -->`` (its line) and ``<!-- MARKER:end -->``."""
    readme = README.read_text()
    start = readme.index(f"<!-- {marker}:start")
    return readme[readme.index("\n", start) + 1:readme.index(f"<!-- {marker}:end -->")]
