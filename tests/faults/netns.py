"""Test "hosts" in network namespaces, and partitions between them (issue 16).

`Hosts` makes, besides this process's own namespace (host ``"0"``: the test, and whatever it
starts without a prefix), one network namespace per extra host, and joins every pair of
hosts with a veth pair of their own: a full mesh of point-to-point links, so no packet is ever
forwarded and nothing outside the namespaces it made is configured (the root namespace only
gets the root ends of its veths, with its address on them). Each host has one address
(``10.215.<n>.<i>/32``, on each of its link ends) and a route to every other host's address
over their direct link: `cut` brings one link down (both directions: a partition of those
two hosts only; established connections stall, new ones get no answer) and `heal` brings it
up with its routes again.

`place` gives `faultrig.Rig` where a role runs: its address, ``ip netns exec NS`` as its
command prefix (which execs, so the process id stays the yuebing process's) and a host
identity of its own, so that the transfer engines of two hosts move KV over TCP, not shared
memory. `close` deletes the namespaces (the veths go with them); the caller stops the
processes first. Needs root and ``ip``: `Hosts.create` skips the test with the reason
otherwise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest
from faultrig import Place


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """Host ``"0"`` (this namespace) and one namespace per name of ``names``."""

    def __init__(self, names: tuple[str, ...]) -> None:
        tag = f"yb{os.getpid() % 100000}"
        net = f"10.215.{os.getpid() % 250}"
        self.names = ("0", *names)
        self.ns = {n: f"{tag}{n}" for n in names}
        self.ip = {n: f"{net}.{i + 1}" for i, n in enumerate(self.names)}
        self.dev: dict[tuple[str, str], str] = {}
        """(host, peer) → the name of host's end of their link."""
        self.made: list[str] = []
        try:
            for n in names:
                _ip("netns", "add", self.ns[n])
                self.made.append(self.ns[n])
                self._ipn(n, "link", "set", "lo", "up")
            for a, b in itertools.combinations(self.names, 2):
                self._link(tag, a, b)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, names: tuple[str, ...]) -> Hosts:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("network partitions need root and `ip` (network namespaces)")
        try:
            return cls(names)
        except RuntimeError as e:
            pytest.skip(f"cannot create network namespaces here: {e}")

    def _ipn(self, host: str, *args: str) -> None:
        _ip(*(("-n", self.ns[host]) if host != "0" else ()), *args)

    def _link(self, tag: str, a: str, b: str) -> None:
        da, db = f"{tag}{a}{b}", f"{tag}{b}{a}"
        _ip("link", "add", da, "type", "veth", "peer", "name", db)
        self.dev[a, b], self.dev[b, a] = da, db
        for host, dev in ((a, da), (b, db)):
            if host != "0":
                _ip("link", "set", dev, "netns", self.ns[host])
            self._ipn(host, "addr", "add", f"{self.ip[host]}/32", "dev", dev)
        self.heal(a, b)

    def heal(self, a: str, b: str) -> None:
        """Bring the link between ``a`` and ``b`` up, with each side's route to the other."""
        for host, peer in ((a, b), (b, a)):
            self._ipn(host, "link", "set", self.dev[host, peer], "up")
        for host, peer in ((a, b), (b, a)):
            self._ipn(host, "route", "replace", f"{self.ip[peer]}/32", "dev",
                      self.dev[host, peer], "src", self.ip[host])

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b``: their link goes down (the other links stay up)."""
        self._ipn(a, "link", "set", self.dev[a, b], "down")

    def place(self, host: str) -> Place:
        if host == "0":
            return Place(self.ip["0"])
        return Place(self.ip[host], ("ip", "netns", "exec", self.ns[host]), f"host-{host}")

    def close(self) -> None:
        """Delete every namespace this made (their veths, the root ends included, go too)."""
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
        for (host, _), dev in self.dev.items():  # a root end whose peer never moved
            if host == "0":
                subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30)
