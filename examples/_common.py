"""Shared by the examples: the backend from ``--url`` (default: a local splitserve server)."""

from __future__ import annotations

import argparse

from splitserve import lang


def setup(description: str) -> argparse.Namespace:
    """Parse ``--url`` and set the default backend. Start a server first:
    ``splitserve serve --port 8000`` (colocated) or ``splitserve launch`` (disaggregated)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    lang.set_default_backend(lang.Endpoint(args.url))
    return args
