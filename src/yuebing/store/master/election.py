"""Leader election of store masters.

Called by `MasterService` (its serving thread reads ``is_leader`` / ``leader`` every loop; the
elector's own thread does the talking). `SingleElector` makes a lone master the leader at once.
`EtcdElector` campaigns through etcd (v3 HTTP gateway, ``etcd3gw``): it atomically creates the
key ``/yuebing/store/<cluster>/leader`` bound to a lease of ``ttl_s`` and keeps the lease alive;
the others read the key to learn the leader's RPC address and retry the create every ``ttl_s/3``
so one of them takes over within about ``ttl_s`` after the leader dies. A leader whose lease
cannot be refreshed steps down (``is_leader`` turns false) before its lease can have expired,
counted from when the last good refresh was sent; it keeps refreshing, and leads again if one
succeeds while the lease lives (a slow etcd, a descheduled process), giving the lease up only
once etcd says it expired or a TTL passed without a good refresh.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from urllib.parse import urlparse

log = logging.getLogger(__name__)


class Elector(ABC):
    """Decides which master leads. Read from the serving thread; mutated by its own thread."""

    @abstractmethod
    def start(self) -> None:
        """Begin campaigning (non-blocking)."""

    @property
    @abstractmethod
    def is_leader(self) -> bool:
        """True while this master may serve as leader."""

    @abstractmethod
    def leader(self) -> str:
        """RPC address of the current leader ('' while unknown)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop campaigning and give up leadership."""


class SingleElector(Elector):
    """No election: the only master is the leader."""

    def __init__(self, address: str) -> None:
        self.address = address

    def start(self) -> None:
        pass

    @property
    def is_leader(self) -> bool:
        return True

    def leader(self) -> str:
        return self.address


class EtcdElector(Elector):
    """Lease-based election on one etcd key."""

    def __init__(self, url: str, cluster: str, address: str, ttl_s: int = 3) -> None:
        import etcd3gw

        u = urlparse(url)
        self._etcd = etcd3gw.client(host=u.hostname or "127.0.0.1", port=u.port or 2379,
                                    protocol=u.scheme or "http", timeout=max(1.0, ttl_s / 2))
        self.key = f"/yuebing/store/{cluster}/leader"
        self.address = address
        self.ttl_s = ttl_s
        self._leader = False
        self._leader_addr = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_leader(self) -> bool:
        # a refresh that is late means the lease may expire: stop leading before it can
        return self._leader and time.monotonic() - self._lease_ok < self.ttl_s * 0.8

    def leader(self) -> str:
        return self.address if self._leader else self._leader_addr

    def _run(self) -> None:
        period = self.ttl_s / 3.0
        while not self._stop.is_set():
            self._step()
            self._stop.wait(period)

    def _step(self) -> None:
        """One round: a leader refreshes its lease, a standby campaigns."""
        try:
            self._leader_step() if self._leader else self._campaign()
        except Exception as e:  # etcd unreachable or slow
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        """A step failed: a standby waits; a leader whose lease may still live tries its next
        refresh (``is_leader`` is false meanwhile once it is late), one whose lease cannot live
        any more steps down."""
        if self._leader and time.monotonic() - self._lease_ok < self.ttl_s:
            log.warning("could not refresh the leader lease (%s); retrying", e)
            return
        if self._leader:
            log.error("lost etcd while leading (%s); stepping down", e)
        self._leader = False
        self._leader_addr = ""

    def _campaign(self) -> None:
        sent = time.monotonic()  # the lease's TTL runs from a moment after this
        lease = self._etcd.lease(self.ttl_s)
        if self._etcd.create(self.key, self.address, lease=lease):
            self._lease = lease
            self._lease_ok = sent
            self._leader = True
            log.warning("elected store leader at %s", self.address)
            return
        lease.revoke()
        values = self._etcd.get(self.key)
        self._leader_addr = values[0].decode() if values else ""

    def _leader_step(self) -> None:
        sent = time.monotonic()
        if self._lease.refresh() <= 0:
            log.error("the leader lease expired; stepping down")
            self._leader = False
            self._leader_addr = ""
            return
        self._lease_ok = sent

    def close(self) -> None:
        self._stop.set()
        if self._leader:
            try:
                self._lease.revoke()
            except Exception as e:
                log.warning("could not revoke the leader lease: %s", e)
            self._leader = False
        if self._thread.is_alive():
            self._thread.join(timeout=self.ttl_s)
