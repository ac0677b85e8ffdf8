"""A request's prefix-cache namespace: its tenant's (``server.tenancy``) with its LoRA adapter
folded in, so a prefix computed under one adapter is never a hit under another or the base
model (their K/V differ from the first adapted layer on).

Pure Python, no torch: workers fold the adapter's digest into each request's namespace
(``worker.tasks``), hence into the block keys their KV events carry; the router folds in the
same digest, as the workers report it (``server.worker_pool.WorkerPool.adapter_key``), so its
cache-aware routing matches those events under the adapter.
"""

from __future__ import annotations

import hashlib


def adapter_namespace(namespace: str | None, adapter: str | None) -> str | None:
    """The namespace of a request in ``namespace`` (None: the shared one) under ``adapter``
    (an identity of the adapter; None or "": the base model, which keeps ``namespace``).
    A hash, as tenant namespaces are: the same size whatever the inputs."""
    if not adapter:
        return namespace
    parts = [b"-" if p is None else f"{len(p)}:{p}".encode() for p in (namespace, adapter)]
    return hashlib.sha256(b"splitserve-lora-ns\0" + b"\0".join(parts)).hexdigest()[:32]
