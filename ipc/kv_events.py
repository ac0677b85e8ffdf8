"""KV events, worker -> router: where a worker's cache blocks live, as its tiers change, so the
router can route a prompt to the worker that holds its prefix (``server.kv_index``).
"""

from __future__ import annotations

import msgspec


class KVEvent(msgspec.Struct, array_like=True):
    """A change of where blocks live on a worker: ``stored`` (now in ``tier``), ``removed``
    (no longer in ``tier``) or ``demoted`` (moved from ``from_tier`` down to ``tier``). Blocks
    are named by their content address (``radix_cache.block_hash``)."""

    kind: str
    tier: str  # "l1" | "l2" | "l3" | "store"
    keys: list[str]
    from_tier: str = ""


class KVEvents(msgspec.Struct, tag="kv_events", kw_only=True):
    """Worker -> every router it reports to: its cache tiers' changes since the previous
    message (``seq``: 1, 2, ... from the worker's start), or, with ``snapshot``, every block it
    holds now (the answer to :class:`KVEventsQuery`). ``identity`` and ``page_size`` let the
    router compute the same block keys from a prompt (``block_hash.KVIdentity.digest``);
    ``store``: the shared store the worker reads (its blocks count for every worker of it)."""

    worker_id: str
    addr: str
    identity: str
    page_size: int
    seq: int
    events: list[KVEvent]
    snapshot: bool = False
    store: str = ""


class KVEventsQuery(msgspec.Struct, tag="kv_events_query"):
    """Router -> worker: send a snapshot of your blocks (a router that joined late, or missed
    events: a gap in ``seq``) to ``reply_addr``."""

    reply_addr: str
