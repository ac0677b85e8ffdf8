"""A deterministic stand-in for the workers, for API tests and for running the HTTP server alone.

It "generates" the tokens of a fixed reply text, whatever the prompt, so tests know the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from splitserve.ipc.messages import LoraRef, SamplingParams
from splitserve.radix_cache.token_prefix import common_prefix_len
from splitserve.server.engine_client import BaseEngineClient, PromptAffinity, TokenEvent

DEFAULT_REPLY = "Hello from the fake engine! héllo 世界 🚀 The end."


class FakeEngineClient(BaseEngineClient):
    """Replies with ``reply`` tokenized, ``tokens_per_event`` tokens per event.

    Without ``ignore_eos`` it ends with ``eos_token_id`` (finish ``"stop"``) once the reply is out;
    with it the reply repeats. ``max_new_tokens`` cuts either (finish ``"length"``). The prompt's
    longest common prefix with any earlier prompt is reported as ``cached_len`` (a toy prefix
    cache). For tests it records every request (``requests``), every abort (``aborted``) and every
    request it finished (``finished``); a test in another thread than the server's waits for one
    of those with :meth:`wait_until`. It can fail requests: ``error = (message, http_status)``
    after ``error_after_events`` events; and stall them: after ``stall_after_events`` events (0:
    before the first) it sends nothing more until the request is aborted, like a worker between
    two tokens of a long step, so only a disconnect the server notices can end the request.
    ``reply_for``: when set, each request's reply text is ``reply_for(sampling)`` (e.g. one per
    seed, to tell choices apart). The ``affinity`` of each request is recorded (``affinities``),
    and its LoRA adapter (``loras``). Adapter loads succeed for a folder with an
    ``adapter_config.json`` (recorded in ``loaded_loras``) and fail as a worker's would
    otherwise. ``grammar_report``: ``(backend, ignored keywords)`` its first event reports as
    the grammar compile a worker used (None: no report, as for free text).
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_id: int,
        reply: str = DEFAULT_REPLY,
        tokens_per_event: int = 2,
        delay_s: float = 0.0,
        reply_for: Callable[[SamplingParams], str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reply_for = reply_for
        self.affinities: list[PromptAffinity | None] = []
        self.tenants: list[str | None] = []  # each request's tenant, in arrival order
        self.reply_ids: list[int] = tokenizer.encode(reply, add_special_tokens=False)
        self.eos_token_id = eos_token_id
        self.tokens_per_event = tokens_per_event
        self.delay_s = delay_s
        self.ready = True
        self.error: tuple[str, int] | None = None
        self.error_after_events = 0
        self.error_retry_after_s: float | None = None  # the error event's (an overload's 429)
        self.stall_after_events: int | None = None
        self.grammar_report: tuple[str, list[str]] | None = None
        # Set: every request's first event waits until it is set (a slow prefill, for tests
        # that must see what a stream does meanwhile); a threading.Event, the test's thread sets it.
        self.hold_first: threading.Event | None = None
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self._prompts: list[tuple[str | None, list[int]]] = []  # (cache namespace, prompt)
        self.namespaces: list[str | None] = []  # each request's cache namespace, in order
        self.loras: list[LoraRef | None] = []  # each request's LoRA adapter, in order
        self.loaded_loras: dict[str, str] = {}  # name -> folder
        # Notified on every change to requests/aborted/finished (the server may run in a thread).
        self._recorded = threading.Condition()

    def wait_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``condition()`` holds, re-checking it after each recorded request, abort
        and finish; returns its last value (False if it still fails after ``timeout_s``)."""
        with self._recorded:
            return self._recorded.wait_for(condition, timeout=timeout_s)

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        with self._recorded:
            yield
            self._recorded.notify_all()

    def output_ids(self, sampling: SamplingParams) -> list[int]:
        """The tokens a request with ``sampling`` gets, in order."""
        stops = self._stop_ids(sampling)
        reply_ids = self.reply_ids
        if self.reply_for is not None:
            reply_ids = self.tokenizer.encode(self.reply_for(sampling), add_special_tokens=False)
        if sampling.ignore_eos:
            stream = itertools.cycle(reply_ids)
            return list(itertools.islice(stream, sampling.max_new_tokens))
        out: list[int] = []
        for tok in [*reply_ids, self.eos_token_id]:
            out.append(tok)
            if tok in stops or len(out) == sampling.max_new_tokens:
                break
        return out

    def _stop_ids(self, sampling: SamplingParams) -> set[int]:
        return {self.eos_token_id, *sampling.stop_token_ids}

    async def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams,
        cache_namespace: str | None = None, affinity: PromptAffinity | None = None,
        lora: LoraRef | None = None, timing: Any = None, trace: Any = None,
        tenant: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        with self._recording():
            self.requests.append((rid, list(input_ids), sampling))
            self.tenants.append(tenant)
            self.affinities.append(affinity)
            self.loras.append(lora)
        # A cache that, like the workers' radix cache, shares only within one namespace.
        cached_len = max((common_prefix_len(p, input_ids) for ns, p in self._prompts
                          if ns == cache_namespace), default=0)
        self._prompts.append((cache_namespace, list(input_ids)))
        self.namespaces.append(cache_namespace)
        out = self.output_ids(sampling)
        done = False
        try:
            for num_events, start in enumerate(range(0, len(out), self.tokens_per_event)):
                if num_events == 0 and self.hold_first is not None:
                    await asyncio.to_thread(self.hold_first.wait)
                if self.stall_after_events is not None and num_events >= self.stall_after_events:
                    await asyncio.Event().wait()  # until cancelled or closed: the abort
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.error is not None and num_events >= self.error_after_events:
                    done = True
                    yield TokenEvent([], [], error=self.error[0], error_code=self.error[1],
                                     retry_after_s=self.error_retry_after_s)
                    return
                ids = out[start : start + self.tokens_per_event]
                is_last = start + len(ids) >= len(out)
                finish = None
                if is_last:
                    ended_on_stop = not sampling.ignore_eos and out[-1] in self._stop_ids(sampling)
                    finish = "stop" if ended_on_stop else "length"
                    done = True
                    with self._recording():
                        self.finished.add(rid)
                backend, ignored = (self.grammar_report if num_events == 0 and
                                    self.grammar_report is not None else ("", []))
                yield TokenEvent(
                    ids,
                    [0.0] * len(ids),
                    finish_reason=finish,
                    prompt_len=len(input_ids),
                    cached_len=cached_len,
                    grammar_backend=backend,
                    grammar_ignored=list(ignored),
                )
        finally:
            if not done:  # closed early: what the real client does on aclose
                await self.abort(rid)

    async def abort(self, rid: str) -> None:
        with self._recording():
            self.aborted.add(rid)

    def is_ready(self) -> bool:
        return self.ready

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> list[dict]:
        from splitserve.server.errors import APIError

        if not (Path(path) / "adapter_config.json").is_file():
            raise APIError(f"lora_path: adapter_config.json not found in {path}",
                           param="lora_path")
        self.loaded_loras[name] = path
        return [{"worker_id": "fake-0", "role": "colocated", "error": "", "digest": "fake",
                 "rank": 8, "load_ms": 0.0}]

    async def unload_lora(self, name: str) -> list[dict]:
        self.loaded_loras.pop(name, None)
        return [{"worker_id": "fake-0", "role": "colocated", "error": ""}]

    async def worker_stats(self) -> list[dict]:
        return [
            {
                "worker_id": "fake-0",
                "role": "colocated",
                "pages_total": 1024,
                "pages_used": 0,
                "num_running": 0,
                "num_waiting": 0,
            }
        ]
