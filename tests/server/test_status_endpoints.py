"""/health (503 when the engine is not ready), /v1/models, /workers, and the 404 shape."""

from __future__ import annotations

from tests.http_api import MODEL


def test_health_models_workers(client, fake) -> None:
    assert client.get("/health").status_code == 200
    fake.ready = False
    assert client.get("/health").status_code == 503
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/workers").json()[0]["role"] == "colocated"
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"
