"""LoRA adapters at the HTTP API, on the fake engine: a request's ``model`` names an adapter
(resolved in one place for every endpoint), ``/v1/models`` lists each with its ``parent``, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's shapes) load and unload
them: 400 naming the field for a bad body, a taken name or a path outside ``--lora-dir``; 404
for an unknown name; 403 for a tenant's key. What the workers check in the adapter files
(shapes, rank, targets) is tested end to end (``tests/e2e/test_lora_serving.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.models import ServedModels
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing
from tests.http_api import CH, CONTEXT_LEN, MODEL, USER, C

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def adapter_folder(path: Path) -> Path:
    """A folder the fake engine takes as an adapter (it reads no weights)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return path


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    adapter_folder(root / "sql")
    adapter_folder(root / "chat")
    adapter_folder(tmp_path / "outside")
    (root / "escape").symlink_to(tmp_path / "outside")
    return root


LOOPBACK = ("127.0.0.1", 50000)  # with no --api-key, operator routes serve loopback only


def app_client(fake, tokenizer, models: ServedModels, keys: KeyRing | None = None,
               client: tuple[str, int] = LOOPBACK) -> TestClient:
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id], models=models)
    if keys is not None:
        install_guard(app, keys, max_body_bytes=0)
    return TestClient(app, client=client)


@pytest.fixture
def client(fake: FakeEngineClient, tokenizer, lora_dir: Path) -> TestClient:
    models = ServedModels(MODEL, lora_dir=str(lora_dir),
                          adapters={"sql": str(lora_dir / "sql")}, pinned=["sql"])
    return app_client(fake, tokenizer, models)


def test_models_list_adapters_with_their_parent(client, lora_dir) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(MODEL, None), ("sql", MODEL)]
    card = client.get("/v1/models/sql").json()
    assert card["parent"] == MODEL and card["root"] == str(lora_dir / "sql")
    assert client.get("/v1/models/nope").status_code == 404


@pytest.mark.parametrize("path", [C, CH])
def test_a_request_naming_an_adapter_runs_under_it(client, fake, lora_dir, path) -> None:
    body = {"model": "sql", **({"prompt": "hi"} if path == C else {"messages": USER})}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    ref = fake.loras[-1]
    assert ref is not None and (ref.name, ref.path) == ("sql", str(lora_dir / "sql"))
    assert client.post(path, json={**body, "model": "default"}).status_code == 200
    assert fake.loras[-1] is None  # the base model
    r = client.post(path, json={**body, "model": "chat"})  # in --lora-dir, but not loaded
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'chat'" in r.json()["error"]["message"]


def test_n_choices_and_tokenize_under_an_adapter(client, fake) -> None:
    r = client.post(C, json={"model": "sql", "prompt": "hi", "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert [ref.name for ref in fake.loras[-2:]] == ["sql", "sql"]
    assert client.post("/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200


def test_load_then_serve_then_unload(client, fake, lora_dir) -> None:
    r = client.post(LOAD, json={"lora_name": "chat", "lora_path": "chat"})  # under --lora-dir
    assert r.status_code == 200, r.text
    assert r.json()["parent"] == MODEL and r.json()["path"] == str(lora_dir / "chat")
    assert fake.loaded_loras == {"chat": str(lora_dir / "chat")}
    assert "chat" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post(C, json={"model": "chat", "prompt": "hi"}).status_code == 200
    assert fake.loras[-1].name == "chat"
    again = client.post(LOAD, json={"lora_name": "chat", "lora_path": "chat"})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert client.post(UNLOAD, json={"lora_name": "chat"}).status_code == 200
    assert fake.loaded_loras == {}
    r = client.post(C, json={"model": "chat", "prompt": "hi"})
    assert r.status_code == 404
    r = client.post(UNLOAD, json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"lora_name": "x", "lora_path": "../outside"}, "lora_path", "--lora-dir"),
    ({"lora_name": "x", "lora_path": "escape"}, "lora_path", "--lora-dir"),  # a symlink out
    ({"lora_name": "x", "lora_path": "/etc"}, "lora_path", "--lora-dir"),
    ({"lora_name": "x", "lora_path": "missing"}, "lora_path", "adapter_config.json"),
    ({"lora_name": MODEL, "lora_path": "chat"}, "lora_name", "base model"),
    ({"lora_name": "sql", "lora_path": "chat"}, "lora_name", "already loaded"),
    ({"lora_name": "x"}, "lora_path", "required"),
    ({"lora_name": "x", "lora_path": "chat", "lora_int_id": 3}, "lora_int_id", ""),
    ({"lora_name": 5, "lora_path": "chat"}, "lora_name", ""),
])
def test_bad_loads_are_400_naming_the_field(client, fake, body, param, words) -> None:
    r = client.post(LOAD, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "x" not in fake.loaded_loras
    assert client.post(C, json={"model": "sql", "prompt": "hi"}).status_code == 200


def test_run_time_loads_need_lora_enabled(fake, tokenizer, lora_dir) -> None:
    client = app_client(fake, tokenizer, ServedModels(MODEL))
    r = client.post(LOAD, json={"lora_name": "x", "lora_path": str(lora_dir / "chat")})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    enabled = app_client(fake, tokenizer, ServedModels(MODEL, lora_enabled=True))
    r = enabled.post(LOAD, json={"lora_name": "x", "lora_path": str(lora_dir / "chat")})
    assert r.status_code == 200, r.text  # no --lora-dir: any folder


def test_loads_without_a_key_are_loopback_only(fake, tokenizer, lora_dir) -> None:
    remote = app_client(fake, tokenizer, ServedModels(MODEL, lora_dir=str(lora_dir)),
                        client=("203.0.113.7", 40000))
    for path, body in ((LOAD, {"lora_name": "x", "lora_path": "chat"}),
                       (UNLOAD, {"lora_name": "x"})):
        r = remote.post(path, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert fake.loaded_loras == {}


def test_loads_are_the_operators(fake, tokenizer, lora_dir, tmp_path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("sk-alice alice\n")
    client = app_client(fake, tokenizer, ServedModels(MODEL, lora_dir=str(lora_dir)),
                        KeyRing.from_config("sk-admin", str(keyfile)))
    body = {"lora_name": "x", "lora_path": "chat"}
    assert client.post(LOAD, json=body).status_code == 401
    r = client.post(LOAD, json=body, headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = client.post(UNLOAD, json={"lora_name": "x"}, headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 403
    ok = client.post(LOAD, json=body, headers={"Authorization": "Bearer sk-admin"})
    assert ok.status_code == 200, ok.text
    r = client.post(C, json={"model": "x", "prompt": "hi"},
                    headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 200  # tenants use the adapters the operator loaded


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_messages_and_responses_run_under_the_adapter_named(client, fake, lora_dir,
                                                            path) -> None:
    """Anthropic's Messages and OpenAI's Responses build their jobs through
    ``JobBuilder.chat_job`` too: an adapter's name runs under it, an unknown one is a 404 (never
    a 5xx), the alias and the base model's name run on the base."""
    if path == "/v1/messages":
        body = {"model": "sql", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"model": "sql", "input": "hi", "max_output_tokens": 16}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    ref = fake.loras[-1]
    assert ref is not None and (ref.name, ref.path) == ("sql", str(lora_dir / "sql"))
    for base in ("default", MODEL):
        assert client.post(path, json={**body, "model": base}).status_code == 200
        assert fake.loras[-1] is None
    r = client.post(path, json={**body, "model": "chat"})  # in --lora-dir, but not loaded
    assert r.status_code == 404, r.text
    assert "'chat'" in r.text
