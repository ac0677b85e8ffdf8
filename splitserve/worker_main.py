"""Entry point of one worker process: ``splitserve worker --role prefill|decode|colocated``."""

from __future__ import annotations

import logging

from splitserve.config import WorkerArgs
from splitserve.engine.worker_base import BaseWorker


def create_worker(args: WorkerArgs) -> BaseWorker:
    """Build the worker for ``args.role``.

    Raises:
        ValueError: unknown role.
    """
    if args.role == "prefill":
        from splitserve.prefill.worker import PrefillWorker

        return PrefillWorker(args)
    if args.role in ("decode", "colocated"):
        from splitserve.decode.worker import DecodeWorker

        return DecodeWorker(args)
    raise ValueError(f"unknown worker role {args.role!r}: expected prefill, decode or colocated")


def run_worker(args: WorkerArgs, log_level: str = "info") -> None:
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s"
    )
    worker = create_worker(args)
    if args.router_url:
        from splitserve.engine.heartbeat import register_with_router

        # After loading: the router routes to us as soon as our WorkerReady reaches its inbox.
        args.server_addr = register_with_router(
            args.router_url, args.role, args.worker_id, args.addr, args.api_key
        )
    worker.serve_forever()
