"""Listening ports that launchers choose for the roles they start (`cluster.serve`,
`integrations.vllm.run`).

A launcher picks a role's port before the role starts, and the role keeps it across restarts.
The kernel's own pick (bind to port 0) comes from the ephemeral range, the same range that
every outgoing connection takes its source port from. Under load one of those connections can
take the port before the role binds it, and the role then dies with "Address already in use"
(seen: an instance's control port, during an overload benchmark). So `free_port` draws from
outside that range (`/proc/sys/net/ipv4/ip_local_port_range`) and checks that the port is free.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL = (32768, 60999)
"""The kernel's default ephemeral range, used where the file cannot be read."""
LOWEST = 10000
"""No port below this is drawn: the well-known and most registered services live there."""
TRIES = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive bounds)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL
    return (lo, hi) if 0 < lo <= hi <= 65535 else LINUX_EPHEMERAL


def outside(lo: int, hi: int) -> list[range]:
    """The ports from `LOWEST` to 65535 that are not in ``lo..hi``."""
    spans = (range(LOWEST, min(lo, 65536)), range(max(hi + 1, LOWEST), 65536))
    return [r for r in spans if len(r)]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (no ``SO_REUSEADDR``: a port with
    connections in TIME_WAIT counts as taken)."""
    with socket.socket(_family(host)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str, *, ranges: list[range] | None = None,
              rng: random.Random | None = None) -> int:
    """A port on ``host`` (``""``: every interface) that was free a moment ago and lies outside
    the ephemeral range; the kernel's choice if `TRIES` draws find none."""
    spans = outside(*ephemeral_range()) if ranges is None else ranges
    pick = rng or random.SystemRandom()
    total = sum(len(r) for r in spans)
    for _ in range(TRIES if total else 0):
        i = pick.randrange(total)
        for span in spans:
            if i < len(span):
                port = span[i]
                break
            i -= len(span)
        if is_free(host, port):
            return port
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
