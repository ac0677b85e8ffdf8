"""Linux network namespaces as stand-in hosts: each "host" is a namespace with one veth link into
a bridge that lives in a namespace of its own (the machine's own network is never touched).
Addresses are 10.200.0.0/24, inside namespaces these helpers created. Needs root and iproute2."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Self

CLONE_NEWNET = 0x40000000
DEAD_MAC = "02:00:00:00:00:01"  # no interface has it: frames sent there are dropped unseen


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Hosts:
    """``Hosts(["router", "prefill", "decode"])``: one namespace per name, addresses
    10.200.0.1, .2, ... in that order. Use as a context manager; everything is deleted on exit."""

    def __init__(self, names: list[str]) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("needs root to create network namespaces")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2 ('ip') is not installed")
        tag = str(os.getpid() % 100000)
        self.hub = f"sshub{tag}"
        self.ns = {n: f"ss{n[:3]}{tag}" for n in names}
        self.addr = {n: f"10.200.0.{i + 1}" for i, n in enumerate(names)}
        self.dev = {n: f"v{n[:3]}{tag}" for n in names}  # <= 15 characters
        self.created: list[str] = []

    def __enter__(self) -> Self:
        try:
            _ip("ip", "netns", "add", self.hub)
            self.created.append(self.hub)
            _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
            _ip("ip", "link", "set", "br0", "up", ns=self.hub)
            for name, ns in self.ns.items():
                dev, peer = self.dev[name], self.dev[name] + "b"
                _ip("ip", "netns", "add", ns)
                self.created.append(ns)
                _ip("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer,
                    "netns", self.hub)
                _ip("ip", "link", "set", peer, "master", "br0", "up", ns=self.hub)
                _ip("ip", "addr", "add", f"{self.addr[name]}/24", "dev", dev, ns=ns)
                _ip("ip", "link", "set", dev, "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
        except NetnsUnavailable:
            self.__exit__()
            raise
        return self

    def netem(self, name: str, spec: str) -> None:
        """``tc qdisc replace ... netem SPEC`` on ``name``'s link (e.g. ``delay 5ms loss 1%``)."""
        _ip("tc", "qdisc", "replace", "dev", self.dev[name], "root", "netem", *spec.split(),
            ns=self.ns[name])

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or restore) ``name``'s link: packets are dropped, TCP sees no reset."""
        _ip("ip", "link", "set", self.dev[name], "up" if up else "down", ns=self.ns[name])

    def partition(self, a: str, b: str, cut: bool = True) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (both ways), or let them through
        again (``cut=False``). Each side's neighbour entry for the other is pinned to a MAC no
        interface has, so frames leave and vanish: no reset, no ICMP, the links to other hosts
        untouched; TCP just retransmits, as across a real partition. (iptables/nftables and
        tc's drop actions are missing on these kernels; this needs iproute2 only.)"""
        for x, y in ((a, b), (b, a)):
            if cut:
                _ip("ip", "neigh", "replace", self.addr[y], "lladdr", DEAD_MAC, "dev",
                    self.dev[x], "nud", "permanent", ns=self.ns[x])
            else:
                _ip("ip", "neigh", "del", self.addr[y], "dev", self.dev[x], ns=self.ns[x])

    def executor(self, name: str, max_workers: int = 8) -> ThreadPoolExecutor:
        """Threads whose sockets live inside host ``name`` (a network namespace is per
        thread: each one ``setns``-es itself at start), for a test's HTTP clients."""
        path = f"/var/run/netns/{self.ns[name]}"

        def enter() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {path}")
            finally:
                os.close(fd)

        return ThreadPoolExecutor(max_workers, thread_name_prefix=f"netns-{name}",
                                  initializer=enter)

    def cmd(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``name``."""
        return ["ip", "netns", "exec", self.ns[name], *argv]

    def __exit__(self, *exc) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self.created.clear()
