"""Prefill and decode workers driven in-process, for the KV transfer tests: build them, give
them a request, run their loops until a condition holds."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from splitserve.ipc.messages import GenerateTask, SamplingParams, TokenBatch
from splitserve.ipc.sockets import Inbox
from splitserve.kv_transfer.shm_backend import PREFIX, SHM_DIR
from splitserve.worker.main import create_worker
from tests.cluster_config import worker_config

# The optional one-sided backends, skipped when their package is not installed.
OPTIONAL_BACKENDS = [
    pytest.param("mooncake", marks=pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="Mooncake Transfer Engine not installed (pip install 'splitserve[mooncake]')")),
    pytest.param("nixl", marks=pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None,
        reason="NIXL not installed (pip install 'splitserve[nixl]')")),
]
BACKENDS = ["zmq", "shm", *OPTIONAL_BACKENDS]
PROMPT = list(range(100, 190))  # 90 tokens: chunks of 32 -> pages complete before the end
NEW_TOKENS = 6


def make_worker(model_path: Path, role: str, server_addr: str, kv_transfer: str, **kw):
    return create_worker(worker_config(
        model_path, role, server_addr, kv_cache_mb=16, max_batch_tokens=32,
        kv_transfer=kv_transfer,
        # Transfer tests count pages; the prefix cache (tested elsewhere) would keep the
        # prompt's pages after the request.
        prefix_cache="none", **kw))


def task(server: Inbox, prefill_addr: str | None) -> GenerateTask:
    return GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                        sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0),
                        prefill_addr=prefill_addr)


def drain(inbox: Inbox, got: list) -> None:
    while (item := inbox.recv()) is not None:
        got.append(item[0])


def tokens(got: list) -> list[int]:
    outs = sorted((o for m in got if isinstance(m, TokenBatch) for o in m.outputs),
                  key=lambda o: o.index)
    return [t for o in outs for t in o.token_ids]


def finished(got: list) -> bool:
    return any(isinstance(m, TokenBatch) and m.outputs[-1].finish_reason for m in got)


def run_until(workers, server: Inbox, until, timeout_s: float = 60.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            w.run_once(idle_wait_ms=2)
        drain(server, got)
        if until(got):
            return got
    raise AssertionError(f"condition not met; received {got}")


def segments() -> set[str]:
    """This test process's shm segments (its in-process workers name them by its pid): other
    test runs on the machine create and remove their own meanwhile, which must not count."""
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}{os.getpid()}-*")}
