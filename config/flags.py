"""Command-line flags as a table over the config's fields: each flag names the field it sets, and
its default and choices come from :mod:`splitserve.config.schema` and the registry, so neither is
written twice. A flag left out leaves the field as it is (its default, or what
``--config-json`` gave).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from splitserve.config.registry import (
    GRAMMAR_BACKEND,
    KV_TRANSFER,
    PREFIX_CACHE,
    REASONING_PARSER,
    ROUTING,
    TOOL_CALL_PARSER,
)
from splitserve.config.schema import (
    ATTENTION_CHOICES,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_WRITE_POLICIES,
    QUANTIZATIONS,
    SPECULATIVE_CHOICES,
    ServeConfig,
)

_UNSET = object()


@dataclass(frozen=True, slots=True)
class Flag:
    """``--name`` sets the config field at dotted ``path`` (``engine.page_size``).

    ``const``: the flag takes no value and stores this (``--disable-*`` flags); ``parse``: turns
    the text into the field's value (default: the type of the field's default)."""

    name: str
    path: str
    help: str
    const: Any = _UNSET
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None
    nargs: str | None = None


def parse_cpu_affinity(text: str | Sequence[str]) -> dict[str, list[int]]:
    """``"prefill=0 decode=1"`` or ``["colocated=0-1"]`` -> ``{"prefill": [0], "decode": [1]}``.

    Keys are roles (``prefill``, ``decode``, ``colocated``), worker ids (``decode-1``) or
    ``api-server``; values are CPU lists such as ``0``, ``0,2`` or ``0-3``.

    Raises:
        ValueError: a malformed item.
    """
    items = text.split() if isinstance(text, str) else [x for t in text for x in t.split()]
    out: dict[str, list[int]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"bad CPU affinity {item!r}: use NAME=CPUS, e.g. prefill=0 decode=1")
        cpus: list[int] = []
        for part in value.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad CPU list {value!r} in {item!r}")
            cpus += range(int(lo), int(hi or lo) + 1)
        out[key] = cpus
    return out


def _cpu_affinity(items: list[str]) -> dict[str, list[int]]:
    try:
        return parse_cpu_affinity(items)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_lora_modules(items: Sequence[str]) -> dict[str, str]:
    """``["sql=/adapters/sql", "chat=/adapters/chat"]`` -> ``{"sql": "/adapters/sql", ...}``
    (vLLM's ``--lora-modules name=path`` form; a bare path is named after its folder).

    Raises:
        ValueError: an empty name or path, or a name given twice.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = item.rstrip("/").rsplit("/", 1)[-1], item
        if not name or not path:
            raise ValueError(f"bad LoRA module {item!r}: use NAME=PATH")
        if name in out:
            raise ValueError(f"LoRA module name {name!r} is given twice")
        out[name] = path
    return out


def _lora_modules(items: list[str]) -> dict[str, str]:
    try:
        return parse_lora_modules(items)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _origins(items: list[str]) -> list[str]:
    # Space- or comma-separated, as users write lists of origins.
    return [o for item in items for o in item.replace(",", " ").split()]


ENGINE_FLAGS = (
    Flag("--model", "engine.model", "Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)"),
    Flag("--dtype", "engine.dtype", "auto: bfloat16 on CPUs with AMX/avx512_bf16 (and CUDA), "
         "else float32", choices=DTYPES),
    Flag("--quantization", "engine.quantization", "weights quantized at load: int8 "
         "(weight-only; CPU: one float32 scale per output channel and 32 input channels, "
         "AVX512-VNNI decode products; CUDA: one per output channel), int4 "
         "(weight-only, one float16 scale and offset per 32 input channels; GGUF Q4_0 kept "
         "as stored), or none",
         choices=QUANTIZATIONS),
    Flag("--kv-cache-dtype", "engine.kv_cache_dtype", "KV pool values: auto (the model dtype), "
         "int8 or fp8_e4m3 (8 bits + a float32 scale per token and KV head: ~0.53x the bytes "
         "of bfloat16; quantized as written, de-quantized as read, by the torch and Triton "
         "attention)", choices=KV_CACHE_DTYPES),
    Flag("--kv-host-cache-mb", "engine.kv_host_cache_mb", "L2 prefix-cache tier: host memory "
         "(MiB) outside the KV pool that evicted prefixes move to and come back from (0: none)"),
    Flag("--kv-host-cache-dtype", "engine.kv_host_cache_dtype", "L2 blocks: auto (the pool's "
         "bytes) or int8 / fp8_e4m3 (8 bits + scales: ~1.9x the tokens of bfloat16 in the "
         "same RAM, lossy)", choices=KV_CACHE_DTYPES),
    Flag("--kv-disk-cache-dir", "engine.kv_disk_cache_dir", "L3 prefix-cache tier: a directory "
         "of checksummed KV block files, kept across restarts (one sub-directory per model)",
         parse=str),
    Flag("--kv-disk-cache-gb", "engine.kv_disk_cache_gb", "L3 size (GB); least recently used "
         "blocks go first"),
    Flag("--kv-cache-write-policy", "engine.kv_cache_write_policy", "write_through: copy "
         "cached blocks to L2/L3 at once (a restart finds them all); write_back: only when "
         "evicted from the tier above", choices=KV_WRITE_POLICIES),
    Flag("--kv-store", "engine.kv_store", "prefix-cache tier shared by every worker: "
         "mooncake://HOST:PORT of a mooncake_master, or local (splitserve launch starts one)",
         parse=str),
    Flag("--kv-store-segment-mb", "engine.kv_store_segment_mb", "memory (MiB) each worker "
         "lends the shared store"),
    Flag("--device", "engine.device", "where models and KV pools live; cuda uses the Triton "
         "attention kernels and CUDA graphs ($SPLITSERVE_DEVICE sets the default)", choices=DEVICES),
    Flag("--page-size", "engine.page_size", "tokens per KV page"),
    Flag("--kv-cache-mb", "engine.kv_cache_mb", "KV pool size per worker (MiB)"),
    Flag("--max-batch-tokens", "engine.max_batch_tokens", "token budget of one step"),
    Flag("--max-running", "engine.max_running", "sequences in one step"),
    Flag("--chunked-prefill-size", "engine.chunked_prefill_size", "prompt tokens in one step "
         "while requests decode in it (0: the --max-batch-tokens budget): bounds the step, so "
         "inter-token latency and an urgent prompt's wait for the step in flight"),
    Flag("--no-interrupt-steps", "engine.interrupt_steps", "run every step whole, even when a "
         "prompt more urgent than some of its rows arrives (by default a prefilling worker "
         "gives such a step up between two layers and runs the urgent prompt first)",
         const=False),
    Flag("--transfer-timeout", "engine.transfer_timeout_s", "seconds each KV transfer state "
         "may last without progress"),
    Flag("--watchdog-timeout", "engine.watchdog_timeout_s", "seconds one worker-loop "
         "iteration may run before the worker exits so that its requests fail over and its "
         "launcher restarts it (0: only log the stuck loop)"),
    Flag("--kv-transfer", "engine.kv_transfer", "how KV pages move from prefill to decode "
         "workers (same on both roles)", choices=KV_TRANSFER.names),
    Flag("--prefix-cache", "engine.prefix_cache", "prefix reuse on prefill/colocated workers",
         choices=PREFIX_CACHE.names),
    Flag("--disable-radix-cache", "engine.prefix_cache", "same as --prefix-cache none (the "
         "cache-off baseline)", const="none"),
    Flag("--grammar-backend", "engine.grammar_backend", "grammar backend tried first (the "
         "others are the fallback)", choices=GRAMMAR_BACKEND.names),
    Flag("--grammar-compile-procs", "engine.grammar_compile_procs", "grammar compile processes "
         "per worker, killed at their deadline (0: threads, which cannot be stopped)"),
    Flag("--grammar-compile-timeout", "engine.grammar_compile_timeout_s", "seconds one grammar "
         "compile may run (from its start) before it is killed"),
    Flag("--grammar-compile-queue", "engine.grammar_compile_queue", "grammar compiles that may "
         "wait; more get 503 + Retry-After"),
    Flag("--grammar-cache-mb", "engine.grammar_cache_mb", "MiB of compiled grammars a worker "
         "caches, by their size estimates (least recently used evicted; 0: no byte bound)"),
    Flag("--attention", "engine.attention", "attention backend (auto: torch on CPU, triton on "
         "CUDA; $SPLITSERVE_ATTENTION sets the default)", choices=ATTENTION_CHOICES),
    Flag("--disable-jump-forward", "engine.jump_forward", "sample every token of constrained "
         "outputs, even those the grammar forces", const=False),
    Flag("--disable-mask-overlap", "engine.overlap_grammar_mask", "fill grammar token masks "
         "before each forward pass, not on a thread during it", const=False),
    Flag("--disable-cuda-graph", "engine.cuda_graph", "run decode steps eagerly on CUDA",
         const=False),
    Flag("--kernels", "engine.kernels", "decode-step products: auto (C or oneDNN per step "
         "size, timed once per machine and cached), c, torch (oneDNN only), or a plan file "
         "($SPLITSERVE_KERNELS sets the default)"),
    Flag("--speculative", "engine.speculative", "speculative decoding: ngram drafts tokens "
         "by prompt lookup (the continuation of the last n-gram's earlier occurrence) and "
         "verifies them in one forward pass; same greedy output, same sampling distribution",
         choices=SPECULATIVE_CHOICES),
    Flag("--num-speculative-tokens", "engine.num_speculative_tokens", "most draft tokens per "
         "sequence and step with --speculative"),
    Flag("--speculative-max-running", "engine.speculative_max_running", "draft only while at "
         "most this many sequences decode"),
    Flag("--disable-cpu-kernels", "engine.cpu_kernels", "no C kernels on CPU bfloat16: torch "
         "ops only ($SPLITSERVE_CPU_KERNELS=0)", const=False),
    Flag("--disable-weight-packing", "engine.pack_weights", "keep only the parameters on CPU "
         "bfloat16: no oneDNN or C-kernel copies ($SPLITSERVE_PACK_WEIGHTS=0)", const=False),
    Flag("--disable-fused-decode", "engine.fused_decode", "run decode layers op by op "
         "($SPLITSERVE_FUSED_DECODE=0)", const=False),
    Flag("--disable-decode-kv-cache", "engine.decode_kv_cache", "gather decode K/V from the "
         "paged pool each step ($SPLITSERVE_DECODE_KV_CACHE=0)", const=False),
    Flag("--enable-lora", "engine.enable_lora", "serve LoRA adapters, loaded at run time "
         "(POST /v1/load_lora_adapter; implied by --lora-modules and --lora-dir)", const=True),
    Flag("--lora-modules", "engine.lora_modules", "LoRA adapters (PEFT folders) served from "
         "the start, as NAME=PATH; a request's model field names one",
         parse=_lora_modules, nargs="+"),
    Flag("--max-loras", "engine.max_loras", "LoRA adapter slots: the most adapters one step "
         "runs (others wait for a slot; the least recently used idle one is evicted)"),
    Flag("--max-lora-rank", "engine.max_lora_rank", "largest LoRA rank accepted (1-512)"),
    Flag("--max-loaded-loras", "engine.max_loaded_loras", "most LoRA adapters loaded at once "
         "(0: no limit)"),
    Flag("--lora-dir", "engine.lora_dir", "run-time adapter loads only from under this "
         "folder", parse=str),
    Flag("--pinned-loras", "engine.pinned_loras", "adapters of --lora-modules kept in their "
         "slots, never evicted", parse=list, nargs="+"),
)
LOG_FLAGS = (Flag("--log-level", "log_level", "debug | info | warning | error"),)
SECURITY_FLAGS = (
    Flag("--api-key", "security.api_key", "require 'Authorization: Bearer KEY' (default: "
         "$SPLITSERVE_API_KEY; prefer the variable: flags show in ps)", parse=str),
    Flag("--curve-keys", "security.curve_keys", "CURVE key file (splitserve keygen): encrypt "
         "and authenticate worker links", parse=str),
    Flag("--api-key-file", "security.api_key_file", "file of API keys, one a line (optionally "
         "'KEY NAME [WEIGHT]'): each key is a tenant with its own prefix-cache namespace, rate "
         "limits and fair-queueing weight (default 1)", parse=str),
)
SERVER_FLAGS = (
    Flag("--host", "server.host", "address the HTTP API listens on"),
    Flag("--port", "server.port", "port of the HTTP API"),
    Flag("--routing", "server.routing", "how the API server picks a prefill (or colocated) "
         "worker", choices=ROUTING.names),
    Flag("--max-body-bytes", "server.max_body_bytes", "larger request bodies get 413 (0: no "
         "limit)"),
    Flag("--max-inflight-per-worker", "server.max_inflight_per_worker", "requests running at "
         "once per worker (lane); past it, new ones wait at the router"),
    Flag("--max-queued-per-worker", "server.max_queued_per_worker", "requests that may wait "
         "at the router per worker (lane) for a free slot; past it, 429 + Retry-After "
         "(0: none wait)"),
    Flag("--max-queue-wait", "server.max_queue_wait_s", "seconds a request may wait at the "
         "router for a slot; past it, 429 + Retry-After (0: no limit)"),
    Flag("--no-fair-queueing", "server.fair_queueing", "serve waiting requests first come, "
         "first served instead of tenant by tenant (deficit round robin by API key)",
         const=False),
    Flag("--prepare-threads", "server.prepare_threads", "threads that parse, render the chat "
         "template, tokenize and validate requests off the event loop (16 requests per thread "
         "may wait; more get 503 + Retry-After)"),
    Flag("--dead-after", "server.dead_after_s", "seconds without a worker heartbeat before its "
         "requests fail"),
    Flag("--allowed-origins", "server.allowed_origins", "browser origins allowed to call the "
         "API (CORS), e.g. http://localhost:3000, or '*'", parse=_origins, nargs="+"),
    Flag("--rate-limit", "server.rate_limit_rps", "requests per second per API key (a token "
         "bucket; past it, 429 + Retry-After; 0: unlimited)"),
    Flag("--rate-limit-tokens", "server.rate_limit_tps", "prompt + generated tokens per second "
         "per API key (0: unlimited)"),
    Flag("--chat-template", "server.chat_template", "a Jinja chat template file used instead "
         "of the model's", parse=str),
    Flag("--tool-call-parser", "server.tool_call_parser", "how tool calls are parsed out of "
         "the model's text (auto: the format the chat template names, else the model family's "
         "(engine.model.registry), else the built-in tool prompt's)", choices=("auto", *TOOL_CALL_PARSER.names)),
    Flag("--reasoning-parser", "server.reasoning_parser", "how a reasoning model's thinking is "
         "split from its answer into reasoning_content (auto: the think block the chat "
         "template names; none: no reasoning)", choices=("auto", "none", *REASONING_PARSER.names)),
    Flag("--reasoning-budget", "server.reasoning_budget", "thinking tokens at most for requests "
         "that ask no budget; then the end marker is forced (-1: no limit)"),
    Flag("--responses-store", "server.responses_store", "the SQLite file that keeps "
         "/v1/responses for previous_response_id, GET and background responses (default: "
         "responses.sqlite3 under $SPLITSERVE_CACHE; :memory: keeps them in memory only)",
         parse=str),
    Flag("--responses-store-max-mb", "server.responses_store_max_mb", "stored responses kept "
         "at most (MiB of JSON; the oldest go first)"),
    Flag("--responses-store-max-age", "server.responses_store_max_age_s", "seconds a stored "
         "response is kept"),
)
TRACING_FLAGS = (
    Flag("--otlp-traces-endpoint", "tracing.otlp_traces_endpoint", "export OpenTelemetry "
         "traces of every request over OTLP/HTTP to this URL, e.g. "
         "http://127.0.0.1:4318/v1/traces (default: tracing off)", parse=str),
    Flag("--trace-sample-ratio", "tracing.sample_ratio", "share of requests traced (0..1) "
         "when the caller sent no traceparent header"),
)
UI_FLAGS = (
    Flag("--no-ui", "server.ui", "serve no web page at / (the chat playground and cluster "
         "view)", const=False),
)
CLUSTER_FLAGS = (
    Flag("--threads-per-worker", "cluster.threads_per_worker", "0: split the cores"),
    Flag("--share-cores", "cluster.share_cores", "a worker's step also takes the cores of "
         "the host's workers with nothing to run, while the host's CPU pressure (Linux PSI) "
         "is low (the default)", const=True),
    Flag("--no-share-cores", "cluster.share_cores", "each worker keeps its split of the "
         "cores", const=False),
    Flag("--cpu-affinity", "cluster.cpu_affinity", "pin processes to CPUs, e.g. prefill=0 "
         "decode=1 (or colocated=0-1)", parse=_cpu_affinity, nargs="+"),
)
DISAGGREGATED_FLAGS = (
    Flag("--prefill", "cluster.num_prefill", "prefill workers"),
    Flag("--decode", "cluster.num_decode", "decode workers"),
)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], root: Any = None) -> None:
    """Add ``flags`` to ``parser``; their help shows the defaults of ``root`` (a default
    :class:`ServeConfig`; pass another struct whose paths the flags name, e.g. a
    ``WorkerConfig``)."""
    root = ServeConfig() if root is None else root
    for flag in flags:
        default = _get(root, flag.path)
        kw: dict[str, Any] = {"dest": flag.path, "default": argparse.SUPPRESS}
        metavar = flag.name.lstrip("-").upper().replace("-", "_")
        if flag.const is not _UNSET:
            parser.add_argument(flag.name, action="store_const", const=flag.const,
                                help=flag.help, **kw)
            continue
        if flag.nargs:
            kw["nargs"] = flag.nargs
        if flag.choices is not None:
            kw["choices"] = list(flag.choices)
        else:
            kw["metavar"] = metavar
        parse = flag.parse or (type(default) if default is not None else str)
        if flag.nargs:
            # The whole list at once (argparse would call a type per item).
            kw["action"] = _ParseAll
            kw["const"] = parse
        else:
            kw["type"] = parse
        secret = flag.path == "security.api_key"  # never print a key that came from the env
        shown = "" if secret or default in (None, "", {}, []) else f" (default: {default})"
        parser.add_argument(flag.name, help=flag.help + shown, **kw)


class _ParseAll(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const(values))


def apply_flags(args: argparse.Namespace, config: msgspec.Struct, flags: Sequence[Flag]) -> None:
    """Set the fields of ``config`` that the command line gave (in place)."""
    given = vars(args)
    for flag in flags:
        if flag.path in given:
            _set(config, flag.path, given[flag.path])
