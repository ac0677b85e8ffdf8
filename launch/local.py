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
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

import msgspec

from splitserve.config import ServeConfig, WorkerConfig, env
from splitserve.config.schema import to_json
from splitserve.ipc.sockets import free_tcp_addr
from splitserve.worker.core_share import clear_core_share_slot, create_core_share

logger = logging.getLogger(__name__)


def _shm_dir() -> str | None:
    """``/dev/shm`` where it exists (the core-share file then never touches a disk), else the
    default temporary folder (None)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or exited early."""


class Cluster:
    """A running cluster. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(self, config: ServeConfig) -> None:
        config.check()
        self.config = config
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}
        self.store: subprocess.Popen | None = None  # --kv-store local: its mooncake_master
        # Every child is started from this one thread, which lives until stop(): a child's
        # PR_SET_PDEATHSIG (SPLITSERVE_DIE_WITH_PARENT) fires when the *thread* that forked it
        # exits, so a restart from a short-lived thread (a supervisor, a test's fault schedule)
        # would be SIGTERMed as soon as that thread ended.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="cluster-spawner")
        self.core_share: Path | None = None  # the workers' core-share file (worker.core_share)
        self.core_slots: dict[str, int] = {}  # worker name -> its byte in that file

    def _popen(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        return self._spawner.submit(subprocess.Popen, cmd, env=env,
                                    start_new_session=True).result()

    def _cpus(self, name: str) -> list[int] | None:
        """The CPUs process ``name`` (``prefill-0``, ``api-server``) is pinned to, if any."""
        aff = self.config.cluster.cpu_affinity
        return aff.get(name) or aff.get(name.rsplit("-", 1)[0] if name != "api-server" else name)

    def _spawn(self, name: str, args: list[str], threads: int) -> None:
        c = self.config
        child_env = env.child_environ({env.DIE_WITH_PARENT: "1", **c.cluster.extra_env})
        if threads > 0:
            child_env["OMP_NUM_THREADS"] = str(threads)
        # The key goes in the environment, never on a command line (children's --config-json
        # leaves it out); a config without one must not pass on a key the launcher inherited.
        child_env.pop(env.API_KEY, None)
        if c.security.api_key:
            child_env[env.API_KEY] = c.security.api_key
        cmd = [sys.executable, "-m", "splitserve", *args]
        cpus = self._cpus(name)
        if cpus:  # applied by the child's cli.main before it starts any thread
            child_env[env.CPU_AFFINITY] = ",".join(map(str, cpus))
        self.commands[name] = (cmd, child_env)
        self.procs.append((name, self._popen(cmd, child_env)))

    def proc(self, name: str) -> subprocess.Popen:
        """The process called ``name`` (``prefill-0``, ``decode-1``, ``api-server``...)."""
        return next(p for n, p in self.procs if n == name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault-injection tests); :meth:`restart` brings it back."""
        proc = self.proc(name)
        proc.kill()
        proc.wait()

    def restart(self, name: str) -> None:
        """Start the process ``name`` again with its original command (same address). A worker
        killed inside a step left its core-share byte marked busy: it is cleared first, so the
        others do not keep running on fewer cores."""
        cmd, env = self.commands[name]
        slot = self.core_slots.get(name)
        if self.core_share is not None and slot is not None:
            clear_core_share_slot(self.core_share, slot)
        new = self._popen(cmd, env)
        self.procs = [(n, new if n == name else p) for n, p in self.procs]

    def start(self, timeout_s: float = 180.0) -> Cluster:
        """Spawn every process and wait until ``/health`` answers 200.

        Raises:
            ClusterError: a process exited, or the cluster was not healthy within ``timeout_s``.
        """
        c = self.config
        if c.engine.kv_store == "local":
            # The workers' shared KV tier: a master on loopback, named to every worker.
            from splitserve.launch.kv_store import start_local_store

            self.store, url = start_local_store()
            c = self.config = msgspec.structs.replace(
                c, engine=msgspec.structs.replace(c.engine, kv_store=url))
        roles = c.cluster.roles
        per_worker = c.cluster.threads_per_worker
        host_threads = os.cpu_count() or 1
        threads = per_worker or max(1, host_threads // len(roles))
        # Several workers splitting the cores between them: each step takes what the idle
        # ones leave (worker.core_share). Not with fixed thread counts or pinned CPUs.
        if (c.cluster.share_cores and not per_worker and not c.cluster.cpu_affinity
                and len(roles) > 1 and host_threads > threads):
            fd, name = tempfile.mkstemp(prefix="splitserve-cores-", dir=_shm_dir())
            os.close(fd)
            self.core_share = Path(name)
            create_core_share(self.core_share, len(roles))
        server_inbox = free_tcp_addr()
        addrs: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        self.addrs, self.server_inbox = addrs, server_inbox
        for role in roles:
            i = len(addrs[role])  # prefill-0, prefill-1, decode-0, ...
            addr = free_tcp_addr()
            addrs[role].append(addr)
            cpus = self._cpus(f"{role}-{i}")
            n = per_worker or (len(cpus) if cpus else threads)
            worker = WorkerConfig(
                role=role, worker_id=f"{role}-{i}", addr=addr, server_addr=server_inbox,
                num_threads=n, engine=c.engine, security=c.security, tracing=c.tracing,
                log_level=c.log_level,
            )
            if self.core_share is not None:
                self.core_slots[f"{role}-{i}"] = len(self.core_slots)
                worker = msgspec.structs.replace(
                    worker, core_share=str(self.core_share),
                    core_share_slot=self.core_slots[f"{role}-{i}"], host_threads=host_threads)
            self._spawn(f"{role}-{i}", ["worker", "--config-json", to_json(worker)], n)
        server = msgspec.structs.replace(c, server=msgspec.structs.replace(
            c.server, inbox=server_inbox))
        server_args = ["api-server", "--config-json", to_json(server)]
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
                with urllib.request.urlopen(self.config.url + "/health", timeout=2) as r:  # open path
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        seen = self._workers_seen()
        self.stop()
        raise ClusterError(f"cluster not healthy within {timeout_s:g} s; {seen}")

    def _workers_seen(self) -> str:
        """What the API server knows of its workers (``GET /workers``), for the error of a
        cluster that did not become healthy: which one never said it was ready."""
        try:
            with urllib.request.urlopen(self.config.url + "/workers", timeout=5) as r:  # open path
                return f"workers: {r.read().decode(errors='replace')[:2000]}"
        except OSError as exc:
            return f"GET /workers failed: {exc}"

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
        if self.core_share is not None:
            self.core_share.unlink(missing_ok=True)
            self.core_share = None
        if self.store is not None:  # after the workers, whose store clients leave it first
            self.store.terminate()
            try:
                self.store.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.store.kill()
                self.store.wait()
            self.store = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
