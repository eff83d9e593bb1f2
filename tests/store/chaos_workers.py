"""Helpers of the store chaos test (`test_store_chaos`): seeded client workers doing random
operations whose every read is checked against the value derived from its key, the shared
failure record, pausing them for checkpoints, and the final settle check of the master's usage.
Used only by tests/store/test_store_chaos.py."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
from store_procs import Proc

from yuebing.core.errors import StoreError, TransferError
from yuebing.protocol.store import Code
from yuebing.store.client.client import StoreClient
from yuebing.store.client.gets import ChecksumError, NotFoundError
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import TransferConfig, TransferEngine

SEED = int(os.environ.get("YB_CHAOS_SEED", "20261121"))
SIZES = (16_384, 200_000)  # × replicas 1 or 2: 4 shapes, the per-client reservation cap
LIVE_KEYS = 16  # per worker: older keys are removed (keeps DRAM usage below allocation failure)
KEEPERS = 8  # per worker: every tenth key up to this many is never removed (drained, offloaded)

EXPECTED = (StoreError, TransferError)  # a read or write may fail while faults are injected


def value_of(key: str) -> bytes:
    """The one value ever put under ``key``: its size and bytes follow from the key."""
    d = hashlib.blake2b(key.encode(), digest_size=64).digest()
    size = SIZES[d[0] % len(SIZES)]
    return (d * (size // 64 + 1))[:size]


class Chaos:
    """Shared state of one run: failures, the pause gate, whether a node was killed."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s  # the master's --lease-ttl-s
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.stop = threading.Event()
        self.lossy = False  # a node was SIGKILLed: committed values may be gone
        self.missing: list[str] = []  # committed values not found while no node was killed
        self.retried_removes: list[str] = []  # NOT_FOUND from a remove resent after failover
        self.tolerated = 0  # read/write errors while faults were injected

    def fail(self, msg: str) -> None:
        with self.lock:
            self.failures.append(msg)

    def lost(self, msg: str) -> None:
        with self.lock:
            self.missing.append(msg)

    def check(self, stats: Callable[[], dict[str, float]]) -> None:
        """Fail with the first failures and the master's counters (``stats``). A committed value
        found missing while no node was killed fails too unless the master evicted (a cache may
        evict; see `test_watermark_offloads_through_any_replica` for values it should not have)."""
        st = stats()
        if self.missing and not st["evictions"]:
            self.failures += self.missing
        elif self.missing:
            print(f"seed={SEED}: {len(self.missing)} committed values missing after "
                  f"{st['evictions']:.0f} evictions, e.g. {self.missing[:3]}")
        self.missing.clear()
        if self.failures:
            raise AssertionError(f"seed={SEED}: {len(self.failures)} failures:\n"
                                 + "\n".join(self.failures[:20]) + f"\nmaster: {st}")


class Worker(threading.Thread):
    """One client doing random operations on its own keys (``t<id>/<n>``), reading others'."""

    def __init__(self, tid: int, cfg: ClientConfig, chaos: Chaos, peers: list[Worker]) -> None:
        super().__init__(name=f"chaos-{tid}", daemon=True)
        self.tid, self.chaos, self.peers = tid, chaos, peers
        # without the same-host path, TCP frames only: a node as on another host (its puts
        # into reservations commit on landing)
        self.engine = None if cfg.direct else TransferEngine(
            TransferConfig(metadata="p2p", transports=("tcp",)))
        self.client = StoreClient(cfg, engine=self.engine)
        self.rng = random.Random(SEED * 1000 + tid)
        self.committed: dict[str, None] = {}  # put returned OK, not removed (insertion order)
        self.uncertain: set[str] = set()  # a put or remove raised: either state is fine
        self.removed: set[str] = set()
        self.keepers: set[str] = set()
        self.n = 0
        self.ops = 0
        self.closed = False
        self.idle = threading.Event()
        self.ops_table: list[tuple[Callable[[], None], int]] = [
            (self.put, 5), (self.batch_put, 2), (self.get, 5), (self.get_into, 3),
            (self.batch_get, 2), (self.exists, 2), (self.remove, 2)]

    # ---------------------------------------------------------------- keys and checks
    def new_key(self) -> str:
        self.n += 1
        return f"t{self.tid}/{self.n}"

    def pick(self) -> str:
        r = self.rng.random()
        if r < 0.6 and self.committed:
            return self.rng.choice(list(self.committed))
        if r < 0.8:
            peer = self.rng.choice(self.peers)
            return f"t{peer.tid}/{self.rng.randint(1, max(1, peer.n))}"
        if r < 0.9 and self.removed:
            return self.rng.choice(sorted(self.removed))
        return f"t{self.tid}/never-{self.rng.randint(0, 99)}"

    def mine(self, key: str) -> bool:
        return key.startswith(f"t{self.tid}/")

    def saw(self, key: str, got: bytes | bytearray | memoryview | None, how: str) -> None:
        """Check one read: bytes must be the key's value; absence only where allowed."""
        if got is not None:
            if bytes(got) != value_of(key):
                self.chaos.fail(f"{how} {key}: WRONG BYTES ({len(got)} B)")
            elif self.mine(key) and key in self.removed:
                self.chaos.fail(f"{how} {key}: removed value read back")
            return
        if self.mine(key) and key in self.committed and not self.chaos.lossy:
            self.chaos.lost(f"{how} {key}: committed value NOT FOUND (no node was killed)")

    def guard(self, how: str, key: str, fn: Callable[[], None]) -> None:
        """Run the read ``fn``: a checksum error fails (with how long the read took: a read
        outliving its lease would meet reused space — the client re-asks instead), NOT_FOUND is
        judged by `saw`."""
        t0 = time.monotonic()
        try:
            fn()
        except ChecksumError as e:  # reads are bounded by their lease: never reused space
            took = time.monotonic() - t0
            self.chaos.fail(f"{how} {key}: CHECKSUM ERROR after {took:.3f}s ({self.name}): {e}")
        except NotFoundError:
            self.saw(key, None, how)
        except StoreRpcError as e:
            if e.code == Code.NOT_FOUND:
                self.saw(key, None, how)
            else:
                self.chaos.tolerated += 1
        except EXPECTED:
            self.chaos.tolerated += 1

    # ---------------------------------------------------------------- operations
    def put(self) -> None:
        key = self.new_key()
        v = value_of(key)
        replicas = self.rng.choice((1, 1, 1, 2))
        try:
            if self.rng.random() < 0.5:
                self.client.put(key, v, replicas=replicas)
            else:
                self.client.put_from(key, np.frombuffer(v, np.uint8).copy(), replicas=replicas)
            self.committed[key] = None
            if self.n % 10 == 0 and len(self.keepers) < KEEPERS:
                self.keepers.add(key)
        except ChecksumError as e:
            self.chaos.fail(f"put {key}: {e!r}")
        except EXPECTED:
            self.uncertain.add(key)
            self.chaos.tolerated += 1

    def batch_put(self) -> None:
        keys = [self.new_key() for _ in range(self.rng.randint(2, 4))]
        try:
            codes = self.client.batch_put(keys, [value_of(k) for k in keys])
        except EXPECTED:
            self.uncertain.update(keys)
            self.chaos.tolerated += 1
            return
        for k, c in zip(keys, codes, strict=True):
            if c == Code.OK:
                self.committed[k] = None
            else:
                self.uncertain.add(k)

    def get(self) -> None:
        key = self.pick()
        self.guard("get", key, lambda: self.saw(key, self.client.get(key), "get"))

    def get_into(self) -> None:
        key = self.pick()
        buf = bytearray(len(value_of(key)) + self.rng.choice((0, 64)))

        def read() -> None:
            n = self.client.get_into(key, buf)
            self.saw(key, memoryview(buf)[:n], "get_into")
        self.guard("get_into", key, read)

    def batch_get(self) -> None:
        keys = list(dict.fromkeys(self.pick() for _ in range(self.rng.randint(2, 5))))
        if self.rng.random() < 0.5:
            def read() -> None:
                for k, got in zip(keys, self.client.batch_get(keys), strict=True):
                    self.saw_or_probe(k, got, "batch_get")
        else:
            bufs = [bytearray(len(value_of(k))) for k in keys]

            def read() -> None:
                sizes = self.client.batch_get_into(keys, bufs)
                for k, b, n in zip(keys, bufs, sizes, strict=True):
                    self.saw_or_probe(k, memoryview(b)[:n] if n >= 0 else None, "batch_get_into")
        self.guard("batch_get", ",".join(keys), read)

    def saw_or_probe(self, key: str, got: bytes | bytearray | memoryview | None, how: str) -> None:
        """Batch reads answer None both for absent and unreadable: ask `exists` to tell."""
        if got is None and not self.client.exists(key):
            self.saw(key, None, how)
        elif got is not None:
            self.saw(key, got, how)
        else:
            self.chaos.tolerated += 1

    def exists(self) -> None:
        keys = [self.pick() for _ in range(self.rng.randint(1, 4))]
        try:
            found = (self.client.batch_exists(keys) if len(keys) > 1
                     else [self.client.exists(keys[0])])
        except EXPECTED:
            self.chaos.tolerated += 1
            return
        for k, f in zip(keys, found, strict=True):
            if not self.mine(k) or k in self.uncertain:
                continue
            if f and (k in self.removed or "never" in k):
                self.chaos.fail(f"exists {k}: True for a removed or never-put key")
            if not f and k in self.committed and not self.chaos.lossy:
                self.chaos.lost(f"exists {k}: False for a committed value (no node was killed)")

    def remove(self) -> None:
        old = [k for k in self.committed if k not in self.keepers]
        if not old:
            return
        many = len(old) > LIVE_KEYS
        keys = old[:self.rng.randint(2, 4)] if many else [self.rng.choice(old)]
        force = self.rng.random() < 0.3
        leader = self.client.rpc.address
        try:
            codes = (self.client.batch_remove(keys, force=force) if len(keys) > 1
                     else [self.remove_one(keys[0], force)])
        except EXPECTED:
            for k in keys:
                self.committed.pop(k, None)
                self.uncertain.add(k)
            self.chaos.tolerated += 1
            return
        moved = self.client.rpc.address != leader  # sent again to a new leader: the old one
        for k, c in zip(keys, codes, strict=True):  # may have removed it (reply lost)
            if c in (Code.OK, Code.NOT_FOUND):  # NOT_FOUND: its only node was killed
                if c == Code.NOT_FOUND and moved:
                    self.chaos.retried_removes.append(k)
                elif c == Code.NOT_FOUND and not self.chaos.lossy:
                    self.chaos.lost(f"remove {k}: committed value NOT FOUND (no node was killed)")
                self.committed.pop(k, None)
                self.removed.add(k)
            elif c != Code.LEASED:  # LEASED: refused, still committed
                self.committed.pop(k, None)
                self.uncertain.add(k)

    def remove_one(self, key: str, force: bool) -> int:
        try:
            self.client.remove(key, force=force)
            return Code.OK
        except StoreRpcError as e:
            return e.code

    def close(self) -> None:
        """Close the client once (gives its held reservations back)."""
        if not self.closed:
            self.closed = True
            self.client.close()
            if self.engine is not None:
                self.engine.close()

    # ---------------------------------------------------------------- loop
    def run(self) -> None:
        funcs, weights = zip(*self.ops_table, strict=True)
        while not self.chaos.stop.is_set():
            if not self.chaos.running.is_set():
                self.idle.set()
                self.chaos.running.wait(0.1)
                continue
            self.idle.clear()
            op = self.rng.choices(funcs, weights)[0]
            if len(self.committed) > LIVE_KEYS + len(self.keepers):
                op = self.remove
            try:
                op()
            except Exception as e:  # noqa: BLE001 — any other exception is a failure
                self.chaos.fail(f"{self.name} {op.__name__}: unexpected {e!r}")
            self.ops += 1
        self.idle.set()


class Cluster:
    """Workers and processes of one run; ``pause`` stops the workers between operations."""

    def __init__(self, chaos: Chaos, addr: str, n: int, stack: ExitStack) -> None:
        self.chaos = chaos
        self.workers: list[Worker] = []
        for tid in range(n):  # the last worker goes through the engine, TCP only
            cfg = ClientConfig(master=addr, failover_s=20.0, transfer_timeout_s=3.0,
                               rpc_timeout_s=5.0, direct=tid != n - 1)
            self.workers.append(Worker(tid, cfg, chaos, self.workers))
            stack.callback(self.workers[-1].close)
        self.checker = StoreClient(ClientConfig(master=addr, failover_s=20.0,
                                                transfer_timeout_s=3.0))
        stack.callback(self.checker.close)
        stack.callback(self.finish)
        for w in self.workers:
            w.start()

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.chaos.running.clear()
        for w in self.workers:
            assert w.idle.wait(60), f"seed={SEED}: {w.name} did not pause"
        try:
            yield
        finally:
            self.chaos.running.set()

    def finish(self) -> None:
        self.chaos.stop.set()
        self.chaos.running.set()
        for w in self.workers:
            w.join(60)

    def check_all_readable(self, lossy_ok: bool) -> int:
        """With the workers paused: every committed value reads back exactly (an error is
        retried; NOT_FOUND only if ``lossy_ok``), removed ones are gone. Returns the count."""
        n = 0
        for w in self.workers:
            for k in list(w.committed) + sorted(w.uncertain):
                got = self._read(k)
                if got is None and k in w.committed and not lossy_ok:
                    self.chaos.lost(f"checkpoint {k}: committed value NOT FOUND")
                elif got is not None and got != value_of(k):
                    self.chaos.fail(f"checkpoint {k}: WRONG BYTES")
                n += got is not None
            for k in sorted(w.removed):
                if self.checker.exists(k):
                    self.chaos.fail(f"checkpoint {k}: removed value still exists")
        return n

    def _read(self, key: str) -> bytes | None:
        for _ in range(5):
            try:
                return bytes(self.checker.get(key))
            except ChecksumError as e:
                self.chaos.fail(f"checkpoint {key}: CHECKSUM ERROR {e}")
                return None
            except NotFoundError:
                return None
            except EXPECTED:
                time.sleep(0.5)
        if self.chaos.lossy:
            return None
        self.chaos.fail(f"checkpoint {key}: unreadable after 5 tries")
        return None

    def settle(self, segments: int) -> dict[str, float]:
        """Workers closed: poll until nothing is pending, reserved, in flight or quarantined
        and ``segments`` remain; then remove everything and require no allocated byte."""
        for w in self.workers:
            w.close()
        keys = ("pending", "reservations", "tasks", "quarantined_bytes")
        st = poll(lambda: self.checker.stats(),
                  lambda s: all(s[k] == 0 for k in keys) and s["segments"] == segments, 40)
        assert all(st[k] == 0 for k in keys) and st["segments"] == segments, \
            f"seed={SEED}: master did not settle: {st}"
        self.checker.remove_all(force=True)
        st = poll(lambda: self.checker.stats(),
                  lambda s: s["objects"] == 0 and s["dram_used"] == 0 and s["ssd_used"] == 0, 20)
        assert st["objects"] == 0 and st["dram_used"] == 0 and st["ssd_used"] == 0, \
            f"seed={SEED}: bytes still allocated after removing everything: {st}"
        return st


def poll(get: Callable[[], dict[str, float]], ok: Callable[[dict[str, float]], bool],
         timeout_s: float) -> dict[str, float]:
    end = time.monotonic() + timeout_s
    while True:
        v = get()
        if ok(v) or time.monotonic() > end:
            return v
        time.sleep(0.2)


class Logged:
    """Keeps reading a process's output (a full pipe would block it) for failure messages."""

    def __init__(self, p: Proc, name: str) -> None:
        self.p, self.name, self.out = p, name, bytearray()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.proc.stdout is not None
        while chunk := self.p.proc.stdout.read1(1 << 16):
            self.out += chunk

    def alive(self) -> None:
        rc = self.p.proc.poll()
        assert rc is None, f"seed={SEED}: {self.name} exited with {rc}:\n" + \
            self.out.decode(errors="replace")[-3000:]


def run_for(chaos: Chaos, seconds: float, procs: list[Logged]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.2)
        for p in procs:
            p.alive()
