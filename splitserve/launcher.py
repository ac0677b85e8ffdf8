"""Start a cluster on this machine: the API server and its workers as separate processes.

``splitserve launch`` (disaggregated) and ``splitserve serve`` (colocated) use :class:`Cluster`;
so do the end-to-end tests. Children run in their own process sessions, so Ctrl-C reaches only
the launcher, which then stops them in order (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Self

from splitserve.ipc import free_tcp_addr

logger = logging.getLogger(__name__)
AFFINITY_ENV = "SPLITSERVE_CPU_AFFINITY"  # "0,1": CPUs the process pins itself to at start-up


@dataclass(slots=True)
class ClusterSpec:
    """What to start. Units: pages of ``page_size`` tokens, MiB, seconds."""

    model_path: str
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_mb: int = 512
    max_batch_tokens: int = 2048
    max_running: int = 64
    threads_per_worker: int = 0  # 0: split the machine's cores (or a worker's pinned CPUs)
    # Pin processes to CPUs: role, worker id or "api-server" -> CPU ids, e.g.
    # {"prefill": [0], "decode": [1]}; see parse_cpu_affinity for the string form.
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)
    transfer_timeout_s: float = 30.0
    kv_transfer: str = "zmq"  # kv_transfer.registry.KV_TRANSFER_BACKENDS
    jump_forward: bool = True  # grammar-forced tokens appended without sampling
    overlap_grammar_mask: bool = True  # grammar masks filled on a thread during the forward pass
    log_level: str = "warning"
    disable_radix_cache: bool = False
    # "cpu" | "cuda" for every worker; $SPLITSERVE_DEVICE as the CLI's --device default does.
    device: str = field(default_factory=lambda: os.environ.get("SPLITSERVE_DEVICE", "cpu"))
    cuda_graph: bool = True  # decode steps replayed as CUDA graphs (CUDA workers only)
    routing: str = "cache_aware"  # prefill worker choice: "cache_aware" | "round_robin"
    api_key: str | None = None  # passed to children in the environment, not on the command line
    curve_keys: str | None = None  # CURVE key file: encrypted, authenticated worker links
    max_body_bytes: int = 4 * 2**20
    max_inflight_per_worker: int = 256
    dead_after_s: float = 5.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def parse_cpu_affinity(text: str | list[str]) -> dict[str, list[int]]:
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


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or exited early."""


class Cluster:
    """A running cluster. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}

    def _roles(self) -> list[str]:
        s = self.spec
        return ["colocated"] if s.colocated else ["prefill"] * s.num_prefill + ["decode"] * s.num_decode

    def _cpus(self, name: str) -> list[int] | None:
        """The CPUs process ``name`` (``prefill-0``, ``api-server``) is pinned to, if any."""
        aff = self.spec.cpu_affinity
        return aff.get(name) or aff.get(name.rsplit("-", 1)[0] if name != "api-server" else name)

    def _spawn(self, name: str, args: list[str], threads: int) -> None:
        env = dict(os.environ, SPLITSERVE_DIE_WITH_PARENT="1", **self.spec.extra_env)
        if threads > 0:
            env["OMP_NUM_THREADS"] = str(threads)
        if self.spec.api_key:
            env["SPLITSERVE_API_KEY"] = self.spec.api_key
        if self.spec.curve_keys:
            args = [*args, "--curve-keys", self.spec.curve_keys]
        cmd = [sys.executable, "-m", "splitserve", *args, "--log-level", self.spec.log_level]
        cpus = self._cpus(name)
        if cpus:  # applied by the child's cli.main before it starts any thread
            env[AFFINITY_ENV] = ",".join(map(str, cpus))
        self.commands[name] = (cmd, env)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.procs.append((name, proc))

    def proc(self, name: str) -> subprocess.Popen:
        """The process called ``name`` (``prefill-0``, ``decode-1``, ``api-server``...)."""
        return next(p for n, p in self.procs if n == name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault-injection tests); :meth:`restart` brings it back."""
        proc = self.proc(name)
        proc.kill()
        proc.wait()

    def restart(self, name: str) -> None:
        """Start the process ``name`` again with its original command (same address)."""
        cmd, env = self.commands[name]
        new = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.procs = [(n, new if n == name else p) for n, p in self.procs]

    def start(self, timeout_s: float = 180.0) -> Cluster:
        """Spawn every process and wait until ``/health`` answers 200.

        Raises:
            ClusterError: a process exited, or the cluster was not healthy within ``timeout_s``.
        """
        s = self.spec
        roles = self._roles()
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // len(roles))
        server_inbox = free_tcp_addr()
        addrs: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        self.addrs, self.server_inbox = addrs, server_inbox
        for role in roles:
            i = len(addrs[role])  # prefill-0, prefill-1, decode-0, ...
            addr = free_tcp_addr()
            addrs[role].append(addr)
            cpus = self._cpus(f"{role}-{i}")
            n = s.threads_per_worker or (len(cpus) if cpus else threads)
            cache_flag = ["--disable-radix-cache"] if s.disable_radix_cache else []
            self._spawn(f"{role}-{i}", [
                "worker", "--role", role, "--worker-id", f"{role}-{i}", "--addr", addr,
                "--server-addr", server_inbox, "--model", s.model_path, "--dtype", s.dtype,
                "--page-size", str(s.page_size), "--kv-cache-mb", str(s.kv_cache_mb),
                "--max-batch-tokens", str(s.max_batch_tokens), "--max-running", str(s.max_running),
                "--transfer-timeout", str(s.transfer_timeout_s), "--threads", str(n),
                "--kv-transfer", s.kv_transfer, "--device", s.device,
                *([] if s.jump_forward else ["--disable-jump-forward"]),
                *([] if s.overlap_grammar_mask else ["--disable-mask-overlap"]),
                *cache_flag,
                *([] if s.cuda_graph else ["--disable-cuda-graph"]),
            ], n)
        server_args = ["api-server", "--model", s.model_path, "--host", s.host, "--port",
                       str(s.port), "--inbox", server_inbox, "--routing", s.routing, "--max-body-bytes",
                       str(s.max_body_bytes), "--max-inflight-per-worker",
                       str(s.max_inflight_per_worker), "--dead-after", str(s.dead_after_s)]
        for role, role_addrs in addrs.items():
            for addr in role_addrs:
                server_args += [f"--{role}-addr", addr]
        self._spawn("api-server", server_args, 1)
        self._wait_healthy(timeout_s)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.spec.url + "/health", timeout=2) as r:  # open path
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ClusterError(f"cluster not healthy within {timeout_s:g} s")

    def check_alive(self) -> None:
        """Raises ClusterError (after stopping the rest) if any process has exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                self.stop()
                raise ClusterError(f"{name} exited with code {proc.returncode}")

    def supervise(self, max_restarts: int = 5) -> list[str]:
        """Restart workers that exited (the router fails or re-runs their requests meanwhile and
        takes them back once ready). Returns the names restarted.

        Raises:
            ClusterError: the API server exited, or a worker died more than ``max_restarts`` times.
        """
        restarted = []
        for name, proc in list(self.procs):
            if proc.poll() is None:
                continue
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if name == "api-server" or self.restarts[name] > max_restarts:
                self.stop()
                raise ClusterError(f"{name} exited with code {proc.returncode}")
            logger.warning("%s exited with code %s; restarting", name, proc.returncode)
            self.restart(name)
            restarted.append(name)
        return restarted

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL those still alive after ``grace_s``.

        The API server goes first: stopped after its workers, it would report each of them as
        lost (an error log per worker on every ordinary shutdown)."""
        deadline = time.monotonic() + grace_s
        api = [p for name, p in self.procs if name == "api-server"]
        workers = [p for name, p in self.procs if name != "api-server"]
        for group in (api, workers):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # Shared-memory KV segments of children that could not clean up (killed).
        from splitserve.kv_transfer.shm_backend import sweep_stale_segments

        sweep_stale_segments({proc.pid for _, proc in self.procs})
        self.procs.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
