"""``splitserve`` command line: launch | serve | worker | api-server | demo."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time

from splitserve.config import KV_TRANSFER_BACKENDS, ROLES, WorkerArgs
from splitserve.engine.cpu_features import DTYPE_CHOICES, resolve_dtype

API_KEY_ENV = "SPLITSERVE_API_KEY"
DEVICE_ENV = "SPLITSERVE_DEVICE"


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="auto: bfloat16 on CPUs with AMX/avx512_bf16 (and CUDA), else float32")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool size per worker (MiB)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-running", type=int, default=64, help="sequences in one step")
    p.add_argument("--kv-transfer", choices=KV_TRANSFER_BACKENDS, default="zmq",
                   help="how KV pages move from prefill to decode workers (same on both roles)")
    p.add_argument(
        "--disable-jump-forward", action="store_true",
        help="sample every token of constrained outputs, even those the grammar forces",
    )
    p.add_argument(
        "--disable-mask-overlap", action="store_true",
        help="fill grammar token masks before each forward pass, not on a thread during it",
    )
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix reuse on prefill/colocated workers (the cache-off baseline)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default=os.environ.get(DEVICE_ENV, "cpu"),
                   help=f"where models and KV pools live (default ${DEVICE_ENV} or cpu); cuda uses "
                   "the Triton attention kernels and CUDA graphs")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly on CUDA (no CUDA-graph capture)")
    p.add_argument("--log-level", default="warning")


def _add_routing_flag(p: argparse.ArgumentParser) -> None:
    from splitserve.server.routing import ROUTING_POLICIES

    p.add_argument("--routing", choices=sorted(ROUTING_POLICIES), default="cache_aware",
                   help="how the API server picks a prefill (or colocated) worker")
def _add_security_flags(p: argparse.ArgumentParser, server: bool) -> None:
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                        "prefer the variable: flags show in ps)")
    p.add_argument("--curve-keys", default=None,
                   help="CURVE key file (splitserve keygen): encrypt and authenticate worker links")
    if server:
        p.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                       help="larger request bodies get 413 (0: no limit)")
        p.add_argument("--max-inflight-per-worker", type=int, default=256,
                       help="past this many requests on a worker, new ones get 503 + Retry-After")
        p.add_argument("--dead-after", type=float, default=5.0,
                       help="seconds without a worker heartbeat before its requests fail")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    _add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads-per-worker", type=int, default=0, help="0: split the cores")
    p.add_argument("--cpu-affinity", nargs="+", default=[], metavar="NAME=CPUS",
                   help="pin processes to CPUs, e.g. prefill=0 decode=1 (or colocated=0-1)")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds")
    _add_routing_flag(p)
    _add_security_flags(p, server=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="disaggregated cluster: API server + prefill + decode workers")
    _add_cluster_flags(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="launch on this Ray cluster (needs --config; pip install ray)")
    p.add_argument("--config", default=None, help="cluster spec YAML (see splitserve.ray_launch)")

    p = sub.add_parser("serve", help="one colocated worker (prefill and decode in one process)")
    _add_cluster_flags(p)

    p = sub.add_parser("demo", help="launch the default cluster, send real requests, stop")
    _add_cluster_flags(p)

    p = sub.add_parser("worker", help="one worker: joins --router, or is started by launch/serve")
    _add_engine_flags(p)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--worker-id", default=None, help="default: ROLE-HOSTNAME-PID")
    p.add_argument("--router", default=None, help="join the router at http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address of this worker's inbox")
    p.add_argument("--port", type=int, default=0, help="port of this worker's inbox (0: any)")
    p.add_argument("--addr", default=None, help="this worker's inbox (overrides --host/--port)")
    p.add_argument("--server-addr", default=None, help="the API server's inbox (without --router)")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0)
    _add_security_flags(p, server=False)

    p = sub.add_parser("keygen", help="write a CURVE key file for --curve-keys")
    p.add_argument("path")

    p = sub.add_parser("api-server", help="the HTTP API process (started by launch/serve)")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--inbox", default=None,
                   help="ZeroMQ inbox workers reply to (default: a free port on --host)")
    for role in ROLES:
        p.add_argument(f"--{role}-addr", action="append", default=[])
    _add_routing_flag(p)
    p.add_argument("--log-level", default="warning")
    _add_security_flags(p, server=True)
    return parser


def _model_path(model: str | None) -> str:
    from splitserve.default_model import resolve_model_path

    try:
        return str(resolve_model_path(model))
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")


def _dtype(name: str, device: str, report: bool = False) -> str:
    """Resolve ``--dtype auto`` (once, in the launcher, so that every worker agrees); exit with
    a clear message when ``device`` is cuda and torch sees no GPU."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit(
                f"error: --device cuda, but torch {torch.__version__} sees no CUDA GPU "
                "(a CPU build of torch, or no driver): use --device cpu"
            )
    dtype, why = resolve_dtype(name, device)
    if report:
        print(f"splitserve: dtype {dtype} ({why})", file=sys.stderr, flush=True)
    return dtype


def _cluster_spec(args: argparse.Namespace, colocated: bool):
    from splitserve.engine.model_config import ModelConfig
    from splitserve.launcher import ClusterSpec, parse_cpu_affinity

    path = _model_path(args.model)
    try:
        affinity = parse_cpu_affinity(args.cpu_affinity)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    try:
        ModelConfig.from_dir(path)  # unsupported architecture: fail here, not in a child
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    return ClusterSpec(
        model_path=path,
        num_prefill=getattr(args, "prefill", 1),
        num_decode=getattr(args, "decode", 1),
        colocated=colocated,
        host=args.host,
        port=args.port,
        dtype=_dtype(args.dtype, args.device, report=True),
        device=args.device,
        page_size=args.page_size,
        kv_cache_mb=args.kv_cache_mb,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        threads_per_worker=args.threads_per_worker,
        cpu_affinity=affinity,
        transfer_timeout_s=args.transfer_timeout,
        kv_transfer=args.kv_transfer,
        jump_forward=not args.disable_jump_forward,
        overlap_grammar_mask=not args.disable_mask_overlap,
        log_level=args.log_level,
        disable_radix_cache=args.disable_radix_cache,
        cuda_graph=not args.disable_cuda_graph,
        routing=args.routing,
        api_key=args.api_key,
        curve_keys=args.curve_keys,
        max_body_bytes=args.max_body_bytes,
        max_inflight_per_worker=args.max_inflight_per_worker,
        dead_after_s=args.dead_after,
    )


def _run_on_ray(args: argparse.Namespace) -> None:
    from pathlib import Path

    from splitserve.ray_launch import RayClusterSpec, launch_on_ray, wait_healthy

    if not args.config:
        sys.exit("error: --ray needs --config cluster.yaml")
    try:
        import ray
    except ImportError:
        sys.exit("error: --ray needs Ray: pip install 'ray>=2.9'")
    spec = RayClusterSpec.from_yaml(Path(args.config).read_text())
    url, handles = launch_on_ray(args.ray, spec, args.api_key, args.log_level)
    wait_healthy(url, spec.prefill.count + spec.decode.count, api_key=args.api_key)
    print(f"splitserve ready on Ray: {url}/v1  (Ctrl-C to stop)", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        print("stopping...", flush=True)
        ray.get([h.stop.remote() for h in reversed(handles)])


def _run_cluster(args: argparse.Namespace, colocated: bool) -> None:
    if getattr(args, "ray", None):
        return _run_on_ray(args)
    from splitserve.launcher import Cluster, ClusterError

    cluster = Cluster(_cluster_spec(args, colocated))
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        kind = "colocated worker" if colocated else f"{args.prefill} prefill + {args.decode} decode"
        print(f"splitserve ready ({kind}): {cluster.spec.url}/v1  (Ctrl-C to stop)", flush=True)
        while not stop["now"]:
            cluster.supervise()  # a worker that dies is restarted; the router takes it back
            time.sleep(0.5)
    except ClusterError as exc:
        sys.exit(f"error: {exc}")
    finally:
        print("stopping...", flush=True)
        cluster.stop()


def _pin_from_env() -> None:
    """Pin this process to ``$SPLITSERVE_CPU_AFFINITY`` (set by the launcher per worker), before
    torch starts its thread pool, so every thread inherits it."""
    from splitserve.launcher import AFFINITY_ENV

    cpus = os.environ.get(AFFINITY_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])

def _die_with_parent() -> None:
    """Children of a launcher exit when it dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``);
    without this a killed launcher would leave workers holding ports and memory."""
    if os.environ.get("SPLITSERVE_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(1)

def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _pin_from_env()
    logging.basicConfig(level=args.log_level.upper())
    if args.command in ("worker", "api-server"):
        _die_with_parent()
    if args.command == "launch":
        _run_cluster(args, colocated=False)
    elif args.command == "serve":
        _run_cluster(args, colocated=True)
    elif args.command == "demo":
        from splitserve.demo import run_demo

        run_demo(_cluster_spec(args, colocated=False))
    elif args.command == "worker":
        from splitserve.ipc import free_tcp_addr
        from splitserve.worker_main import run_worker

        if not args.router and not args.server_addr:
            sys.exit("error: worker needs --router URL (to join) or --server-addr")
        addr = args.addr or (f"tcp://{args.host}:{args.port}" if args.port
                             else free_tcp_addr(args.host))
        run_worker(
            WorkerArgs(
                role=args.role, addr=addr, server_addr=args.server_addr or "",
                worker_id=args.worker_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}",
                model_path=_model_path(args.model),
                dtype=_dtype(args.dtype, args.device), device=args.device,
                page_size=args.page_size, kv_cache_mb=args.kv_cache_mb,
                max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                transfer_timeout_s=args.transfer_timeout, num_threads=args.threads,
                kv_transfer=args.kv_transfer,
                router_url=args.router, api_key=args.api_key, curve_keys=args.curve_keys,
                jump_forward=not args.disable_jump_forward,
                overlap_grammar_mask=not args.disable_mask_overlap,
                disable_radix_cache=args.disable_radix_cache,
                cuda_graph=not args.disable_cuda_graph,
            ),
            args.log_level,
        )
    elif args.command == "keygen":
        from splitserve.security import CurveKeys

        CurveKeys.generate().save(args.path)
        print(f"wrote {args.path} (mode 0600); pass --curve-keys {args.path} to every process")
    elif args.command == "api-server":
        from splitserve.ipc import free_tcp_addr
        from splitserve.server.main import run_api_server

        inbox_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        run_api_server(
            args.model, args.host, args.port, args.inbox or free_tcp_addr(inbox_host),
            args.prefill_addr, args.decode_addr, args.colocated_addr, args.log_level,
            routing=args.routing,
            api_key=args.api_key, max_body_bytes=args.max_body_bytes,
            dead_after_s=args.dead_after, max_inflight_per_worker=args.max_inflight_per_worker,
            curve_keys=args.curve_keys,
        )
