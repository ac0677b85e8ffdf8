"""A child the local launcher restarts from a short-lived thread (a supervisor, a fault
schedule) outlives that thread: Linux's PR_SET_PDEATHSIG, which every splitserve child sets
(``SPLITSERVE_DIE_WITH_PARENT``), fires when the thread that forked it exits, so the launcher
forks every child from one thread of its own."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from splitserve.config import ServeConfig
from splitserve.launch.local import Cluster

# What splitserve.cli does at start with SPLITSERVE_DIE_WITH_PARENT=1, then waits.
CHILD = ("import ctypes, signal, time; "
         "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); time.sleep(30)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_started_from_an_ending_thread_survives() -> None:
    cluster = Cluster(ServeConfig())
    procs = []

    def restarter() -> None:
        procs.append(cluster._popen([sys.executable, "-c", CHILD], dict(os.environ)))
        time.sleep(1.5)  # the child has set its death signal by now; then this thread ends

    t = threading.Thread(target=restarter)
    t.start()
    t.join()
    try:
        time.sleep(1.5)  # the thread is gone; a child forked by it would have had SIGTERM
        assert procs[0].poll() is None, procs[0].returncode
    finally:
        procs[0].kill()
        procs[0].wait()
