"""The cluster token: one shared secret every RPC and control port of a cluster requires once a
process binds beyond loopback (the Conductor's HTTP API takes ``--api-key`` instead).

`require_token` (called by the configs' validation): a loopback, ``ipc://`` or ``inproc://``
bind needs no token; any other bind without one is a start-up error naming the flag. With a
token set, a process requires it on every port it serves and sends it on every connection it
dials. It is ``--cluster-token`` or ``$YUEBING_CLUSTER_TOKEN`` (how ``yuebing serve`` hands it
to its roles, off their command lines). It authenticates; it does not encrypt.
"""

from __future__ import annotations

import ipaddress

from yuebing.core import env
from yuebing.core.errors import ConfigError

CLUSTER_TOKEN_ENV = env.CLUSTER_TOKEN
"""Environment variable holding the cluster token (default of every ``--cluster-token``)."""

TOKEN_HELP = ("shared secret every RPC/control port of the cluster requires (required when a "
              f"port binds beyond 127.0.0.1; default: ${CLUSTER_TOKEN_ENV})")
"""Help text of every ``--cluster-token`` flag."""


def env_cluster_token() -> str:
    """The token from ``YUEBING_CLUSTER_TOKEN`` ('' when unset)."""
    return env.cluster_token()


def adopt_cluster_token(token: str) -> None:
    """Make ``token`` (a role's ``--cluster-token``) the process's, so the dialers that default
    to the environment (store clients, instance clients) send it too."""
    if token:
        env.set_cluster_token(token)


def host_of(address: str) -> str:
    """The host of ``tcp://host:port`` / ``host:port`` ('' for ``ipc://``, ``inproc://``)."""
    if address.startswith(("ipc://", "inproc://")):
        return ""
    rest = address.split("://", 1)[-1]
    host = rest.rpartition(":")[0] if ":" in rest else rest
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``; '' = a local ipc/inproc endpoint) is
    reachable from this host only. A wildcard (0.0.0.0, ::) or a name is not."""
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token(flag: str, host: str, token: str) -> None:
    """`ConfigError` when ``host`` (bound by ``flag``) is not loopback and ``token`` is empty."""
    if token or is_loopback(host):
        return
    raise ConfigError(f"{flag} binds {host!r}, beyond this host: set a cluster token "
                      f"(--cluster-token or ${CLUSTER_TOKEN_ENV}) so connections without it "
                      "are refused, or bind 127.0.0.1")
