"""The one configuration, as typed ``msgspec`` structs: built once by the CLI (or a test, or the
Ray launcher's YAML), handed whole to the launcher, the API server and every worker (as JSON on
the child's command line), and read there field by field. Each default is written once, here.

``ServeConfig`` is a cluster: ``engine`` (what every worker runs, identical across the cluster),
``server`` (the HTTP API and router), ``cluster`` (how many processes of which role, on which
CPUs) and ``security``. ``WorkerConfig`` is one worker process: its identity plus the same
``engine`` and ``security``. Units: tokens, pages, MiB, seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from splitserve.config import env
from splitserve.config.registry import (
    ATTENTION,
    GRAMMAR_BACKEND,
    KV_TRANSFER,
    PREFIX_CACHE,
    REASONING_PARSER,
    ROUTING,
    TOOL_CALL_PARSER,
    WORKER_ROLE,
)

DTYPES = ("auto", "float32", "bfloat16")  # "auto" is resolved once, by the CLI (kernels.cpu.features)
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, at load (engine.model.quant[_int4])
# KV pool values: auto (the model dtype) or 8 bits with per-token-and-head scales (engine.kv_quant)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
ATTENTION_CHOICES = ("auto", *ATTENTION.names)  # auto: torch on CPU, triton on CUDA
SPECULATIVE_CHOICES = ("none", "ngram")
KV_WRITE_POLICIES = ("write_through", "write_back")  # when blocks go down a cache tier


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a worker runs: model, dtype, memory, step budget and the engine's switches.

    Prefill and decode workers of one cluster must agree on ``model`` (its parsed config),
    ``quantization``, ``dtype``, ``page_size``, ``kv_cache_dtype`` and ``kv_transfer`` (the KV
    handshake refuses a mismatch, naming both sides).
    """

    model: str = ""  # a Hugging Face model folder or .gguf file ("": the default model; the CLI resolves it)
    dtype: str = "auto"
    device: str = msgspec.field(default_factory=lambda: env.text(env.DEVICE, "cpu"))
    page_size: int = 16  # tokens per KV page
    kv_cache_mb: int = 512  # KV pool per worker
    max_batch_tokens: int = 2048  # new tokens per forward pass (prefill chunks + decodes)
    max_running: int = 64  # sequences in one forward pass
    # Prompt tokens per forward pass while requests decode in it (SGLang's --chunked-prefill-size;
    # Sarathi-Serve's chunk): bounds the step, so the decode rows' inter-token latency and the
    # wait of an urgent prompt for the step in flight. 0: max_batch_tokens. A step with no decode
    # row takes up to max_batch_tokens of prompts either way.
    chunked_prefill_size: int = 0
    # A prefilling worker gives up a layer-by-layer step between two layers when a prompt more
    # urgent than some of its rows arrives (engine.step_interrupt; worker.urgent_peek): the urgent
    # prompt's first token does not wait for the step in flight. False: steps always run whole.
    interrupt_steps: bool = True
    transfer_timeout_s: float = 30.0  # every KV transfer state's bound
    # One worker-loop iteration longer than this ends the worker (worker.stall_watch; SGLang's
    # --watchdog-timeout): its router fails its requests over, its launcher restarts it. 0: the
    # stuck loop is only logged.
    watchdog_timeout_s: float = 300.0
    kv_transfer: str = KV_TRANSFER.default
    prefix_cache: str = PREFIX_CACHE.default  # "none": the cache-off baseline
    grammar_backend: str = GRAMMAR_BACKEND.default  # tried first; the others as fallback
    jump_forward: bool = True  # append grammar-forced tokens without sampling them
    # Grammar compiles run in this many child processes per worker, killed at their deadline
    # (engine.grammar.compile_pool; 0: threads in the worker, which cannot be stopped); past
    # grammar_compile_queue waiting compiles a request gets 503 + Retry-After.
    grammar_compile_procs: int = 2
    grammar_compile_timeout_s: float = 30.0
    grammar_compile_queue: int = 256
    # Compiled grammars a worker caches: at most this many MiB by their size estimates
    # (engine.grammar.service; 0: bounded by count only).
    grammar_cache_mb: int = 512
    grammar_test_slow: str = ""  # tests only: "MARKER=SECONDS" delays compiles of such texts
    overlap_grammar_mask: bool = True  # fill grammar masks on a thread during the forward pass
    cuda_graph: bool = True  # on CUDA, replay captured graphs for decode steps
    attention: str = msgspec.field(default_factory=lambda: env.text(env.ATTENTION, "auto"))
    # CPU bfloat16 switches (each on by default; off trades speed for a simpler path).
    cpu_kernels: bool = msgspec.field(default_factory=lambda: env.switch(env.CPU_KERNELS))
    pack_weights: bool = msgspec.field(default_factory=lambda: env.switch(env.PACK_WEIGHTS))
    fused_decode: bool = msgspec.field(default_factory=lambda: env.switch(env.FUSED_DECODE))
    decode_kv_cache: bool = msgspec.field(default_factory=lambda: env.switch(env.DECODE_KV_CACHE))
    # Decode-step products: "auto" (C or oneDNN per step size, timed once per machine), "c",
    # "torch" (oneDNN only), or a plan file (engine.model.kernel_plan).
    kernels: str = msgspec.field(default_factory=lambda: env.text(env.KERNELS, "auto"))
    # Speculative decoding on decoding workers: "none" or "ngram" (prompt lookup,
    # engine.sched.ngram): up to num_speculative_tokens drafts per row, verified in one pass,
    # while at most speculative_max_running sequences decode (beyond that a step is no longer
    # bound by streaming the weights, and drafts cost more than they save).
    speculative: str = "none"
    num_speculative_tokens: int = 4
    speculative_max_running: int = 4
    # Weights quantized at load: "int8" (per-output-channel; engine.model.quant), "int4"
    # (asymmetric groups of 32, float16 scale and offset; engine.model.quant_int4), "none".
    quantization: str = "none"
    # KV pool values: "auto" (the model dtype), "int8" or "fp8_e4m3" (engine.kv_quant; the
    # torch attention backend only, which de-quantizes as it reads).
    kv_cache_dtype: str = "auto"
    # LoRA adapters (engine.lora, docs/lora.md). On when enable_lora, or lora_modules or
    # lora_dir are given: adapters at start (name -> PEFT folder) and at run time
    # (POST /v1/load_lora_adapter, only from under lora_dir when it is set); max_loras slots
    # (adapters one step runs), ranks up to max_lora_rank, at most max_loaded_loras loaded (0:
    # no limit); pinned_loras stay in their slots.
    enable_lora: bool = False
    lora_modules: dict[str, str] = {}
    max_loras: int = 4
    max_lora_rank: int = 64
    max_loaded_loras: int = 0
    lora_dir: str | None = None
    pinned_loras: list[str] = []
    # KV cache tiers under the prefix cache (radix_cache.tiered_cache; docs/serving.md):
    # L2 host memory outside the pool (MiB, 0: none), its blocks' dtype (auto: the pool's
    # bytes; int8 / fp8_e4m3: 8 bits + scales, ~1.9x the tokens of bfloat16 in the same RAM);
    # L3 a directory of block files ("": none) that survives restarts, and its size; when
    # blocks go down a tier; and a store shared by every worker ("mooncake://HOST:PORT" of a
    # mooncake_master; "local": the launcher starts one; "": none) with the memory each worker
    # lends it.
    kv_host_cache_mb: int = 0
    kv_host_cache_dtype: str = "auto"
    kv_disk_cache_dir: str = ""
    kv_disk_cache_gb: float = 16.0
    kv_cache_write_policy: str = "write_through"
    kv_store: str = ""
    kv_store_segment_mb: int = 256

    def check(self) -> None:
        """Raises: ValueError naming the first field out of range or not a registered name."""
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("attention", self.attention, ATTENTION_CHOICES)
        _choice("speculative", self.speculative, SPECULATIVE_CHOICES)
        for field in ("num_speculative_tokens", "speculative_max_running"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, not {getattr(self, field)}")
        for field, registry in (("kv_transfer", KV_TRANSFER), ("prefix_cache", PREFIX_CACHE),
                                ("grammar_backend", GRAMMAR_BACKEND)):
            _choice(field, getattr(self, field), registry.names)
        for field in ("page_size", "kv_cache_mb", "max_batch_tokens", "max_running"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, not {getattr(self, field)}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be at least 0, not "
                             f"{self.chunked_prefill_size}")
        if self.kernels not in ("auto", "c", "torch") and not Path(self.kernels).is_file():
            raise ValueError(f"kernels: {self.kernels!r} is not auto, c, torch or a plan file")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be positive, not {self.transfer_timeout_s}")
        if self.watchdog_timeout_s < 0:
            raise ValueError(f"watchdog_timeout_s must be >= 0, not {self.watchdog_timeout_s}")
        if self.grammar_cache_mb < 0:
            raise ValueError(f"grammar_cache_mb must be >= 0, not {self.grammar_cache_mb}")
        self._check_lora()
        self.check_tiers()

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be 1..512, not {self.max_lora_rank}")
        if self.max_loaded_loras < 0:
            raise ValueError(f"max_loaded_loras must be >= 0, not {self.max_loaded_loras}")
        unknown = [n for n in self.pinned_loras if n not in self.lora_modules]
        if unknown:
            raise ValueError(f"pinned_loras: {unknown[0]!r} is not one of lora_modules")
        if len(self.pinned_loras) >= self.max_loras:
            raise ValueError(f"pinned_loras: {len(self.pinned_loras)} pinned adapters need "
                             f"max_loras > {len(self.pinned_loras)} (one slot stays unpinned)")
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            raise ValueError(f"lora_dir: no such folder {self.lora_dir!r}")

    def check_tiers(self) -> None:
        """Raises: ValueError naming the first cache-tier field out of range."""
        _choice("kv_host_cache_dtype", self.kv_host_cache_dtype, KV_CACHE_DTYPES)
        _choice("kv_cache_write_policy", self.kv_cache_write_policy, KV_WRITE_POLICIES)
        if self.kv_host_cache_mb < 0:
            raise ValueError(f"kv_host_cache_mb must be >= 0, not {self.kv_host_cache_mb}")
        if self.kv_disk_cache_gb <= 0:
            raise ValueError(f"kv_disk_cache_gb must be positive, not {self.kv_disk_cache_gb}")
        if self.kv_store_segment_mb < 16:
            raise ValueError("kv_store_segment_mb must be at least 16 (Mooncake's smallest "
                             f"segment), not {self.kv_store_segment_mb}")
        if self.kv_store not in ("", "local") and not self.kv_store.startswith("mooncake://"):
            raise ValueError(f"kv_store: {self.kv_store!r} is not mooncake://HOST:PORT, local "
                             "or empty")
        if self.kv_cache_dtype != "auto" and self.kv_host_cache_dtype not in (
                "auto", self.kv_cache_dtype):
            raise ValueError(f"kv_host_cache_dtype {self.kv_host_cache_dtype} on a "
                             f"{self.kv_cache_dtype} KV pool: use auto (the pool's own bytes)")

    @property
    def has_cache_tiers(self) -> bool:
        """Whether any tier below the KV pool is configured."""
        return bool(self.kv_host_cache_mb or self.kv_disk_cache_dir or self.kv_store)

    @property
    def lora_enabled(self) -> bool:
        """Whether workers serve LoRA adapters."""
        return self.enable_lora or bool(self.lora_modules) or self.lora_dir is not None


class SecurityConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``api_key``: ``Authorization: Bearer KEY`` on the HTTP API and for workers joining it.
    Never written on a command line (the launcher hands it to children in the environment).
    ``curve_keys``: a CURVE key file (``splitserve keygen``): encrypted, authenticated links.
    ``api_key_file``: more keys, one a line (optionally ``KEY NAME``), each its own tenant: its
    own prefix-cache namespace and rate limits (``server.tenancy``)."""

    api_key: str | None = msgspec.field(default_factory=lambda: env.optional_text(env.API_KEY))
    curve_keys: str | None = None
    api_key_file: str | None = None


class TracingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry traces (``observe.tracing``, docs/observability.md): every process of the
    cluster exports its spans over OTLP/HTTP to ``otlp_traces_endpoint`` (vLLM's
    ``--otlp-traces-endpoint``; e.g. ``http://127.0.0.1:4318/v1/traces``). None: tracing off,
    and no OpenTelemetry module is imported. ``sample_ratio``: the share of requests traced
    (by trace id, 0..1) when the caller sent no ``traceparent``; one that did is traced as its
    sampled flag says."""

    otlp_traces_endpoint: str | None = None
    sample_ratio: float = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_traces_endpoint)

    def check(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be within [0, 1], not {self.sample_ratio}")
        endpoint = self.otlp_traces_endpoint
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint: {endpoint!r} is not an http(s) URL")


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The API server (router): where it listens and how it picks and guards workers."""

    host: str = "127.0.0.1"
    port: int = 8000
    inbox: str | None = None  # ZeroMQ inbox workers reply to (None: a free port on host)
    routing: str = ROUTING.default  # how a prefill (or colocated) worker is picked
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413 (0: no limit)
    # Requests running at once per worker lane (server.admission.lanes); past it, new ones wait
    # at the router, at most max_queued_per_worker per lane, then 429 + Retry-After.
    max_inflight_per_worker: int = 256
    max_queued_per_worker: int = 256
    # Seconds a request may wait at the router for a slot; past it, 429 + Retry-After
    # (0: no limit; it waits until admitted or its client leaves).
    max_queue_wait_s: float = 600.0
    # Waiting requests are served tenant by tenant (API key), deficit round robin weighted by
    # the key file's weights (server.fair_queue); False: first come, first served.
    fair_queueing: bool = True
    # Threads that parse, render, tokenize and validate requests off the event loop
    # (server.offload); 16 per thread may wait, more get 503 + Retry-After.
    prepare_threads: int = 2
    dead_after_s: float = 5.0  # without a heartbeat for this long, a worker's requests fail
    # Browser origins allowed to call the API (CORS), e.g. ["http://localhost:3000"]; "*" for
    # any. Empty: no CORS headers, so browsers refuse cross-origin calls.
    allowed_origins: list[str] = []
    # Per tenant (API key): requests and prompt + generated tokens per second; past them, 429
    # with Retry-After (server.rate_limit). 0: unlimited.
    rate_limit_rps: float = 0.0
    rate_limit_tps: float = 0.0
    chat_template: str | None = None  # a Jinja chat template file replacing the model's
    tool_call_parser: str = "auto"  # or a TOOL_CALL_PARSER name; auto: the template, else the family
    # A REASONING_PARSER name, "none", or "auto": the family the chat template's think block
    # names (none without one). And the thinking budget of requests that ask none (-1: none).
    reasoning_parser: str = "auto"
    reasoning_budget: int = -1
    # Stored /v1/responses (server.responses_api.store): a SQLite file ("": responses.sqlite3
    # under $SPLITSERVE_CACHE; ":memory:": kept in memory only), its size and age bounds.
    responses_store: str = ""
    responses_store_max_mb: int = 1024
    responses_store_max_age_s: float = 30 * 86400.0
    ui: bool = True  # the built-in web page at / (server.ui); False: no page, / is a 404

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def check(self) -> None:
        _choice("routing", self.routing, ROUTING.names)
        _choice("tool_call_parser", self.tool_call_parser, ("auto", *TOOL_CALL_PARSER.names))
        _choice("reasoning_parser", self.reasoning_parser,
                ("auto", "none", *REASONING_PARSER.names))
        if self.reasoning_budget < -1:
            raise ValueError(f"reasoning_budget must be >= -1 (-1: none), not "
                             f"{self.reasoning_budget}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template: no such file {self.chat_template!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        if self.max_inflight_per_worker < 1:
            raise ValueError(f"max_inflight_per_worker must be at least 1, not "
                             f"{self.max_inflight_per_worker}")
        if self.max_queued_per_worker < 0:
            raise ValueError(f"max_queued_per_worker must be >= 0, not "
                             f"{self.max_queued_per_worker}")
        if not self.max_queue_wait_s >= 0:
            raise ValueError(f"max_queue_wait_s must be >= 0, not {self.max_queue_wait_s}")
        if self.prepare_threads < 1:
            raise ValueError(f"prepare_threads must be at least 1, not {self.prepare_threads}")
        for field in ("rate_limit_rps", "rate_limit_tps"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, not {getattr(self, field)}")
        for field in ("responses_store_max_mb", "responses_store_max_age_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, not {getattr(self, field)}")

    @property
    def responses_store_path(self) -> str:
        """The stored responses' database file (``responses_store``, or its default under
        ``$SPLITSERVE_CACHE``)."""
        return self.responses_store or str(env.cache_dir() / "responses.sqlite3")


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which processes a local launch starts."""

    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False  # one worker that prefills and decodes, instead of the two pools
    threads_per_worker: int = 0  # 0: split the machine's cores (or a worker's pinned CPUs)
    # Role, worker id or "api-server" -> CPU ids, e.g. {"prefill": [0], "decode": [1]}
    # (config.flags.parse_cpu_affinity reads the CLI's "prefill=0 decode=1").
    cpu_affinity: dict[str, list[int]] = {}
    extra_env: dict[str, str] = {}  # added to every child's environment
    # Workers on this host take the cores the idle ones leave, step by step (worker.core_share);
    # only where the cores are split (no threads_per_worker, no cpu_affinity), and only while
    # the host's CPU pressure (Linux PSI) says it is not busy with other work.
    share_cores: bool = True

    @property
    def roles(self) -> list[str]:
        """One role per worker process, in start order."""
        if self.colocated:
            return ["colocated"]
        return ["prefill"] * self.num_prefill + ["decode"] * self.num_decode


class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A whole cluster (``splitserve launch`` / ``serve``; ``api-server`` reads ``server``)."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    log_level: str = "warning"

    @property
    def url(self) -> str:
        return self.server.url

    def check(self) -> None:
        self.engine.check()
        self.server.check()
        self.tracing.check()

    @classmethod
    def from_fields(cls, log_level: str = "warning", **fields: Any) -> ServeConfig:
        """A config from field names of any section (``kv_cache_mb=64, num_decode=2,
        port=8001``): each goes to the one section that has it. For scripts and tests that
        name a few fields; the CLI fills sections by path.

        Raises:
            TypeError: a name no section (or more than one) has.
        """
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in fields.items():
            owners = [n for n, kind in _SECTIONS.items() if key in kind.__struct_fields__]
            if len(owners) != 1:
                raise TypeError(f"config field {key!r} is in {owners or 'no section'}")
            sections[owners[0]][key] = value
        return cls(**{n: _SECTIONS[n](**kw) for n, kw in sections.items()}, log_level=log_level)


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "engine": EngineConfig, "server": ServerConfig, "cluster": ClusterConfig,
    "security": SecurityConfig, "tracing": TracingConfig,
}


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One worker process.

    ``addr`` is the worker's own inbox (``tcp://host:port`` or ``ipc://path``); ``server_addr``
    the inbox of the API server it reports to, or ``router_urls`` to join one or more over HTTP
    (``POST /workers/register``), which then give their inboxes. Several routers share the
    worker (each sends its own tasks; the worker admits by its own free pages).
    """

    role: str
    worker_id: str
    addr: str
    server_addr: str = ""
    router_urls: list[str] = []
    num_threads: int = 0  # 0: torch's default
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    log_level: str = "warning"
    node: str = ""  # the node it runs on, for GET /workers (Ray: the node id; "": the hostname)
    # The host's core-share file and this worker's byte in it (worker.core_share; "": none),
    # and the threads the host's workers may use in all.
    core_share: str = ""
    core_share_slot: int = 0
    host_threads: int = 0

    def check(self) -> None:
        _choice("role", self.role, WORKER_ROLE.names)
        self.engine.check()
        self.tracing.check()


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field}: {value!r} is not one of {choices}")


def to_json(config: msgspec.Struct) -> str:
    """``config`` as JSON for a child's ``--config-json``, without the API key (children get it
    in the environment: a command line is visible to every user of the machine)."""
    data = msgspec.to_builtins(config)
    if "security" in data:
        data["security"].pop("api_key", None)
    return msgspec.json.encode(data).decode()


def from_json(text: str | bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Decode ``--config-json``; missing fields take their defaults (the API key from the
    environment).

    Raises:
        ValueError: not valid JSON of ``kind`` (names the offending field).
    """
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad {kind.__name__}: {exc}") from exc
