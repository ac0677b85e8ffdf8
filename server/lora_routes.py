"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, as vLLM shapes them.

``{"lora_name", "lora_path"}`` (and SGLang's ``pinned``) loads the PEFT adapter folder
``lora_path`` on every worker, prefill and decode pools alike, and serves it as ``lora_name``
once all of them have it; ``{"lora_name"}`` unloads it (new requests naming it get 404 at once;
those already running finish under it). Both act on every tenant's server, so they are the
operator's: a tenant's key gets 403 (``server.tenancy.require_operator``), and with an API key
set no request without one gets here (``server.guard``). A run-time path must lie under
``--lora-dir`` when it is set (``server.models``).

Errors, each in OpenAI's shape and naming its field: a bad body (400), a name already served or
the base model's (400), a path outside ``--lora-dir`` (400), an adapter a worker cannot serve
(400 with its problem: a missing file, another base model's shapes, a rank above
``--max-lora-rank``, an unsupported target), an unknown name to unload (404).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from splitserve.server.engine_client import BaseEngineClient
from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.models import ServedAdapter, ServedModels
from splitserve.server.tenancy import require_operator


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter``'s body (vLLM's fields; ``pinned``: SGLang's)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``'s body (vLLM also accepts ``lora_int_id``: ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, models: ServedModels, client: BaseEngineClient) -> None:
    """Add the adapter load and unload routes over ``models`` (what requests may name) and
    ``client`` (the workers)."""
    lock = asyncio.Lock()  # one load or unload at a time: a name is never half served

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        require_operator(request.scope, "POST /v1/load_lora_adapter")
        body: LoadLoraRequest = await _body(request, LoadLoraRequest)
        name = body.lora_name
        if not name or models.is_base(name):
            raise APIError(f"lora_name: {name!r} is the base model's name", param="lora_name")
        path = models.runtime_path(body.lora_path)
        async with lock:
            if name in models.adapters:
                raise APIError(f"lora_name: adapter {name!r} is already loaded; unload it first",
                               param="lora_name")
            start = time.perf_counter()
            rows = await client.load_lora(name, path, body.pinned)
            elapsed = time.perf_counter() - start
            first = rows[0] if rows else {}
            models.adapters[name] = ServedAdapter(name, path, int(time.time()), body.pinned,
                                                  first.get("digest", ""), first.get("rank", 0))
        return {"object": "lora_adapter", "id": name, "parent": models.base, "path": path,
                "rank": first.get("rank", 0), "pinned": body.pinned,
                "load_ms": round(elapsed * 1e3, 1), "workers": rows,
                "message": f"Success: LoRA adapter '{name}' added successfully."}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        require_operator(request.scope, "POST /v1/unload_lora_adapter")
        body: UnloadLoraRequest = await _body(request, UnloadLoraRequest)
        name = body.lora_name
        async with lock:
            if models.adapters.pop(name, None) is None:
                raise APIError(f"lora_name: adapter {name!r} is not loaded", param="lora_name",
                               status_code=404, code="model_not_found")
            rows = await client.unload_lora(name)
        return {"object": "lora_adapter", "id": name, "deleted": True, "workers": rows,
                "message": f"Success: LoRA adapter '{name}' removed successfully."}


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as ``model``; a bad one is a 400 naming the field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        from pydantic_core import from_json

        try:
            decoded = from_json(raw)
        except ValueError:
            decoded = None
        raise from_validation_errors(exc.errors(), decoded) from None
