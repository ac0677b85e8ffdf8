"""``--kv-store local``: the launcher starts a Mooncake Store master for its workers.

The ``mooncake`` extra's wheel ships the ``mooncake_master`` binary next to the store client. The
master only keeps metadata (which object lives in which client's segment); the memory is the
workers' own (``--kv-store-segment-mb`` each). It binds to loopback here; for workers on several
hosts, start one ``mooncake_master --rpc_port PORT`` yourself and give every worker
``--kv-store mooncake://HOST:PORT`` (docs/serving.md, "Cache tiers").
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from splitserve.ipc.sockets import free_tcp_addr


class StoreError(RuntimeError):
    """The store's master could not be started."""


def master_binary() -> Path:
    """The ``mooncake_master`` executable of the installed ``mooncake`` package.

    Raises:
        StoreError: the ``mooncake`` extra is not installed.
    """
    try:
        import mooncake
    except ImportError as exc:
        raise StoreError("--kv-store local needs Mooncake Store: pip install "
                         f"'splitserve[mooncake]' ({exc})") from exc
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise StoreError(f"the mooncake package has no mooncake_master at {path}")
    return path


def start_local_store(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start a master on loopback; returns the process and its ``mooncake://`` URL once it
    accepts connections.

    Raises:
        StoreError: not installed, or it exited or did not listen within ``timeout_s``.
    """
    port = int(free_tcp_addr().rsplit(":", 1)[1])
    metrics_port = int(free_tcp_addr().rsplit(":", 1)[1])
    cmd = [str(master_binary()), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
           f"--metrics_port={metrics_port}", "--metrics_host=127.0.0.1",
           "--enable_metric_reporting=false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StoreError(f"mooncake_master exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"mooncake://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise StoreError(f"mooncake_master did not listen on port {port} within {timeout_s:g} s")
