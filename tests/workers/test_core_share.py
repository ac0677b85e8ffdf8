"""The host's cores shared between its workers step by step (``worker.core_share``), and the
launcher that sets the share up (no model, no worker process started)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from splitserve.launch.local import Cluster
from splitserve.worker.core_share import (
    CoreShare,
    CpuPressure,
    clear_core_share_slot,
    create_core_share,
)
from tests.cluster_config import serve_config


def _psi(path: Path, some_avg10: float) -> None:
    """Write a PSI file as Linux's /proc/pressure/cpu reads."""
    path.write_text(f"some avg10={some_avg10:.2f} avg60=1.00 avg300=0.50 total=123456\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def _share(path: Path, slot: int, applied: list[int], host_threads: int = 2) -> CoreShare:
    """A share on a quiet host: a PSI file beside the share file reads 0% pressure."""
    _psi(path.parent / "cpu", 0.0)
    return CoreShare(path, slot, host_threads, set_threads=applied.append,
                     pressure=CpuPressure(path.parent / "cpu"))


def test_one_busy_worker_takes_every_core_and_busy_workers_split_them(tmp_path) -> None:
    path = tmp_path / "cores"
    create_core_share(path, 3)
    prefill, decode, other = [], [], []
    p, d, o = _share(path, 0, prefill), _share(path, 1, decode), _share(path, 2, other)
    assert d.busy() == 2 and decode == [2]  # alone: both cores
    assert d.busy() == 2 and decode == [2]  # unchanged: not applied again
    assert p.busy() == 1 and prefill == [1]  # two busy: one core each
    assert d.busy() == 1 and decode == [2, 1]  # decode sees it at its next step
    assert o.busy() == 1 and p.busy_workers() == 3  # three on two cores: at least one each
    p.idle()
    o.idle()
    assert d.busy() == 2 and decode == [2, 1, 2]  # the others idle again: all of them back
    assert p.busy_workers() == 1
    d.close()  # closing marks idle
    assert _share(path, 0, []).busy_workers() == 0
    p.close()
    o.close()
    o.close()  # twice is harmless


def test_eight_threads_between_three_busy_workers(tmp_path) -> None:
    path = tmp_path / "cores"
    create_core_share(path, 3)
    shares = [_share(path, i, [], host_threads=8) for i in range(3)]
    assert [s.busy() for s in shares] == [8, 4, 2]  # each sees those busy before it
    assert [s.busy() for s in shares] == [2, 2, 2]
    for s in shares:
        s.close()


def test_a_slot_outside_the_file_or_no_threads_is_refused(tmp_path) -> None:
    path = tmp_path / "cores"
    create_core_share(path, 2)
    with pytest.raises(ValueError, match="slot 2 outside a file of 2 slots"):
        CoreShare(path, 2, 2)
    with pytest.raises(ValueError, match="host_threads must be at least 1"):
        CoreShare(path, 0, 0)
    with pytest.raises(OSError):
        CoreShare(tmp_path / "missing", 0, 2)


def test_a_host_under_cpu_pressure_keeps_the_floor_share(tmp_path) -> None:
    """Above max_pressure (PSI some avg10) an idle neighbour's cores are not taken: the fixed
    split's share (host_threads // slots) until the pressure falls; the reading is reused for
    interval_s (a fake clock)."""
    path, psi = tmp_path / "cores", tmp_path / "cpu"
    create_core_share(path, 2)
    now = [0.0]
    pressure = CpuPressure(psi, interval_s=0.5, clock=lambda: now[0])
    applied: list[int] = []
    d = CoreShare(path, 1, 4, set_threads=applied.append, pressure=pressure, max_pressure=30.0)
    assert d.floor == 2
    _psi(psi, 95.3)  # busy loops beside the workers
    assert d.busy() == 2 and applied == [2]  # alone, but only its floor share
    _psi(psi, 4.0)
    now[0] = 0.4  # within the interval: the busy reading still holds
    assert d.busy() == 2
    now[0] = 0.6
    assert d.busy() == 4 and applied == [2, 4]  # quiet again: every core
    p = CoreShare(path, 0, 4, set_threads=[].append, pressure=pressure, max_pressure=30.0)
    assert p.busy() == 2 and d.busy() == 2  # two busy: the split, pressure or not
    _psi(psi, 30.0)  # at the bound: not above it
    now[0] = 1.2
    p.idle()
    assert d.busy() == 4
    d.close()
    p.close()


@pytest.mark.parametrize("text", [None, "", "some avg10=x\n", "full avg10=99.00\n"])
def test_no_pressure_reading_keeps_the_floor_share(tmp_path, text) -> None:
    """A kernel without PSI (no file), or a file this parser does not understand: no reading,
    so no telling a busy host from a quiet one, and the worker keeps its floor share (as with
    no probe at all)."""
    path, psi = tmp_path / "cores", tmp_path / "cpu"
    create_core_share(path, 2)
    if text is not None:
        psi.write_text(text)
    pressure = CpuPressure(psi)
    assert pressure.some_avg10() is None
    share = CoreShare(path, 0, 2, set_threads=[].append, pressure=pressure)
    assert share.busy() == 1 and share.contended()
    share.close()
    bare = CoreShare(path, 0, 2, set_threads=[].append)
    assert bare.busy() == 1 and bare.contended()
    bare.close()


def test_cpu_pressure_reads_this_hosts_psi_where_linux_has_it() -> None:
    """The real file, where there is one, parses to a percent."""
    value = CpuPressure().some_avg10()
    if not Path("/proc/pressure/cpu").exists():
        assert value is None
    else:
        assert value is not None and 0.0 <= value <= 100.0


class _Proc:
    """A child that is already gone (the launcher's stop() only waits on it)."""

    pid = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def _workers(monkeypatch, **fields) -> tuple[Cluster, dict[str, dict]]:
    """Start a launcher that spawns nothing on a 2-core host; the worker configs it would pass."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(Cluster, "_popen", lambda self, cmd, env: _Proc())
    monkeypatch.setattr(Cluster, "_wait_healthy", lambda self, timeout_s: None)
    cluster = Cluster(serve_config("m", **fields)).start()
    configs = {name: json.loads(cmd[cmd.index("--config-json") + 1])
               for name, (cmd, _) in cluster.commands.items() if name != "api-server"}
    return cluster, configs


def test_the_launcher_gives_each_worker_of_a_split_host_a_slot(monkeypatch, tmp_path) -> None:
    cluster, configs = _workers(monkeypatch, num_prefill=1, num_decode=2)  # on by default
    share = cluster.core_share
    assert share is not None and share.read_bytes() == bytes(3)
    assert {n: (c["core_share"], c["core_share_slot"], c["host_threads"], c["num_threads"])
            for n, c in configs.items()} == {
        "prefill-0": (str(share), 0, 2, 1),
        "decode-0": (str(share), 1, 2, 1),
        "decode-1": (str(share), 2, 2, 1),
    }
    # decode-0 killed inside a step: its byte stays busy until the launcher restarts it.
    _psi(tmp_path / "cpu", 0.0)  # a quiet host
    survivor = CoreShare(share, 0, 2, set_threads=lambda n: None,
                         pressure=CpuPressure(tmp_path / "cpu"))
    CoreShare(share, 1, 2, set_threads=lambda n: None).busy()
    assert survivor.busy() == 1
    cluster.restart("decode-0")
    assert share.read_bytes() == bytes([1, 0, 0]) and survivor.busy() == 2
    survivor.close()
    cluster.stop()
    assert not share.exists() and cluster.core_share is None


def test_clearing_a_slot_from_outside(tmp_path) -> None:
    path = tmp_path / "cores"
    create_core_share(path, 2)
    share = CoreShare(path, 1, 2, set_threads=lambda n: None)
    share.busy()
    clear_core_share_slot(path, 1)
    assert share.busy_workers() == 0
    share.close()


@pytest.mark.parametrize("fields", [
    {"colocated": True, "share_cores": True},  # one worker has every core already
    {"threads_per_worker": 1, "share_cores": True},  # fixed thread counts
    {"cpu_affinity": {"prefill": [0], "decode": [1]}, "share_cores": True},  # pinned CPUs
    {"share_cores": False},  # --no-share-cores
])
def test_no_share_where_the_cores_are_not_split_or_it_is_off(monkeypatch, fields) -> None:
    cluster, configs = _workers(monkeypatch, **fields)
    assert cluster.core_share is None
    assert all(c["core_share"] == "" for c in configs.values())
    cluster.stop()
