"""The seam between the HTTP API and the workers.

The API (``server.routes``) only talks to a :class:`BaseEngineClient`; ``server.worker_client`` is
the real one (ZeroMQ to prefill/decode or colocated workers). Tests may plug in a fake.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from splitserve.ipc.messages import LoraRef, SamplingParams


@dataclass(slots=True)
class TokenEvent:
    """Tokens generated since the previous event of the same request, in order.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token id) or ``"length"`` (max tokens) on the
    last event; ``error`` is set (and the stream ends) when a worker failed the request, with
    ``error_code`` an HTTP status. ``prompt_len``/``cached_len`` are in tokens. ``prompt_logprobs``: see
    ``messages.TokenOutput``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    error: str | None = None
    error_code: int = 500
    prompt_len: int = 0
    cached_len: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # of cached_len, per cache tier
    prompt_logprobs: list[float] | None = None  # on the first event, when asked for
    # Alternatives per token of ``token_ids`` / ``prompt_logprobs`` (``messages.TokenOutput``).
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    # A worker's stage stamps (``messages.StageStamps``), on the first and the last event.
    stamps: Any = None
    # On a refusal for overload (429): seconds until a retry likely gets in (``Retry-After``).
    retry_after_s: float | None = None
    # A worker's report of the grammar compile it uses (``messages.TokenOutput``): on the first
    # event of each worker that samples a constrained request; "" / [] on the others.
    grammar_backend: str = ""
    grammar_ignored: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PromptAffinity:
    """Requests that share one prompt (the ``n`` choices of a request, ``server.choices``).

    The first of them to be routed records the worker that computes its prompt (the prefill or
    colocated worker) in ``worker``; the others are sent to that worker while it is live, so
    its prefix cache serves them the prompt the first one computed. Clients without routing
    ignore it. ``worker`` is the client's own handle, opaque to the caller.
    """

    worker: Any = None


class BaseEngineClient(abc.ABC):
    """Sends requests to workers and streams their tokens back."""

    @abc.abstractmethod
    def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams,
        cache_namespace: str | None = None, affinity: PromptAffinity | None = None,
        lora: LoraRef | None = None, timing: Any = None, trace: Any = None,
        tenant: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Start ``rid`` and yield its :class:`TokenEvent` s until one has ``finish_reason`` or
        ``error``. Closing the iterator early (``aclose``) aborts the request on the workers.
        ``cache_namespace``: the prefix-cache namespace it may reuse and fill (None: shared).
        ``affinity``: shared by requests with the same prompt, which then go to the worker that
        computed it (:class:`PromptAffinity`); the caller passes it only for ``n`` > 1.
        ``lora``: the LoRA adapter it runs under; the caller passes it only for one.
        ``timing``: its ``observe.timing.RequestTiming``, whose router and worker boundaries
        the client fills; ``trace``: its ``server.request_trace.RequestTrace`` (None: not
        traced), under which each attempt's span goes. Clients without workers may ignore
        both. ``tenant``: who sent it (``server.tenancy``), whose fair share of the workers it
        waits for when they are busy; the caller passes it only for a named tenant. A request
        the client cannot queue ends with an error event with ``error_code`` 429 and
        ``retry_after_s``."""

    @abc.abstractmethod
    async def abort(self, rid: str) -> None:
        """Abort ``rid`` on every worker that holds it; frees its pages there."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True once every worker has reported ready."""

    @abc.abstractmethod
    async def worker_stats(self) -> list[dict]:
        """One dict per worker: ``worker_id``, ``role``, ``pages_total``, ``pages_used``,
        ``num_running``, ``num_waiting``."""

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> list[dict]:
        """Load the LoRA adapter in folder ``path`` as ``name`` on every worker; returns one
        row per worker (``worker_id``, ``digest``, ``rank``, ``load_s``) once all have it.

        Raises:
            APIError: a worker refused it (400 with the adapter's problem; the others unload
                it again), or no worker answered (503).
        """
        raise NotImplementedError

    async def unload_lora(self, name: str) -> list[dict]:
        """Unload adapter ``name`` on every worker (requests already admitted under it finish
        under it); one row per worker."""
        raise NotImplementedError

    async def flush_cache(self) -> list[dict]:
        """Drop every unpinned prefix-cache entry on every worker; returns
        :meth:`worker_stats`-shaped rows taken after the flush. Clients without a cache
        return their stats unchanged."""
        return await self.worker_stats()
