"""``splitserve`` command line: launch | serve | demo | worker | api-server | keygen | top.

Every flag sets one field of the typed config (``splitserve.config``); defaults live there. The
launcher hands each child its whole config as ``--config-json``, so a worker started by
``launch`` and one started by hand with the same flags run the same configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from splitserve.config import ServeConfig, WorkerConfig, env
from splitserve.config.flags import (
    CLUSTER_FLAGS,
    DISAGGREGATED_FLAGS,
    ENGINE_FLAGS,
    LOG_FLAGS,
    SECURITY_FLAGS,
    SERVER_FLAGS,
    TRACING_FLAGS,
    UI_FLAGS,
    Flag,
    add_flags,
    apply_flags,
)
from splitserve.config.registry import WORKER_ROLE
from splitserve.config.schema import EngineConfig, from_json

if TYPE_CHECKING:
    from splitserve.engine.model.config import ModelConfig

CLUSTER_COMMAND_FLAGS = (*ENGINE_FLAGS, *LOG_FLAGS, *SECURITY_FLAGS, *SERVER_FLAGS, *UI_FLAGS,
                         *TRACING_FLAGS, *CLUSTER_FLAGS)
WORKER_FLAGS = (*ENGINE_FLAGS, *LOG_FLAGS, *SECURITY_FLAGS, *TRACING_FLAGS)
API_SERVER_FLAGS = (ENGINE_FLAGS[0], *LOG_FLAGS, *SECURITY_FLAGS, *SERVER_FLAGS, *UI_FLAGS,
                    *TRACING_FLAGS)


def _config_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-json", default=None, metavar="JSON",
                   help="the whole config as JSON (what launch passes its children); flags given "
                        "as well override its fields")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="disaggregated cluster: API server + prefill + decode workers")
    add_flags(p, (*CLUSTER_COMMAND_FLAGS, *DISAGGREGATED_FLAGS))
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="launch on this Ray cluster (needs --config; pip install ray)")
    p.add_argument("--config", default=None, help="cluster spec YAML (see splitserve.launch.ray)")

    p = sub.add_parser("serve", help="one colocated worker (prefill and decode in one process)")
    add_flags(p, CLUSTER_COMMAND_FLAGS)

    p = sub.add_parser("demo", help="launch the default cluster, send real requests, stop")
    add_flags(p, CLUSTER_COMMAND_FLAGS)

    p = sub.add_parser("worker", help="one worker: joins --router, or is started by launch/serve")
    add_flags(p, WORKER_FLAGS, WorkerConfig(role="decode", worker_id="", addr=""))
    _config_json_flag(p)
    p.add_argument("--role", choices=WORKER_ROLE.names, default=None, help="required unless "
                   "--config-json gives it")
    p.add_argument("--worker-id", default=None, help="default: ROLE-HOSTNAME-PID")
    p.add_argument("--router", action="append", default=None, metavar="URL",
                   help="join the router at http://HOST:PORT; repeat to serve several routers "
                   "(API servers behind one load balancer) from one worker")
    p.add_argument("--host", default="127.0.0.1", help="address of this worker's inbox")
    p.add_argument("--port", type=int, default=0, help="port of this worker's inbox (0: any)")
    p.add_argument("--addr", default=None, help="this worker's inbox (overrides --host/--port)")
    p.add_argument("--server-addr", default=None, help="the API server's inbox (without --router)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (0: torch's default)")

    p = sub.add_parser("top", help="the live cluster view in the terminal (GET /cluster)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the API server")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.add_argument("--api-key", default=None, help="default: $SPLITSERVE_API_KEY")

    p = sub.add_parser("keygen", help="write a CURVE key file for --curve-keys")
    p.add_argument("path")

    p = sub.add_parser("api-server", help="the HTTP API process (started by launch/serve)")
    add_flags(p, API_SERVER_FLAGS)
    _config_json_flag(p)
    p.add_argument("--inbox", default=None,
                   help="ZeroMQ inbox workers reply to (default: a free port on --host)")
    for role in WORKER_ROLE.names:
        p.add_argument(f"--{role}-addr", action="append", default=[])
    return parser


def _resolve_engine(config: ServeConfig | WorkerConfig, report: bool = False) -> None:
    """Fill what the engine needs resolved once, where the command starts, so that every worker
    agrees: the model folder (the default model when none is given) and ``dtype auto``. Exits
    with a clear message on an unusable model or device."""
    from splitserve.default_model import resolve_model_path
    from splitserve.engine.kernels.cpu.features import resolve_dtype
    from splitserve.engine.model.config import ModelConfig

    e = config.engine
    try:
        e.model = str(resolve_model_path(e.model or None))
        model_config = ModelConfig.from_dir(e.model)  # unsupported: fail here, not in a child
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    if e.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit(
                f"error: --device cuda, but torch {torch.__version__} sees no CUDA GPU "
                "(a CPU build of torch, or no driver): use --device cpu"
            )
    build = None
    if e.device == "cpu" and e.cpu_kernels and (report or e.dtype == "auto"):
        from splitserve.engine.kernels.cpu.build import cpu_kernel_build

        # Built here once, before the workers start (they load the cached library): a
        # failure is printed where the command was typed, not only in a worker's log; and
        # on an AVX2 CPU, dtype auto depends on it.
        build = cpu_kernel_build()
    e.dtype, why = resolve_dtype(e.dtype, e.device, build is not None and build.kernels is not None)
    if report:
        print(f"splitserve: dtype {e.dtype} ({why})", file=sys.stderr, flush=True)
    kernels_built = True
    if report and build is not None:
        kernels_built = build.kernels is not None
        print(f"splitserve: {build.describe()}", file=sys.stderr, flush=True)
    if report and e.quantization != "none":
        from splitserve.engine.kernels.cpu.features import cpu_flags

        vnni = "avx512_vnni" in cpu_flags() and e.device == "cpu" and e.dtype == "bfloat16"
        vnni = vnni and kernels_built
        how = ("AVX512-VNNI C products for decode steps" if vnni else
               f"no {e.quantization} kernel here (needs CPU bfloat16 with avx512_vnni and the "
               "C kernels built): the de-quantized weights serve, no faster than unquantized")
        if e.device.startswith("cuda"):
            how = ("Triton weight-only kernels on CUDA, only the quantized weights on the "
                   "device; not yet timed on a GPU")
        if e.quantization == "int4" and vnni:
            from splitserve.engine.model.quant_int4 import torch_int4_available

            how += (" (ours, or torch's int4 kernel where the kernel plan times it faster)"
                    if torch_int4_available() else " (torch has no CPU int4 kernel to time)")
        print(f"splitserve: quantization {e.quantization} ({how})", file=sys.stderr, flush=True)
    if report and e.kv_cache_dtype != "auto":
        print(f"splitserve: {kv_cache_report(model_config, e)}", file=sys.stderr, flush=True)


def kv_cache_report(model_config: ModelConfig, e: EngineConfig) -> str:
    """One line on an 8-bit KV cache: bytes per token against the model dtype's, and which
    paths serve it (on CPU bfloat16 the C kernels quantize and de-quantize pages themselves)."""
    full = model_config.kv_layout(e.page_size, e.dtype).bytes_per_token
    ours = model_config.kv_layout(e.page_size, e.dtype, e.kv_cache_dtype).bytes_per_token
    return (
        f"KV cache {e.kv_cache_dtype}: {ours:.0f} bytes per token vs {full:.0f} in {e.dtype} "
        f"({full / ours:.2f}x the tokens in --kv-cache-mb {e.kv_cache_mb}); on CPU bfloat16 "
        "the C KV append and fused C decode layers quantize new K/V into the pages, the C "
        "extend attention de-quantizes pages as it reads them, and decode rows read the "
        "decode KV cache's de-quantized copy (C decode attention); on CUDA the Triton "
        "attention kernels de-quantize pages as they read them, elsewhere torch ops do"
    )


def serve_config(args: argparse.Namespace, colocated: bool) -> ServeConfig:
    """The cluster's config from the command line (flags over the defaults), resolved."""
    config = ServeConfig()
    flags = (*CLUSTER_COMMAND_FLAGS, *DISAGGREGATED_FLAGS)
    apply_flags(args, config, flags)
    config.cluster.colocated = colocated
    _resolve_engine(config, report=True)
    try:
        config.check()
        _check_key_file(config)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    return config


def _check_key_file(config: ServeConfig) -> None:
    """Read ``--api-key-file`` now, so a bad one is an error here, not a child's traceback.

    Raises:
        ValueError: missing, unreadable or empty file, or a key listed twice.
    """
    from splitserve.server.tenancy import KeyRing

    KeyRing.from_config(config.security.api_key, config.security.api_key_file)


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    from splitserve.ipc.sockets import free_tcp_addr

    if args.config_json:
        config = from_json(args.config_json, WorkerConfig)
    else:
        if not args.role:
            sys.exit("error: worker needs --role (or --config-json)")
        config = WorkerConfig(role=args.role, worker_id="", addr="")
    apply_flags(args, config, WORKER_FLAGS)
    identity: tuple[tuple[str, object], ...] = (
        ("role", args.role), ("worker_id", args.worker_id), ("router_urls", args.router),
        ("server_addr", args.server_addr), ("num_threads", args.threads),
    )
    for field, value in identity:
        if value is not None:
            setattr(config, field, value)
    if args.addr or not config.addr:
        config.addr = args.addr or (
            f"tcp://{args.host}:{args.port}" if args.port else free_tcp_addr(args.host)
        )
    if not config.worker_id:
        config.worker_id = f"{config.role}-{socket.gethostname()}-{os.getpid()}"
    if not config.router_urls and not config.server_addr:
        sys.exit("error: worker needs --router URL (to join) or --server-addr")
    _resolve_engine(config)
    try:
        config.check()
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    return config


def _run_on_ray(args: argparse.Namespace) -> None:
    from pathlib import Path

    from splitserve.launch.ray import RayClusterSpec, launch_on_ray, wait_healthy
    from splitserve.launch.ray_placement import RayPlacementError

    if not args.config:
        sys.exit("error: --ray needs --config cluster.yaml")
    try:
        import ray
    except ImportError:
        sys.exit("error: --ray needs Ray: pip install 'ray>=2.9'")
    config = ServeConfig()
    apply_flags(args, config, (*LOG_FLAGS, *SECURITY_FLAGS))
    try:
        spec = RayClusterSpec.from_yaml(Path(args.config).read_text())
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    try:
        _check_key_file(config)
        url, handles = launch_on_ray(args.ray, spec, config.security, config.log_level)
    except (ConnectionError, ValueError, RayPlacementError) as exc:
        sys.exit(f"error: {exc}")
    try:
        wait_healthy(url, spec.prefill.count + spec.decode.count,
                     api_key=config.security.api_key)
    except TimeoutError as exc:
        ray.get([h.stop.remote() for h in reversed(handles)])
        sys.exit(f"error: {exc}")
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
    from splitserve.launch.local import Cluster, ClusterError

    config = serve_config(args, colocated)
    cluster = Cluster(config)
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        c = config.cluster
        kind = "colocated worker" if colocated else f"{c.num_prefill} prefill + {c.num_decode} decode"
        print(f"splitserve ready ({kind}): {config.url}/v1  (Ctrl-C to stop)", flush=True)
        while not stop["now"]:
            cluster.supervise()  # a worker that dies is restarted; the router takes it back
            time.sleep(0.5)
    except ClusterError as exc:
        sys.exit(f"error: {exc}")
    finally:
        print("stopping...", flush=True)
        cluster.stop()


def _run_api_server(args: argparse.Namespace) -> None:
    from splitserve.ipc.sockets import free_tcp_addr
    from splitserve.server.main import run_api_server

    config = from_json(args.config_json, ServeConfig) if args.config_json else ServeConfig()
    apply_flags(args, config, API_SERVER_FLAGS)
    if not config.engine.model:
        sys.exit("error: api-server needs --model (or --config-json)")
    host = config.server.host
    inbox_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    config.server.inbox = args.inbox or config.server.inbox or free_tcp_addr(inbox_host)
    try:
        _check_key_file(config)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    run_api_server(config, args.prefill_addr, args.decode_addr, args.colocated_addr)


def _pin_from_env() -> None:
    """Pin this process to ``$SPLITSERVE_CPU_AFFINITY`` (set by the launcher per worker), before
    torch starts its thread pool, so every thread inherits it."""
    cpus = env.cpu_affinity()
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def _die_with_parent() -> None:
    """Children of a launcher exit when it dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``);
    without this a killed launcher would leave workers holding ports and memory."""
    if not env.die_with_parent() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(1)


def _log_level(args: argparse.Namespace) -> str:
    given = getattr(args, "log_level", None)
    if given:
        return given
    text = getattr(args, "config_json", None)
    return from_json(text, WorkerConfig if args.command == "worker" else ServeConfig).log_level \
        if text else ServeConfig().log_level


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _pin_from_env()
    if args.command not in ("keygen", "top"):
        logging.basicConfig(level=_log_level(args).upper())
    if args.command in ("worker", "api-server"):
        _die_with_parent()
    if args.command == "launch":
        _run_cluster(args, colocated=False)
    elif args.command == "serve":
        _run_cluster(args, colocated=True)
    elif args.command == "demo":
        from splitserve.demo import run_demo

        run_demo(serve_config(args, colocated=False))
    elif args.command == "worker":
        from splitserve.worker.main import run_worker

        run_worker(_worker_config(args))
    elif args.command == "keygen":
        from splitserve.ipc.security import CurveKeys

        CurveKeys.generate().save(args.path)
        print(f"wrote {args.path} (mode 0600); pass --curve-keys {args.path} to every process")
    elif args.command == "api-server":
        _run_api_server(args)
    elif args.command == "top":
        from splitserve.top import run_top

        try:
            run_top(args.url, args.api_key or env.optional_text(env.API_KEY), args.interval,
                    args.once)
        except KeyboardInterrupt:
            pass


__all__ = ["Flag", "build_parser", "main", "serve_config"]
