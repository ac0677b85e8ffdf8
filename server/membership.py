"""Worker membership over HTTP: workers join (``POST /workers/register``), operators drain
(``POST /workers/{id}/drain``) and resume them. ``GET /workers`` (in ``server.routes``) lists them.
These routes sit behind the same API key as the rest of the API (a worker that could join
without it would receive users' prompts), and with tenants (``--api-key-file``) they are the
operator's only (``server.tenancy.require_operator``: a tenant's key gets 403)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError, field_validator

from splitserve.config.registry import WORKER_ROLE
from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.tenancy import require_operator
from splitserve.server.worker_pool import WorkerPool


class Registration(BaseModel):
    role: str
    worker_id: str
    addr: str  # the worker's ZeroMQ inbox, e.g. tcp://10.0.0.5:5601

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in WORKER_ROLE.names:
            raise ValueError(f"must be one of {', '.join(WORKER_ROLE.names)}")
        return v

    @field_validator("addr")
    @classmethod
    def _addr(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")) or "*" in v:
            raise ValueError("must be a tcp://HOST:PORT or ipc://PATH address to connect to")
        return v


def install_membership(app: FastAPI, pool: WorkerPool) -> None:
    """Add the membership routes for the workers of ``pool``."""

    @app.post("/workers/register")
    async def register(request: Request) -> dict:
        require_operator(request.scope, "POST /workers/register")
        try:
            reg = Registration.model_validate_json(await request.body())
        except ValidationError as exc:
            raise from_validation_errors(exc.errors()) from None
        known = pool.find(reg.worker_id)
        if known is not None and known.addr != reg.addr and known.ready:
            raise APIError(f"worker_id: '{reg.worker_id}' is already registered at {known.addr}",
                           param="worker_id", status_code=409)
        # "known": already registered here and ready. A worker told otherwise (this router
        # restarted) announces itself again (engine.heartbeat).
        known_ready = known is not None and known.addr == reg.addr and known.ready
        pool.add_worker(reg.role, reg.addr, reg.worker_id)
        return {"worker_id": reg.worker_id, "server_addr": pool.reply_addr, "known": known_ready}

    def _set_draining(worker_id: str, draining: bool) -> dict:
        w = pool.drain(worker_id, draining)
        if w is None:
            raise APIError(f"no worker '{worker_id}'", status_code=404)
        return {"worker_id": w.worker_id, "draining": w.draining, "in_flight": w.in_flight}

    @app.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request) -> dict:
        require_operator(request.scope, "POST /workers/{id}/drain")
        return _set_draining(worker_id, True)

    @app.post("/workers/{worker_id}/resume")
    async def resume(worker_id: str, request: Request) -> dict:
        require_operator(request.scope, "POST /workers/{id}/resume")
        return _set_draining(worker_id, False)
