"""``splitserve`` command line: launch | serve | worker | api-server | demo."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from splitserve.config import DTYPES, KV_TRANSFER_BACKENDS, ROLES, WorkerArgs


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
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
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix reuse on prefill/colocated workers (the cache-off baseline)")
    p.add_argument("--log-level", default="warning")


def _add_routing_flag(p: argparse.ArgumentParser) -> None:
    from splitserve.server.routing import ROUTING_POLICIES

    p.add_argument("--routing", choices=sorted(ROUTING_POLICIES), default="cache_aware",
                   help="how the API server picks a prefill (or colocated) worker")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    _add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads-per-worker", type=int, default=0, help="0: split the cores")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds")
    _add_routing_flag(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="disaggregated cluster: API server + prefill + decode workers")
    _add_cluster_flags(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")

    p = sub.add_parser("serve", help="one colocated worker (prefill and decode in one process)")
    _add_cluster_flags(p)

    p = sub.add_parser("demo", help="launch the default cluster, send real requests, stop")
    _add_cluster_flags(p)

    p = sub.add_parser("worker", help="one worker process (started by launch/serve)")
    _add_engine_flags(p)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--addr", required=True, help="this worker's inbox, e.g. tcp://127.0.0.1:5601")
    p.add_argument("--server-addr", required=True, help="the API server's inbox")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0)

    p = sub.add_parser("api-server", help="the HTTP API process (started by launch/serve)")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--inbox", required=True)
    for role in ROLES:
        p.add_argument(f"--{role}-addr", action="append", default=[])
    _add_routing_flag(p)
    p.add_argument("--log-level", default="warning")
    return parser


def _model_path(model: str | None) -> str:
    from splitserve.default_model import resolve_model_path

    try:
        return str(resolve_model_path(model))
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")


def _cluster_spec(args: argparse.Namespace, colocated: bool):
    from splitserve.engine.model_config import ModelConfig
    from splitserve.launcher import ClusterSpec

    path = _model_path(args.model)
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
        dtype=args.dtype,
        page_size=args.page_size,
        kv_cache_mb=args.kv_cache_mb,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        threads_per_worker=args.threads_per_worker,
        transfer_timeout_s=args.transfer_timeout,
        kv_transfer=args.kv_transfer,
        jump_forward=not args.disable_jump_forward,
        log_level=args.log_level,
        disable_radix_cache=args.disable_radix_cache,
        routing=args.routing,
    )


def _run_cluster(args: argparse.Namespace, colocated: bool) -> None:
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
            cluster.check_alive()
            time.sleep(0.5)
    except ClusterError as exc:
        sys.exit(f"error: {exc}")
    finally:
        print("stopping...", flush=True)
        cluster.stop()


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
        from splitserve.worker_main import run_worker

        run_worker(
            WorkerArgs(
                role=args.role, worker_id=args.worker_id, addr=args.addr,
                server_addr=args.server_addr, model_path=_model_path(args.model),
                dtype=args.dtype, page_size=args.page_size, kv_cache_mb=args.kv_cache_mb,
                max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                transfer_timeout_s=args.transfer_timeout, num_threads=args.threads,
                kv_transfer=args.kv_transfer,
                jump_forward=not args.disable_jump_forward,
                disable_radix_cache=args.disable_radix_cache,
            ),
            args.log_level,
        )
    elif args.command == "api-server":
        from splitserve.server.main import run_api_server

        run_api_server(
            args.model, args.host, args.port, args.inbox,
            args.prefill_addr, args.decode_addr, args.colocated_addr, args.log_level,
            routing=args.routing,
        )
