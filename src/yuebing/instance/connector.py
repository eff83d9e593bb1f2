"""`KVConnector`: engine KV blocks ↔ store objects (DESIGN §3 "KV keys"), for the roles that
prefill (`instance.coupled`, `instance.prefill`).

A store block (``store_block_tokens`` tokens of all layers) is one store object named by
`kvkeys.store_key`: another model, dtype or geometry is another key — a miss, never wrong KV.
A pipeline stage (``--layers A:B``) stores and loads its range's objects (``...@A:B``); a
whole-model engine assembles a group's range objects when a `PrefixPlan` names the ranges.
The engine belongs to the driver thread, so a load is `fetch` (load thread: store → staging)
then `install` (driver: staging → prefix cache), and a save is `snapshot` (driver, right after
the prefill step) then `save` (save thread: one `batch_put`, off the TTFT path). Loads and
saves have a thread and a store client each, so a load never queues behind a save.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from yuebing.core.config import require
from yuebing.engine import runtime
from yuebing.engine.engine import LLMEngine
from yuebing.engine.kv_transfer import import_prefix
from yuebing.instance.kvkeys import store_block_keys, store_key
from yuebing.instance.staging import Staging
from yuebing.store.client.client import StoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_SLACK_S = 0.5  # `KVConnector.close` waits this long past the grace for a job to return


@dataclass(frozen=True)
class KVConnectorConfig:
    store_block_tokens: int = field(default=256, metadata={
        "help": "tokens per store object (a multiple of the engine block size)"})
    staging_bytes: int = field(default=256 << 20, metadata={
        "help": "registered staging memory for loads and saves (bounds both)"})
    known_keys: int = field(default=65536, metadata={
        "help": "store keys remembered as present (saves skip them without asking)"})
    known_ttl_s: float = field(default=10.0, metadata={
        "help": "how long a key stays known as present: the store may lose it since "
                "(eviction, a dead node, a restarted master), and a later save of the same "
                "prompt after this long asks the store again and puts it back"})
    store_retry_s: float = field(default=5.0, metadata={
        "help": "after a store call failed (the master out of reach: a load's call after "
                "load_timeout_s, a save's after the client's failover budget, 15 s by "
                "default), loads and saves skip the store — they compute and drop at once — "
                "for at least this long and until the store client's heartbeat is answered "
                "again, so that requests do not queue behind calls that would fail the same way"})
    load_timeout_s: float = field(default=2.0, metadata={
        "help": "each store master call of a prefix load (the prefix lookup, the replica "
                "request) gives up after this long, tries and failover included, and the "
                "prefix is computed instead: a load is on the request's TTFT path, so it does "
                "not wait out the store client's failover budget (15 s) for a master that does "
                "not answer (partitioned, stopped, killed). A master slower than this (an "
                "overloaded host, a standby taking over) also costs loads, for store_retry_s. "
                "Saves keep the client's budget"})
    save_staging_share: float = field(default=0.5, metadata={
        "help": "share of the staging memory that snapshots waiting for their save may hold "
                "together; the rest stays for loads (from the store or a peer), which are on "
                "the TTFT path, while saves wait for a store in trouble"})
    close_grace_s: float = field(default=1.0, metadata={
        "help": "at close, queued loads and saves are dropped and those running get this long; "
                "then every store call of the connector's clients fails at once, so a master "
                "that does not answer holds an instance's exit this long, not the client's "
                "failover budget (15 s)"})

    def __post_init__(self) -> None:
        require(self.store_block_tokens > 0, "store_block_tokens must be > 0")
        require(self.staging_bytes > 0, "staging_bytes must be > 0")
        require(self.known_ttl_s >= 0, "known_ttl_s must be >= 0")
        require(self.store_retry_s >= 0, "store_retry_s must be >= 0")
        require(self.load_timeout_s > 0, f"load_timeout_s must be > 0 seconds, got "
                f"{self.load_timeout_s}")
        require(0 < self.save_staging_share <= 1, f"save_staging_share must be in (0, 1], "
                f"got {self.save_staging_share}")
        require(self.close_grace_s >= 0, f"close_grace_s must be >= 0, got "
                f"{self.close_grace_s}")


@dataclass
class Loaded:
    """Store blocks read into staging: the first ``blocks`` store blocks of the prompt."""

    blocks: int
    data: torch.Tensor | None
    lease: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class Snapshot:
    keys: list[str]
    data: torch.Tensor | None
    lease: int = 0


@dataclass
class ConnectorStats:
    """Counters of the connector, counted from three threads (the driver, the load and the
    save threads): each count goes through `add`, under a lock; reads are plain attributes."""

    lookups: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    saves: int = 0
    saved_blocks: int = 0
    save_failures: int = 0
    staging_full: int = 0
    store_skipped: int = 0
    """Loads and saves skipped because a store call failed less than `store_retry_s` ago."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """Add to the named counters, together (``add(loads=1, loaded_bytes=n)``): a plain
        ``+=`` from two threads may lose a count."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    @property
    def load_gbps(self) -> float:
        return self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0


class KVConnector:
    """See the module docstring. ``store`` None: no store (every lookup is 0, saves drop);
    ``saver``: the store client of saves, used on their own thread (None: saves use ``store``
    on the loads' thread, one client being for one thread at a time).

    Misses (evicted between lookup and read, a node gone) load less; the rest is computed.
    Staging is bounded: a fetch that finds no room loads less, a snapshot is skipped, and
    snapshots waiting for their save hold at most ``save_staging_share`` of it. A load's master
    calls give up after ``load_timeout_s`` (it is on the TTFT path); a save keeps the client's
    failover budget. After a failed call, loads compute and saves drop without asking the
    store for ``store_retry_s`` and until its heartbeat is answered again. A failed save is
    logged and counted, never raised."""

    def __init__(self, engine: LLMEngine, store: StoreClient | None,
                 config: KVConnectorConfig, staging: torch.Tensor | None = None,
                 saver: StoreClient | None = None) -> None:
        require(config.store_block_tokens % engine.block_size == 0,
                f"store_block_tokens ({config.store_block_tokens}) must be a multiple of the "
                f"engine block size ({engine.block_size})")
        self.store = store
        self.saver = saver if saver is not None else store
        self.config = config
        self.fingerprint = engine.fingerprint
        self.key_fingerprint = engine.model_fingerprint
        """Keys are the whole model's; a pipeline stage's name its ``layers`` too (`keys`)."""
        self.layers = engine.layers if engine.staged else None
        self.num_layers = engine.model_config.num_layers
        self.dtype = engine.pool.dtype
        self.block_shape = engine.pool.block_shape
        self.per_store_block = config.store_block_tokens // engine.block_size
        self.object_bytes = self.per_store_block * engine.pool.block_nbytes
        buf = staging if staging is not None else torch.empty(config.staging_bytes,
                                                              dtype=torch.uint8)
        self.staging = Staging(buf, int(buf.numel() * config.save_staging_share))
        self.stats = ConnectorStats()
        self._known: OrderedDict[str, float] = OrderedDict()
        """store key → when it was last seen stored (`time.monotonic`)."""
        self._known_lock = threading.Lock()
        self._down_lock = threading.Lock()
        self._store_failed_at: float | None = None
        """`time.monotonic` of the last failed store call while loads and saves skip the
        store (`store_retry_s`); None: they use it."""
        # their copies run on their own thread: an OpenMP pool of theirs beside the driver's
        # would make every step's barriers sleep (`runtime.release_openmp_pool`)
        alone = runtime.release_openmp_pool if engine.device.type == "cpu" else None
        self._loads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kv-load", initializer=alone)
        self._saves = self._loads if saver is None else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kv-save", initializer=alone)
        self._jobs: set[concurrent.futures.Future[Any]] = set()
        """Loads and saves submitted and not done (`close` waits for the running ones)."""

    def submit_fetch(self, token_ids: Sequence[int], max_tokens: int,
                     ranges: Sequence[tuple[int, int]] = ()
                     ) -> concurrent.futures.Future[Loaded]:
        """`fetch` on the load thread (loads one at a time; behind no save if saves have a
        ``saver``)."""
        return self._track(self._loads.submit(self.fetch, token_ids, max_tokens, ranges))

    def submit_save(self, snap: Snapshot) -> concurrent.futures.Future[int]:
        """`save` on the save thread (saves one at a time, in the order submitted; without a
        ``saver``, on the load thread)."""
        return self._track(self._saves.submit(self.save, snap))

    def _track(self, job: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return job

    def close(self) -> None:
        """Stop both threads: queued loads and saves are dropped (their staging with the
        instance); those running get `close_grace_s`, then every call of both store clients
        fails (`StoreClient.cut_calls`; their owner closes them next). Returns once the running
        ones ended, or `CLOSE_SLACK_S` after the grace (a transfer keeps its own deadline)."""
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._saves.shutdown(wait=False, cancel_futures=True)
        for client in {id(c): c for c in (self.store, self.saver) if c is not None}.values():
            cut = getattr(client, "cut_calls", None)  # a test's fake store has none
            if cut is not None:
                cut(self.config.close_grace_s)
        concurrent.futures.wait(list(self._jobs), self.config.close_grace_s + CLOSE_SLACK_S)

    # ------------------------------------------------------------------ keys

    def keys(self, token_ids: Sequence[int], max_tokens: int | None = None,
             layers: tuple[int, int] | None = None) -> list[str]:
        """Store keys of the full store blocks of ``token_ids`` (up to ``max_tokens``): of
        this engine's objects, or with ``layers`` of that range's (a pipeline stage's)."""
        ids = list(token_ids if max_tokens is None else token_ids[:max_tokens])
        fp = self.key_fingerprint
        return [store_key(fp, k, layers or self.layers)
                for k in store_block_keys(ids, self.config.store_block_tokens, fp)]

    def _remember(self, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._known_lock:
            for k in keys:
                self._known[k] = now
                self._known.move_to_end(k)
            while len(self._known) > self.config.known_keys:
                self._known.popitem(last=False)

    def _is_known(self, key: str) -> bool:
        with self._known_lock:
            seen = self._known.get(key)
        return seen is not None and time.monotonic() - seen < self.config.known_ttl_s

    # ------------------------------------------------------------------ I/O side

    def _store_down(self) -> bool:
        """A store call failed less than `store_retry_s` ago, or the store client's
        heartbeat has not been answered since it failed (counted as a skip)."""
        hb = getattr(self.store, "last_heartbeat", None)
        with self._down_lock:  # the load and the save threads both read and set it
            failed = self._store_failed_at
            if failed is None:
                return False
            if time.monotonic() < failed + self.config.store_retry_s or (
                    isinstance(hb, float) and hb < failed):
                self.stats.add(store_skipped=1)
                return True
            self._store_failed_at = None
            return False

    def _store_failed(self) -> None:
        with self._down_lock:
            self._store_failed_at = time.monotonic()

    def _limited(self) -> contextlib.AbstractContextManager[object]:
        """A load's master calls end after `load_timeout_s` (`StoreClient.limited`; a store
        without it, e.g. a test's fake, is called as it is)."""
        limited = getattr(self.store, "limited", None)
        return limited(self.config.load_timeout_s) if limited else contextlib.nullcontext()

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Leading tokens of ``token_ids`` loadable from the store (whole store blocks); on
        the load thread, whose store client it uses."""
        if self.store is None:
            return 0
        self.stats.add(lookups=1)
        keys = self.keys(token_ids, max_tokens)
        if not keys:
            return 0
        with self._limited():
            return self.store.prefix_match(keys) * self.config.store_block_tokens

    def fetch(self, token_ids: Sequence[int], max_tokens: int,
              ranges: Sequence[tuple[int, int]] = ()) -> Loaded:
        """Read the longest stored run of the prompt's first ``max_tokens`` tokens' store
        blocks into staging (load thread). Never raises for a miss: fewer blocks load. With
        ``ranges`` (a pipeline group's stages, tiling the model's layers; whole-model engines
        only), a longer run of the group's range objects is assembled instead."""
        keys = self.keys(token_ids, max_tokens)
        if self.store is None or not keys or self._store_down():
            return Loaded(0, None)
        t0 = time.perf_counter()
        try:
            with self._limited():
                n = self.store.prefix_match(keys)
                if ranges and n < len(keys) and self.layers is None:
                    parts = [self.keys(token_ids, max_tokens, r) for r in ranges]
                    m = min(self.store.prefix_match(k) for k in parts)
                    if m > n:
                        return self._assemble(parts, ranges, m, t0)
        except Exception as e:  # the store is optional for correctness
            self._store_failed()
            log.warning("prefix lookup failed, computing the whole prompt: %s", e)
            return Loaded(0, None)
        taken = None
        while n and taken is None:
            taken = self.staging.take(n * self.object_bytes)
            if taken is None:
                self.stats.add(staging_full=1)
                n //= 2
        if not n or taken is None:
            return Loaded(0, None)
        lease, buf = taken
        views = [buf[i * self.object_bytes:(i + 1) * self.object_bytes] for i in range(n)]
        try:
            with self._limited():
                sizes = self.store.batch_get_into(keys[:n], [v.numpy() for v in views])
        except Exception as e:
            self._store_failed()
            log.warning("reading %d store blocks failed, computing them: %s", n, e)
            sizes = [-1] * n
        good = 0
        while good < n and sizes[good] == self.object_bytes:
            good += 1
        if good < n:
            log.info("store prefix: %d of %d blocks read (the rest was evicted or unreadable)",
                     good, n)
        if good == 0:
            self.staging.give(lease)
            return Loaded(0, None)
        self._remember(keys[:good])
        dt = time.perf_counter() - t0
        return Loaded(good, buf[:good * self.object_bytes], lease, good * self.object_bytes, dt)

    def _assemble(self, parts: list[list[str]], ranges: Sequence[tuple[int, int]], n: int,
                  t0: float) -> Loaded:
        """Read ``n`` store blocks of each layer range (``parts``: each range's keys) and lay
        them out as whole-model objects in staging (load thread)."""
        assert self.store is not None, "fetch checked the store"
        taken = None
        while n and taken is None:
            taken = self.staging.take(2 * n * self.object_bytes)  # the whole, then the parts
            if taken is None:
                self.stats.add(staging_full=1)
                n //= 2
        if taken is None:
            return Loaded(0, None)
        lease, buf = taken
        blocks = n * self.per_store_block
        whole = buf[:n * self.object_bytes].view(self.dtype).view(blocks, *self.block_shape)
        good, at, reads = n, n * self.object_bytes, []
        try:
            for (lo, hi), keys in zip(ranges, parts, strict=True):
                size = self.object_bytes * (hi - lo) // self.num_layers
                views = [buf[at + i * size:at + (i + 1) * size] for i in range(n)]
                sizes = self.store.batch_get_into(keys[:n], [v.numpy() for v in views])
                good = min(good, next((i for i, z in enumerate(sizes) if z != size), n))
                reads.append((lo, hi, buf[at:at + n * size]))
                at += n * size
        except Exception:
            self.staging.give(lease)
            raise
        if good == 0:
            self.staging.give(lease)
            return Loaded(0, None)
        for lo, hi, part in reads:
            shape = (blocks, hi - lo, *self.block_shape[1:])
            whole[:, lo:hi].copy_(part.view(self.dtype).view(shape))
        nbytes = good * self.object_bytes
        return Loaded(good, buf[:nbytes], lease, nbytes, time.perf_counter() - t0)

    def save(self, snap: Snapshot) -> int:
        """Put a snapshot's blocks (save thread); returns how many were stored. Never raises."""
        if self.saver is None or snap.data is None:
            return 0
        try:
            if self._store_down():
                return 0
            present = self.saver.batch_exists(snap.keys)
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                self._remember(snap.keys)
                return 0
            values = [snap.data[i * self.object_bytes:(i + 1) * self.object_bytes].numpy()
                      for i in todo]
            codes = self.saver.batch_put([snap.keys[i] for i in todo], values)
            ok = [snap.keys[i] for i, c in zip(todo, codes, strict=True) if int(c) in (0, 2)]
            self._remember([k for i, k in enumerate(snap.keys) if present[i]] + ok)
            failed = len(ok) < len(todo)
            self.stats.add(saves=1, saved_blocks=len(ok), save_failures=int(failed))
            if failed:
                log.warning("saved %d of %d new store blocks (codes %s)", len(ok), len(todo),
                            sorted({int(c) for c in codes}))
            return len(ok)
        except Exception as e:
            self._store_failed()
            self.stats.add(save_failures=1)
            log.warning("saving %d store blocks failed: %s", len(snap.keys), e)
            return 0
        finally:
            self.staging.give(snap.lease)

    # ------------------------------------------------------------------ driver side

    def install(self, engine: LLMEngine, token_ids: Sequence[int], loaded: Loaded) -> int:
        """Copy fetched blocks into the engine's prefix cache (driver thread); returns the
        tokens now reusable. Always gives the staging space back."""
        try:
            if loaded.blocks == 0 or loaded.data is None:
                return 0
            n = loaded.blocks * self.per_store_block
            data = loaded.data.view(self.dtype).view(n, *self.block_shape)
            t0 = time.perf_counter()
            import_prefix(engine, token_ids, data, self.fingerprint)
            dt = loaded.seconds + time.perf_counter() - t0
            self.stats.add(loads=1, loaded_tokens=loaded.blocks * self.config.store_block_tokens,
                           loaded_bytes=loaded.bytes, load_seconds=dt)
            return loaded.blocks * self.config.store_block_tokens
        except Exception as e:  # e.g. the pool is full now: compute instead
            log.warning("installing %d store blocks failed, computing them: %s",
                        loaded.blocks, e)
            return 0
        finally:
            self.staging.give(loaded.lease)

    def snapshot(self, engine: LLMEngine, token_ids: Sequence[int]) -> Snapshot | None:
        """Copy the prompt's full store blocks not known (lately) to be stored out of the engine's
        prefix cache into staging (driver thread, right after the prefill). None: nothing new,
        no store, or no staging room (counted)."""
        if self.saver is None:
            return None
        keys = self.keys(token_ids)
        first = 0
        while first < len(keys) and self._is_known(keys[first]):
            first += 1
        if first == len(keys):
            return None
        ids = list(token_ids[:len(keys) * self.config.store_block_tokens])
        bs, alloc = engine.block_size, engine.allocator
        blocks = []
        for i, key in enumerate(engine.block_keys(ids)):  # lookups only: no hit statistics
            b = alloc.lookup(key, ids[i * bs:(i + 1) * bs])
            if b is None:
                break
            blocks.append(b)
        have = len(blocks) // self.per_store_block
        if have <= first:
            return None
        taken = None
        while have > first and taken is None:  # what fits: the leading new blocks
            taken = self.staging.take((have - first) * self.object_bytes, saving=True)
            if taken is None:
                self.stats.add(staging_full=1)
                have = first + (have - first) // 2
        if taken is None:
            log.info("no staging room to save %d store blocks", len(keys) - first)
            return None
        lease, buf = taken
        run = blocks[first * self.per_store_block:have * self.per_store_block]
        engine.pool.export_blocks(run, out=buf.view(self.dtype).view(len(run), *self.block_shape))
        return Snapshot(keys[first:have], buf, lease)
