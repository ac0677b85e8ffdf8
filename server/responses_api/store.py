"""Stored responses: an embedded SQLite database (the standard library's ``sqlite3``), one file
under ``$SPLITSERVE_CACHE`` by default (``--responses-store``), so a response outlives the API
server that made it.

Each row is one response of one tenant (``server.tenancy``: the API key's tenant; "" for the
shared one): its response object as JSON, and its input items, the whole conversation it was
generated from (the items of the responses it continues, then its own input), which
``previous_response_id`` continues with its output after them and ``GET .../input_items``
lists. A second table indexes every item by its id, for ``item_reference``. Every lookup is by
(tenant, id): one tenant never reads, continues or deletes another's response.

Bounds (``--responses-store-max-mb``, ``--responses-store-max-age``): a row older than the age
is gone (deleted as it is met, and on every write); after a write, the oldest rows go until the
stored JSON fits the size.

:class:`ResponseStore` is blocking; :class:`AsyncResponseStore` runs it on a worker thread, one
call at a time (a capacity limiter of one: bounded, and the connection is never used by two
threads at once), so the event loop never waits on the disk. SQLite's WAL journal lets several
API servers on one host share the file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio

logger = logging.getLogger(__name__)

MEMORY = ":memory:"  # a store that lives as long as the process (tests, or nothing on disk)
_EVICT_BATCH = 500  # rows deleted per statement
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created_at REAL NOT NULL, status TEXT NOT NULL,
    owner TEXT NOT NULL, body TEXT NOT NULL, input_items TEXT NOT NULL, size INTEGER NOT NULL,
    PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
CREATE TABLE IF NOT EXISTS items (
    tenant TEXT NOT NULL, id TEXT NOT NULL, response_id TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (tenant, id, response_id));
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its response object and the input items it was generated from."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one comes after: its input, then its output."""
        return self.input_items + self.body["output"]


def owner_id() -> str:
    """This process, as the owner of the responses it is generating: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class ResponseStore:
    """The blocking store over one SQLite file (or :data:`MEMORY`).

    Args:
        path: the database file (its folder is created) or :data:`MEMORY`.
        max_bytes: the stored JSON kept at most (oldest rows go first).
        max_age_s: rows older than this are gone.
        owner: this process (:func:`owner_id`); rows a dead process on this host left
            ``queued`` or ``in_progress`` become ``failed`` when the store opens.

    Raises:
        sqlite3.Error: the file cannot be opened as a database.
    """

    def __init__(self, path: str, max_bytes: int, max_age_s: float,
                 owner: str | None = None) -> None:
        if path != MEMORY:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path, self.max_bytes, self.max_age_s = path, max_bytes, max_age_s
        self.owner = owner or owner_id()
        self.db = sqlite3.connect(path, timeout=30, check_same_thread=False,
                                  isolation_level=None)
        if path != MEMORY:
            self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        self.fail_orphans()

    def close(self) -> None:
        self.db.close()

    def put(self, tenant: str, body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep (or replace) the response ``body`` of ``tenant`` with its input items; index
        every item by id; then apply the bounds."""
        body_text = json.dumps(body, ensure_ascii=False)
        items_text = json.dumps(input_items, ensure_ascii=False)
        rid = body["id"]
        with self._transaction():
            self.db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (tenant, rid, body["created_at"], body["status"], self.owner, body_text,
                 items_text, len(body_text) + len(items_text)))
            self.db.execute("DELETE FROM items WHERE tenant = ? AND response_id = ?",
                            (tenant, rid))
            self.db.executemany(
                "INSERT OR REPLACE INTO items VALUES (?, ?, ?, ?)",
                [(tenant, item["id"], rid, json.dumps(item, ensure_ascii=False))
                 for item in [*input_items, *body["output"]] if item.get("id")])
        self.evict()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s response ``response_id``, or None (never stored, deleted, expired, or
        another tenant's)."""
        row = self.db.execute(
            "SELECT body, input_items, created_at FROM responses WHERE tenant = ? AND id = ?",
            (tenant, response_id)).fetchone()
        if row is None:
            return None
        if row[2] < time.time() - self.max_age_s:
            self.delete(tenant, response_id)
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def item(self, tenant: str, item_id: str) -> dict[str, Any] | None:
        """An item of one of ``tenant``'s stored responses, by its id, or None."""
        row = self.db.execute(
            "SELECT i.body FROM items i JOIN responses r ON r.tenant = i.tenant "
            "AND r.id = i.response_id WHERE i.tenant = ? AND i.id = ? AND r.created_at >= ? "
            "LIMIT 1", (tenant, item_id, time.time() - self.max_age_s)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, tenant: str, response_id: str) -> bool:
        """Delete ``tenant``'s response ``response_id``; whether there was one."""
        with self._transaction():
            gone = self.db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?",
                                   (tenant, response_id)).rowcount
            self.db.execute("DELETE FROM items WHERE tenant = ? AND response_id = ?",
                            (tenant, response_id))
        return gone > 0

    def evict(self) -> int:
        """Apply the bounds: rows past the age go, then the oldest until the rest fit the size.
        Returns how many rows went."""
        gone = self._delete_where("created_at < ?", (time.time() - self.max_age_s,))
        (total,) = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()
        excess = total - self.max_bytes
        if excess <= 0:
            return gone
        victims, freed = [], 0
        for rowid, size in self.db.execute(
                "SELECT rowid, size FROM responses ORDER BY created_at, rowid"):
            if freed >= excess:
                break
            victims.append(rowid)
            freed += size
        for at in range(0, len(victims), _EVICT_BATCH):
            batch = victims[at:at + _EVICT_BATCH]
            marks = ",".join("?" * len(batch))
            gone += self._delete_where(f"rowid IN ({marks})", tuple(batch))
        return gone

    def fail_orphans(self) -> int:
        """Rows left ``queued`` or ``in_progress`` by a process of this host that is gone (an
        API server that stopped mid-way through a background response) become ``failed``.
        Returns how many."""
        host = self.owner.rsplit(":", 1)[0]
        rows = self.db.execute(
            "SELECT tenant, id, owner, body, input_items FROM responses "
            "WHERE status IN ('queued', 'in_progress')").fetchall()
        failed = 0
        for tenant, rid, owner, body_text, items_text in rows:
            owner_host, _, pid = owner.rpartition(":")
            if owner == self.owner or owner_host != host or _alive(pid):
                continue
            body = json.loads(body_text)
            body.update(status="failed", error={
                "code": "server_error", "message": "the API server generating this response "
                "stopped before it finished"})
            self.put(tenant, body, json.loads(items_text))
            failed += 1
        return failed

    def _delete_where(self, condition: str, args: tuple[Any, ...]) -> int:
        with self._transaction():
            self.db.execute(
                f"DELETE FROM items WHERE (tenant, response_id) IN "
                f"(SELECT tenant, id FROM responses WHERE {condition})", args)
            return self.db.execute(f"DELETE FROM responses WHERE {condition}",
                                   args).rowcount

    def _transaction(self) -> _Transaction:
        return _Transaction(self.db)


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an error): one writer at a time
    across processes, waiting up to the connection's timeout."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def memory_store(max_bytes: int = 64 * 2**20, max_age_s: float = 30 * 86400
                 ) -> AsyncResponseStore:
    """A store in memory (gone with the process): for apps made without one (tests)."""
    return AsyncResponseStore(ResponseStore(MEMORY, max_bytes, max_age_s))


class AsyncResponseStore:
    """:class:`ResponseStore` for the event loop: each call runs on a worker thread, one at a
    time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._limiter = anyio.CapacityLimiter(1)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=self._limiter)

    async def put(self, tenant: str, body: dict[str, Any],
                  input_items: list[dict[str, Any]]) -> None:
        await self._run(self.store.put, tenant, body, input_items)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._run(self.store.get, tenant, response_id)

    async def item(self, tenant: str, item_id: str) -> dict[str, Any] | None:
        return await self._run(self.store.item, tenant, item_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._run(self.store.delete, tenant, response_id)

    def close(self) -> None:
        self.store.close()
