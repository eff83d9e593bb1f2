"""The store's side of the Conductor's KV index: which store-block keys the store holds.

`StoreHoldings` (pure, on the loop) keeps key → segments from the master's `KvEvents` and tells
the `KvIndex` when a key enters the store or leaves it (only keys of this cluster's KV
fingerprint). `StoreFeed` runs a `KvEventSubscriber` in a daemon thread, hands each batch to the
loop, and repairs a gap by a resync from the master's admin ``/keys``. Built by
`conductor.service`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable

from yuebing.conductor.view import STORE_HOLDER, KvIndex
from yuebing.instance.kvkeys import KEY_PREFIX, parse_range_key, parse_store_key
from yuebing.protocol.store_cluster import EventKind, KvEvents

log = logging.getLogger(__name__)
_UNKNOWN = "?"
RESYNC_LIMIT = 10_000_000


class StoreHoldings:
    """Key → segments of this fingerprint's store blocks, mirrored into ``index``; with
    ``ranges``, the pipeline stages' layer-range objects (``...@A:B``) too, mirrored into
    ``ranges`` with the range as the holder."""

    def __init__(self, index: KvIndex, fingerprint: Callable[[], str],
                 ranges: KvIndex | None = None) -> None:
        self.index = index
        self.ranges = ranges
        self.fingerprint = fingerprint
        self.segments: dict[tuple[int, str], set[str]] = {}
        """(block key, layer range or '' for a whole object) → segments holding it."""
        self.events = 0

    def _parse(self, name: str, fp: str) -> tuple[int, str] | None:
        parsed = parse_store_key(name)
        if parsed is not None:
            return (parsed[1], "") if parsed[0] == fp else None
        ranged = parse_range_key(name) if self.ranges is not None else None
        return (ranged[1], ranged[2]) if ranged is not None and ranged[0] == fp else None

    def apply(self, batch: KvEvents) -> None:
        fp = self.fingerprint()
        if not fp:
            return
        added: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}
        for kind, name, holders in zip(batch.kinds, batch.keys, batch.holders, strict=False):
            what = self._parse(name, fp)
            if what is None:
                continue
            self.events += 1
            segs = self.segments.get(what)
            if kind == EventKind.STORED:
                if segs is None:
                    self.segments[what] = segs = set()
                    added.setdefault(what[1], []).append(what[0])
                segs.update(holders)
            elif segs is not None:
                segs.difference_update(holders)
                segs.discard(_UNKNOWN)
                if not segs:
                    del self.segments[what]
                    removed.setdefault(what[1], []).append(what[0])
        for layers in {*added, *removed}:
            index = self.index if not layers else self.ranges
            assert index is not None
            holder = layers or STORE_HOLDER
            index.add(holder, added.get(layers, []))
            index.remove(holder, removed.get(layers, []))

    def resync(self, names: list[str]) -> None:
        fp = self.fingerprint()
        found = [w for w in (self._parse(n, fp) for n in names) if w is not None]
        self.segments = {w: {_UNKNOWN} for w in found}
        self.index.replace(STORE_HOLDER, [k for k, layers in found if not layers])
        if self.ranges is not None:
            for holder in self.ranges.holder_names():
                self.ranges.replace(holder, [])
            for layers in {layers for _, layers in found if layers}:
                self.ranges.replace(layers, [k for k, r in found if r == layers])
        log.info("store index resynced: %d keys", len(found))


class StoreFeed:
    """Follows the master's event stream from a thread (see the module docstring).

    Batches sent before the subscription settled, or lost in a gap (``seq`` jumps), are repaired
    by a resync: the committed keys listed from ``admin_url``'s ``/keys`` replace the store
    holder's keys, and events that follow apply on top. A resynced key has unknown segments, so a
    later REMOVED of any segment drops it (a miss only costs a recompute, never wrong KV)."""

    def __init__(self, events_address: str, admin_url: str, holdings: StoreHoldings,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.events_address = events_address
        self.admin_url = admin_url.rstrip("/")
        self.holdings = holdings
        self.loop = loop
        self.resyncs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-kv-events", daemon=True)

    def start(self) -> StoreFeed:
        self._thread.start()
        return self

    def _run(self) -> None:
        from yuebing.store.events import KvEventSubscriber

        sub = KvEventSubscriber(self.events_address)
        try:
            need_resync, gaps = True, 0
            while not self._stop.is_set():
                if need_resync and self.admin_url and self.holdings.fingerprint():
                    need_resync = not self._resync()
                batches = sub.poll(0.2)
                if sub.gaps != gaps:
                    gaps, need_resync = sub.gaps, True
                if batches:
                    self.loop.call_soon_threadsafe(self._apply_all, batches)
        except Exception:  # noqa: BLE001 - a broken feed must be loud, the Conductor goes on
            log.exception("the store KV-event feed stopped")
        finally:
            sub.close()

    def _apply_all(self, batches: list[KvEvents]) -> None:
        for b in batches:
            self.holdings.apply(b)

    def _resync(self) -> bool:
        prefix = f"{KEY_PREFIX}{self.holdings.fingerprint()}/"
        url = f"{self.admin_url}/keys?" + urllib.parse.urlencode(
            {"prefix": prefix, "limit": RESYNC_LIMIT})
        try:
            with urllib.request.urlopen(url, timeout=5.0) as resp:  # noqa: S310 - operator URL
                names = json.loads(resp.read())
        except (OSError, ValueError) as e:
            log.warning("store index resync from %s failed: %s", self.admin_url, e)
            return False
        if not isinstance(names, list):
            log.warning("store index resync: %s/keys did not return a list", self.admin_url)
            return False
        self.resyncs += 1
        self.loop.call_soon_threadsafe(self.holdings.resync, [str(n) for n in names])
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
