"""Entry point of one worker process (``splitserve worker``): build the role's worker from its
:class:`~splitserve.config.WorkerConfig`, join the router if asked, serve until stopped."""

from __future__ import annotations

import gc
import logging

from splitserve.config import WorkerConfig
from splitserve.config.registry import WORKER_ROLE
from splitserve.worker.build import build_parts
from splitserve.worker.loop import Worker


def create_worker(config: WorkerConfig) -> Worker:
    """Build the worker for ``config.role``: its parts (``worker.build``, which loads the model)
    and the loop over them, driven by the role's policy
    (``splitserve.config.registry.WORKER_ROLE`` names each role's ``worker.role.WorkerRole``).

    Raises:
        ValueError: unknown role, or a config field out of range.
    """
    config.check()
    role = WORKER_ROLE.load(config.role)
    return Worker(build_parts(config, role), role)


def run_worker(config: WorkerConfig) -> None:
    """Build the worker, register with each of ``config.router_urls`` (if any), serve until
    SIGTERM or ``Shutdown``."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {config.worker_id} %(levelname)s %(message)s",
    )
    worker = create_worker(config)
    inboxes = None
    if config.router_urls:
        from splitserve.worker.heartbeat import register_with_router

        # After loading: a router routes to us as soon as our WorkerReady reaches its inbox.
        inboxes = [
            register_with_router(url, config.role, config.worker_id, config.addr,
                                 config.security.api_key)
            for url in config.router_urls
        ]
    # The model, tokenizer and pools live as long as the process: moved out of the collector's
    # reach, a full collection no longer walks them between decode steps (vLLM and SGLang do
    # the same after start-up).
    gc.collect()
    gc.freeze()
    worker.serve_forever(inboxes)
