"""What the Ray launcher (``launch.ray``) runs on each node: :class:`ProcessHost`, an actor that
owns one ``python -m splitserve ...`` process, and :func:`check_ray_address`, which turns Ray's
silent retries at a wrong address into an error.

The actor's life is its process's: when the process exits, the actor exits too, so Ray's actor
restart (``max_restarts``) starts it again, on a surviving node with the role's resources if
its node died. A restarted worker joins the router again by itself (``--router``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from splitserve.config import env


class ProcessHost:
    """One splitserve process on this actor's node (a plain class; ``launch.ray`` wraps it with
    ``ray.remote``).

    Args:
        command: ``"api-server"`` or ``"worker"``.
        config: the process's config as JSON data (a ``ServeConfig`` or a ``WorkerConfig``);
            the host is filled in here, on the node: ``host``, or the node's IP. A worker's
            ``node`` is set to the Ray node id (``GET /workers`` shows it).
        child_env: added to the process's environment.
        host: what the process binds and advertises (None: the node's IP).
        port: a worker's port, or the router's ZeroMQ inbox port (0: any free one).
    """

    def __init__(self, command: str, config: dict[str, Any], child_env: dict[str, str],
                 host: str | None = None, port: int = 0) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = host or ray.util.get_node_ip_address()
        if command == "api-server":
            config["server"]["host"] = self.ip
            if port:  # workers connect to it: a firewall needs it fixed
                config["server"]["inbox"] = f"tcp://{self.ip}:{port}"
            argv = ["api-server", "--config-json", json.dumps(config)]
        else:
            config["node"] = self.node_id
            argv = ["worker", "--config-json", json.dumps(config), "--host", self.ip,
                    "--port", str(port)]
        self.stopping = False
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve", *argv],
                                     env=env.child_environ(child_env), start_new_session=True)
        threading.Thread(target=self._exit_with_child, daemon=True).start()

    def _exit_with_child(self) -> None:
        self.proc.wait()
        if not self.stopping:
            os._exit(1)  # Ray sees the actor die and restarts it, and with it the process

    def pid(self) -> int:
        return self.proc.pid

    def node_ip(self) -> str:
        return self.ip

    def node(self) -> str:
        """The Ray node id this process runs on."""
        return self.node_id

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM the process (SIGKILL after 10 s); the actor stays, and is not restarted."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def keep_ray_on_loopback() -> None:
    """Make this process (and the Ray processes it starts) keep 127.0.0.1 as the node address.

    Ray replaces a loopback address with the machine's outward one when it connects; a cluster
    whose every node was started with ``--node-ip-address 127.0.0.1`` listens on loopback only.
    """
    env.set_value(env.RAY_CLUSTER, "0")
    if "ray" in sys.modules:  # read at import: set the imported value too
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Before ``ray.init(address)``: a ``HOST:PORT`` on loopback keeps Ray on loopback
    (:func:`keep_ray_on_loopback`), and nothing listening at ``HOST:PORT`` is an error now,
    not minutes of silent retries. Other forms (``auto``, ``ray://...``) pass unchecked.

    Raises:
        ConnectionError: no TCP listener at ``HOST:PORT`` within ``timeout_s``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    host = host.strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        keep_ray_on_loopback()
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}): start one with "
            f"'ray start --head --port {port}' on that host, or pass its GCS address "
            "(host:port, as 'ray start' printed it)") from None
