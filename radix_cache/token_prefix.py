"""The length of the prefix two token-id sequences share: what a prefix cache could reuse.

Pure Python and import-light (no torch), so the API server's fake engine and the ``lang``
client, which otherwise import nothing of the engine, can use it too.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Returns: the number of leading positions where ``a`` and ``b`` hold the same token
    (tokens; at most ``min(len(a), len(b))``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
