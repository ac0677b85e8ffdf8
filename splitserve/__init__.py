"""splitserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: ``import splitserve`` stays light; ``splitserve.lang`` loads on first use.
    if name == "lang":
        return importlib.import_module("splitserve.lang")
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
