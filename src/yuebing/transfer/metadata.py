"""Segment directories: where an engine publishes its segment descriptors and finds peers'.

`TransferEngine` calls `publish` when a segment is registered, `withdraw` when it is
unregistered or the engine closes, and `lookup` (from the submitting thread) the first time a
request names an uncached segment, and again after a peer failure. `EmbeddedMetadata`: an
in-process dictionary (engines of one process share the default one). `EtcdMetadata`: etcd v3
through its HTTP gateway (``etcd3gw``); descriptors hang on a lease kept alive by a thread, so a
crashed engine's segments disappear after ``ttl_s``. `P2PMetadata`: no service; names are
``host:port/name``, resolved by a handshake with the owner (Mooncake's P2P handshake mode).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from yuebing.core.errors import ConfigError, TransferError
from yuebing.protocol.transfer import HelloReply, SegmentDescriptor

log = logging.getLogger(__name__)


class MetadataService(ABC):
    """A directory of segment descriptors shared by the engines of a cluster."""

    asks_owner = False
    """Whether `lookup` asks the segment's owner itself (p2p): after the owner's address did
    not answer, looking it up again at once would only wait for it again."""

    @abstractmethod
    def publish(self, desc: SegmentDescriptor) -> None:
        """Make ``desc`` visible to peers (replacing an older descriptor of that name)."""

    @abstractmethod
    def withdraw(self, name: str) -> None:
        """Remove segment ``name`` (no error if absent)."""

    @abstractmethod
    def lookup(self, name: str) -> SegmentDescriptor | None:
        """The descriptor of segment ``name``, or None if nobody published it."""

    @abstractmethod
    def names(self) -> list[str]:
        """Every published segment name, sorted."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and keep-alive threads."""


class EmbeddedMetadata(MetadataService):
    """An in-process directory (single process; the default)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._descs: dict[str, SegmentDescriptor] = {}

    def publish(self, desc: SegmentDescriptor) -> None:
        with self._lock:
            old = self._descs.get(desc.name)
            if old is not None and old.engine_id != desc.engine_id:
                raise TransferError(f"segment name {desc.name!r} is already published by "
                                    f"engine {old.engine_id!r}")
            self._descs[desc.name] = desc

    def withdraw(self, name: str) -> None:
        with self._lock:
            self._descs.pop(name, None)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        return self._descs.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._descs)


DEFAULT_EMBEDDED = EmbeddedMetadata()
"""The directory every engine of this process uses with ``metadata="embedded"``."""


class P2PMetadata(MetadataService):
    """Names are ``host:port/segment``; `lookup` asks the owner at ``host:port`` directly.

    ``handshake(address)`` opens a connection and returns the owner's `HelloReply`."""

    asks_owner = True

    def __init__(self, handshake: Callable[[str], HelloReply]) -> None:
        self._handshake = handshake
        self._lock = threading.Lock()
        self._cache: dict[str, SegmentDescriptor] = {}

    def publish(self, desc: SegmentDescriptor) -> None:
        pass  # peers ask the owner itself

    def withdraw(self, name: str) -> None:
        with self._lock:
            for key in [k for k, d in self._cache.items() if d.name == name]:
                del self._cache[key]

    def lookup(self, name: str) -> SegmentDescriptor | None:
        address, sep, local = name.partition("/")
        if not sep or ":" not in address or not local:
            raise TransferError(f"in p2p mode segments are named HOST:PORT/NAME, got {name!r}")
        reply = self._handshake(address)
        with self._lock:
            for d in reply.segments:
                self._cache[f"{address}/{d.name}"] = d
            return self._cache.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._cache)


class EtcdMetadata(MetadataService):
    """Descriptors under ``prefix`` in etcd, each bound to this process's lease."""

    def __init__(self, url: str, prefix: str = "/yuebing/transfer/segments/",
                 ttl_s: int = 10, timeout_s: float = 5.0) -> None:
        import etcd3gw

        if not url.startswith("etcd://"):
            raise ConfigError(f"etcd metadata URL must look like etcd://HOST:PORT, got {url!r}")
        endpoints = [e for e in url[len("etcd://"):].split(",") if e]
        if not endpoints:
            raise ConfigError(f"no etcd endpoint in {url!r}")
        host, _, port = endpoints[0].rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint must be HOST:PORT, got {endpoints[0]!r}")
        self.prefix = prefix
        self._ttl = ttl_s
        self._client = etcd3gw.Etcd3Client(host=host, port=int(port), timeout=timeout_s,
                                           api_path="/v3/")
        self._lease: Any = None  # etcd3gw.Lease once the first segment is published
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def _lease_or_new(self) -> Any:
        with self._lock:
            if self._lease is None:
                self._lease = self._client.lease(self._ttl)
                self._keeper = threading.Thread(target=self._keepalive, daemon=True,
                                                name="tx-etcd-keepalive")
                self._keeper.start()
            return self._lease

    def _keepalive(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                lease = self._lease
                if lease is not None:
                    lease.refresh()
            except Exception as e:  # etcd unreachable for a moment: try again next period
                log.warning("etcd lease refresh failed: %s", e)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise TransferError(f"etcd {what} failed: {e}") from None

    def publish(self, desc: SegmentDescriptor) -> None:
        lease = self._call("lease grant", self._lease_or_new)
        value = msgspec.json.encode(desc)
        self._call("put", lambda: self._client.put(self.prefix + desc.name, value, lease=lease))

    def withdraw(self, name: str) -> None:
        self._call("delete", lambda: self._client.delete(self.prefix + name))

    def lookup(self, name: str) -> SegmentDescriptor | None:
        values = self._call("get", lambda: self._client.get(self.prefix + name))
        if not values:
            return None
        try:
            return msgspec.json.decode(values[0], type=SegmentDescriptor)
        except msgspec.DecodeError as e:
            raise TransferError(f"etcd holds a malformed descriptor for {name!r}: {e}") from None

    def names(self) -> list[str]:
        items = self._call("get prefix", lambda: self._client.get_prefix(self.prefix))
        return sorted(meta["key"].decode()[len(self.prefix):] for _, meta in items)

    def close(self) -> None:
        self._stop.set()
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.revoke()  # drops every key this engine published
            except Exception as e:
                log.warning("etcd lease revoke failed: %s", e)
