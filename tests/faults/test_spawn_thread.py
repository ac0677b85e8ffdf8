"""A child the local launcher restarts from a short-lived thread (a supervisor, a fault
schedule) outlives that thread: Linux's PR_SET_PDEATHSIG, which every splitserve child sets
(``SPLITSERVE_DIE_WITH_PARENT``), fires when the thread that forked it exits, so the launcher
forks every child from one thread of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitserve.config import ServeConfig
from splitserve.launch.local import Cluster

# What splitserve.cli does at start with SPLITSERVE_DIE_WITH_PARENT=1, then waits; it creates
# the file named by its argument once its death signal is set.
CHILD = ("import ctypes, pathlib, signal, sys, time; "
         "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
         "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)")


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until ``proc`` has created ``path`` (its death signal is set); fails if it exits first."""
    while not path.exists():
        assert proc.poll() is None, f"child exited with {proc.returncode} before arming"
        time.sleep(0.01)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_started_from_an_ending_thread_survives(tmp_path: Path) -> None:
    """Synchronised on events, not time: the thread ends only once both children have set
    their death signal, and a control child forked by that thread itself (the mistake the
    launcher avoids) must die of it, which proves the signal has been sent before the
    launcher's child is checked."""
    cluster = Cluster(ServeConfig())
    procs: dict[str, subprocess.Popen] = {}

    def restarter() -> None:
        procs["launched"] = cluster._popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "launched")], dict(os.environ))
        procs["control"] = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "control")])
        for name, proc in procs.items():
            _wait_for(tmp_path / name, proc)
        # this thread ends here: a child it forked gets SIGTERM

    t = threading.Thread(target=restarter)
    t.start()
    t.join()
    try:
        assert procs["control"].wait(timeout=60) == -signal.SIGTERM
        assert procs["launched"].poll() is None, procs["launched"].returncode
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
