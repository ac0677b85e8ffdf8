"""The SQLite store of responses (``server.responses_api.store``) with no model: kept across a
restart (a new store and a new app over the same file), namespaced by tenant, bounded by size
and age, item references, background responses orphaned by a dead API server, and the blocking
work kept off the event loop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.responses_api.store import AsyncResponseStore, ResponseStore, owner_id
from splitserve.server.routes import create_app

DAY = 86400.0


def body(rid: str, status: str = "completed", created_at: float | None = None,
         text: str = "hi", tenant_tag: str = "") -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": status,
            "created_at": int(time.time() if created_at is None else created_at),
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text + tenant_tag}]}]}


USER = [{"id": "msg_in", "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "hello"}]}]


def test_a_stored_response_survives_a_new_store_on_the_same_file(tmp_path) -> None:
    path = str(tmp_path / "r.sqlite3")
    store = ResponseStore(path, 2**20, DAY)
    store.put("", body("resp_1"), USER)
    store.close()
    again = ResponseStore(path, 2**20, DAY)
    stored = again.get("", "resp_1")
    assert stored is not None
    assert stored.body == body("resp_1", created_at=stored.body["created_at"])
    assert stored.input_items == USER
    assert stored.conversation == USER + stored.body["output"]


def test_tenants_are_apart(tmp_path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), 2**20, DAY)
    store.put("alice", body("resp_1"), USER)
    assert store.get("bob", "resp_1") is None and store.get("", "resp_1") is None
    assert store.item("bob", "msg_in") is None and store.item("alice", "msg_in") == USER[0]
    assert not store.delete("bob", "resp_1")
    assert store.get("alice", "resp_1") is not None
    # The same id in two tenants is two rows.
    store.put("bob", body("resp_1", text="bob's"), [])
    assert store.get("alice", "resp_1").body["output"][0]["content"][0]["text"] == "hi"
    assert store.delete("alice", "resp_1") and store.get("bob", "resp_1") is not None


def test_items_are_found_by_id_until_their_response_goes(tmp_path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), 2**20, DAY)
    store.put("", body("resp_1"), USER)
    assert store.item("", "msg_resp_1")["role"] == "assistant"
    store.put("", body("resp_2"), USER)  # the same input item, in a second response
    store.delete("", "resp_1")
    assert store.item("", "msg_resp_1") is None and store.item("", "msg_in") == USER[0]


def test_the_oldest_go_first_past_the_size_bound(tmp_path) -> None:
    one = len(json.dumps(body("resp_00", created_at=0))) + len(json.dumps(USER))
    store = ResponseStore(str(tmp_path / "r.sqlite3"), 5 * one + one // 2, DAY)
    now = time.time()
    for i in range(8):
        store.put("", body(f"resp_{i:02d}", created_at=now - 100 + i), USER)
    kept = [i for i in range(8) if store.get("", f"resp_{i:02d}") is not None]
    assert kept == [3, 4, 5, 6, 7]
    assert store.item("", "msg_resp_02") is None and store.item("", "msg_resp_03") is not None


def test_rows_past_the_age_bound_are_gone(tmp_path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), 2**20, 60.0)
    store.put("", body("resp_old", created_at=time.time() - 120), USER)
    store.put("", body("resp_new"), USER)  # this write removes the old row
    assert store.get("", "resp_old") is None and store.get("", "resp_new") is not None
    store.db.execute("UPDATE responses SET created_at = ? WHERE id = 'resp_new'",
                     (time.time() - 120,))
    assert store.get("", "resp_new") is None  # expired when met, before any write


def test_a_dead_servers_background_responses_become_failed(tmp_path) -> None:
    path = str(tmp_path / "r.sqlite3")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = owner_id().rsplit(":", 1)[0]
    ResponseStore(path, 2**20, DAY, owner=f"{host}:{dead}").put("t", body("resp_d", "queued"), [])
    ResponseStore(path, 2**20, DAY, owner=f"otherhost:{dead}").put("t", body("resp_o", "queued"),
                                                                    [])
    ResponseStore(path, 2**20, DAY).put("t", body("resp_live", "in_progress"), [])
    store = ResponseStore(path, 2**20, DAY, owner=f"{host}:1")  # pid 1 lives
    failed = store.get("t", "resp_d").body
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert store.get("t", "resp_o").body["status"] == "queued"  # another host's: unknown
    assert store.get("t", "resp_live").body["status"] == "in_progress"  # this process lives


def test_the_async_store_works_off_the_event_loop(tmp_path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), 2**20, DAY)
    threads: set[int] = set()
    put = store.put

    def recording_put(*args: Any) -> None:
        threads.add(threading.get_ident())
        put(*args)

    store.put = recording_put  # type: ignore[method-assign]

    async def main() -> None:
        astore = AsyncResponseStore(store)
        await asyncio.gather(*(astore.put("", body(f"resp_{i}"), USER) for i in range(5)))
        assert (await astore.get("", "resp_3")) is not None

    asyncio.run(main())
    assert threads and threading.get_ident() not in threads


def test_an_app_over_the_same_file_serves_the_stored_response(tmp_path, tokenizer) -> None:
    """The API server restarted: a new app (and store) over the file answers GET,
    ``input_items`` and ``previous_response_id`` for a response the first one made."""
    path = str(tmp_path / "r.sqlite3")
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)

    def app() -> TestClient:
        store = AsyncResponseStore(ResponseStore(path, 2**20, DAY))
        return TestClient(create_app(fake, tokenizer, "m", 1024, [tokenizer.eos_token_id],
                                     responses_store=store))

    made = app().post("/v1/responses", json={"model": "m", "input": "remember me"}).json()
    second = app()
    assert second.get(f"/v1/responses/{made['id']}").json() == made
    assert second.get(f"/v1/responses/{made['id']}/input_items").json()["data"][0]["content"][0][
        "text"] == "remember me"
    r = second.post("/v1/responses", json={"model": "m", "input": "and?",
                                           "previous_response_id": made["id"]})
    assert r.status_code == 200 and "remember me" in tokenizer.decode(fake.requests[-1][1])


@pytest.mark.parametrize("path", [":memory:", "nested/dir/r.sqlite3"])
def test_memory_and_new_folders(tmp_path, path) -> None:
    where = path if path == ":memory:" else str(tmp_path / path)
    store = ResponseStore(where, 2**20, DAY)
    store.put("", body("resp_1"), USER)
    assert store.get("", "resp_1") is not None
    if path != ":memory:":
        assert Path(where).is_file()
