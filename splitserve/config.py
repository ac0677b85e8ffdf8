"""Configuration of one worker process (the CLI fills it; tests build it directly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerArgs:
    """Units: tokens, pages, MiB, seconds.

    ``addr`` is the worker's own inbox (``tcp://host:port`` or ``ipc://path``); ``server_addr``
    the inbox of the server it reports ready to.
    """

    role: str  # "prefill" | "decode" | "colocated"
    worker_id: str
    addr: str
    server_addr: str
    model_path: str
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" | "cuda": where the model and the KV pool live
    page_size: int = 16
    kv_cache_mb: int = 512
    max_batch_tokens: int = 2048
    max_running: int = 64
    transfer_timeout_s: float = 30.0
    num_threads: int = 0  # 0: torch's default
    kv_transfer: str = "zmq"  # KV transfer backend (kv_transfer.registry); same on both roles
    router_url: str | None = None  # join this router (POST /workers/register) at start
    api_key: str | None = None  # the router's API key, for registering
    curve_keys: str | None = None  # CURVE key file (splitserve.security): encrypted, authenticated links
    jump_forward: bool = True  # append grammar-forced tokens without sampling them
    overlap_grammar_mask: bool = True  # fill grammar masks on a thread during the forward pass
    disable_radix_cache: bool = False  # prefill/colocated only; decode never caches
    cuda_graph: bool = True  # on CUDA, replay captured graphs for decode steps (engine.cuda_graph)


ROLES = ("prefill", "decode", "colocated")
DTYPES = ("float32", "bfloat16")
KV_TRANSFER_BACKENDS = ("zmq", "shm", "mooncake", "nixl")  # see kv_transfer.registry
