"""An :class:`~splitserve.engine.core.EngineCore` over a loaded model, for tests that drive the
real scheduler and runner in-process (no worker, no sockets)."""

from __future__ import annotations

from typing import Any

import torch

from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.radix_cache.prefix_cache import create_prefix_cache


def make_core(
    model: torch.nn.Module,
    pool: KVPool,
    eos_token_ids: list[int],
    cache: str = "none",
    runner: dict[str, Any] | None = None,
    prefill_only: bool = False,
    **engine: Any,
) -> EngineCore:
    """``engine``: :class:`EngineConfig` fields the scheduler reads (``max_batch_tokens``,
    ``max_running``, ``jump_forward``); ``runner``: :class:`ModelRunner` keywords; ``cache``: a
    prefix cache name (``none`` | ``radix``)."""
    prefix_cache = create_prefix_cache(cache, pool.allocator, pool.page_size)
    scheduler = Scheduler(prefix_cache, EngineConfig(**engine), eos_token_ids, prefill_only)
    runner = {"eos_token_ids": eos_token_ids, **(runner or {})}
    return EngineCore(scheduler, ModelRunner(model, pool, **runner))
