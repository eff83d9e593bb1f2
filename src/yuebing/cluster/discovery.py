"""etcd discovery of a multi-host cluster's roles: `Discovery`, `Publication`, `Watch`.

Keys ``/yuebing/<cluster>/<kind>/<id>`` hold JSON objects: ``instances/<instance_id>`` -> the
instance's `Hello` (``msgspec.to_builtins``), ``conductor/<id>`` -> ``{"url": ...}``. An
instance (``yuebing serve prefill|decode|coupled --etcd URL``) calls `publish` once ready and
`Publication.close` on shutdown (after a crash the key expires with its lease); the Conductor
polls `list` or `watch`. Every call is synchronous HTTP to etcd's v3 gateway (``etcd3gw``); an
unreachable etcd raises `DiscoveryError` (``publish(..., retry=True)`` keeps trying instead).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import msgspec

from yuebing.core.errors import YuebingError

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,200}$")


class DiscoveryError(YuebingError):
    """etcd is unreachable or refused a call, or a value is not what discovery stores."""


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must be 1-200 chars of [A-Za-z0-9_.:@-] (no '/')")


def parse_etcd_url(url: str) -> tuple[str, str, int]:
    """``http://host:2379`` -> (scheme, host, port); anything else is a `ValueError`."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
        raise ValueError(f"--etcd must be an URL like http://127.0.0.1:2379, got {url!r}")
    return u.scheme, u.hostname, u.port or 2379


class Publication:
    """One published key bound to a lease; a thread refreshes the lease every ``ttl_s / 3``.

    If the lease is lost (etcd was unreachable for longer than the TTL, or etcd restarted
    empty) the thread takes a new lease and writes the key again. With ``retry`` an etcd
    that cannot be reached at first is not an error: the thread writes the key once it can
    (every second until then). `close` stops the thread and revokes the lease, which deletes
    the key.

    Every write is bound to a lease recorded (under ``_lock``) before the write is sent, and
    no lease is recorded once `close` began: `close` revokes the last recorded one, so a write
    the thread has under way when it closes is either deleted by the revoke or refused by etcd
    (its lease is gone), and a lease granted after it is revoked by the thread unused. The key
    never outlives `close` while etcd answers, however the thread and `close` interleave.
    """

    def __init__(self, disc: Discovery, key: str, value: bytes, ttl_s: int,
                 retry: bool = False) -> None:
        self._disc = disc
        self.key = key
        self._value = value
        self.ttl_s = ttl_s
        self._lease: Any = None
        self._lock = threading.Lock()
        """Guards ``_lease`` against `close` (never held over a call to etcd)."""
        self._stop = threading.Event()
        self._written = False
        """The key is written under ``_lease`` (the constructor's, then the thread's)."""
        try:
            self._put()
        except Exception as e:
            if not retry:
                raise
            log.warning("cannot publish %s in etcd %s yet (%s); retrying", key, disc.url, e)
        self._thread = threading.Thread(target=self._keep_alive, name=f"publish:{key}",
                                         daemon=True)
        self._thread.start()

    def _put(self) -> None:
        """Write the key bound to a new lease (constructor, then the thread); nothing once
        `close` began."""
        self._written = False
        client = self._disc.client
        lease = client.lease(self.ttl_s)
        with self._lock:
            closed = self._stop.is_set()
            if not closed:
                self._lease = lease  # before the write: `close` revokes it from now on
        if closed:
            self._revoke(lease)
            return
        client.put(self.key, self._value, lease=lease)
        self._written = True

    def _keep_alive(self) -> None:
        period = self.ttl_s / 3.0
        while not self._stop.wait(period if self._written else min(period, 1.0)):
            try:
                if not self._written:
                    self._put()
                    if self._written:
                        log.warning("published %s", self.key)
                elif self._lease.refresh() <= 0 and not self._stop.is_set():
                    log.warning("lease of %s expired; publishing again", self.key)
                    self._put()
            except Exception as e:  # noqa: BLE001 - etcd down: keep trying until closed
                if not self._stop.is_set():
                    log.warning("cannot refresh the lease of %s: %s", self.key, e)

    def close(self) -> None:
        """Stop refreshing and delete the key (idempotent; an unreachable etcd is logged and
        the key then expires with its lease)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()  # under the lock: the thread records no lease from now on
            lease = self._lease
        if lease is not None:
            self._revoke(lease)
        self._thread.join(timeout=self.ttl_s)

    def _revoke(self, lease: Any) -> None:
        try:
            lease.revoke()
        except Exception as e:  # noqa: BLE001 - the key expires with the lease anyway
            log.warning("could not revoke the lease of %s: %s", self.key, e)

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Watch:
    """A polling watch of one kind: calls ``callback(snapshot)`` from its thread with the
    whole ``{id: value}`` map each time it differs from the previous one (once at start)."""

    def __init__(self, disc: Discovery, kind: str,
                 callback: Callable[[dict[str, dict[str, Any]]], None],
                 interval_s: float) -> None:
        self._disc = disc
        self.kind = kind
        self._callback = callback
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch:{kind}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[str, dict[str, Any]] | None = None
        while not self._stop.is_set():
            try:
                now = self._disc.list(self.kind)
            except DiscoveryError as e:
                log.warning("watch of %s: %s", self.kind, e)
            else:
                if now != last:
                    last = now
                    try:
                        self._callback(now)
                    except Exception:  # noqa: BLE001 - a bad callback must not end the watch
                        log.exception("watch callback of %s failed", self.kind)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 10.0)


class Discovery:
    """Publish and list the roles of cluster ``cluster`` in the etcd at ``etcd_url``."""

    def __init__(self, etcd_url: str, cluster: str = "default", timeout_s: float = 2.0) -> None:
        import etcd3gw

        scheme, host, port = parse_etcd_url(etcd_url)
        _check_name("cluster name", cluster)
        self.url = etcd_url
        self.cluster = cluster
        self.client = etcd3gw.client(host=host, port=port, protocol=scheme, timeout=timeout_s)

    def prefix(self, kind: str) -> str:
        _check_name("kind", kind)
        return f"/yuebing/{self.cluster}/{kind}/"

    def publish_instance(self, instance_id: str, hello: msgspec.Struct) -> Publication:
        """An instance's ``Hello`` at ``instances/<id>`` (5 s lease, written once etcd answers):
        how yuebing's own and the vLLM adapter's instances register."""
        return self.publish("instances", instance_id, msgspec.to_builtins(hello), ttl_s=5,
                            retry=True)

    def publish(self, kind: str, id: str, value: dict[str, Any], ttl_s: int = 5,
                retry: bool = False) -> Publication:
        """Write ``value`` (a JSON-able dict) at ``kind/id`` bound to a lease of ``ttl_s``
        seconds, kept alive until the returned `Publication` is closed. An unreachable etcd
        raises `DiscoveryError`, or with ``retry`` is logged and the key written once etcd
        answers (a role started while etcd is down registers when it is back)."""
        _check_name("id", id)
        if not isinstance(ttl_s, int) or not 1 <= ttl_s <= 3600:
            raise ValueError(f"ttl_s must be a whole number of seconds in 1..3600, got {ttl_s!r}")
        if not isinstance(value, dict):
            raise ValueError(f"a published value must be a dict, got {type(value).__name__}")
        data = json.dumps(value, separators=(",", ":")).encode()
        try:
            return Publication(self, self.prefix(kind) + id, data, ttl_s, retry)
        except Exception as e:
            raise DiscoveryError(f"cannot publish {kind}/{id} in etcd {self.url}: {e}") from e

    def list(self, kind: str) -> dict[str, dict[str, Any]]:
        """Every live ``{id: value}`` of ``kind`` (a value that is not a JSON object is
        logged and left out)."""
        prefix = self.prefix(kind)
        try:
            rows = self.client.get_prefix(prefix)
        except Exception as e:
            raise DiscoveryError(f"cannot list {kind} in etcd {self.url}: {e}") from e
        out: dict[str, dict[str, Any]] = {}
        for value, meta in rows:
            key = meta["key"].decode() if isinstance(meta["key"], bytes) else str(meta["key"])
            try:
                obj = json.loads(value)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                log.warning("etcd key %s does not hold a JSON object; ignored", key)
                continue
            out[key[len(prefix):]] = obj
        return out

    def watch(self, kind: str, callback: Callable[[dict[str, dict[str, Any]]], None],
              interval_s: float = 0.5) -> Watch:
        """Poll `list(kind)` every ``interval_s`` in a thread; ``callback`` gets each new
        snapshot. Close the returned `Watch` to stop."""
        if not 0.01 <= interval_s <= 60:
            raise ValueError(f"interval_s must be in 0.01..60 seconds, got {interval_s}")
        return Watch(self, kind, callback, interval_s)

    def store_master(self) -> str:
        """The store leader's RPC address from the store's election key
        (``/yuebing/store/<cluster>/leader``, `yuebing.store.master.election`; '' if none)."""
        try:
            values = self.client.get(f"/yuebing/store/{self.cluster}/leader")
        except Exception as e:
            raise DiscoveryError(f"cannot read the store leader in etcd {self.url}: {e}") from e
        return values[0].decode() if values else ""

    def wait_for(self, kind: str, count: int, timeout_s: float,
                 predicate: Callable[[dict[str, Any]], bool] | None = None
                 ) -> dict[str, dict[str, Any]]:
        """Poll until at least ``count`` entries of ``kind`` (matching ``predicate``) are
        listed; returns them, or raises `DiscoveryError` after ``timeout_s``."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            found = {k: v for k, v in self.list(kind).items() if predicate is None or predicate(v)}
            if len(found) >= count:
                return found
            if time.monotonic() >= deadline:
                raise DiscoveryError(f"only {len(found)} of {count} {kind} in etcd {self.url} "
                                     f"after {timeout_s}s")
            time.sleep(0.1)
