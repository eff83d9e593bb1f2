"""The two store clients: `StoreClient` (blocking) and `AsyncStoreClient` (asyncio).

Both are thin drivers over one sans-IO core: every protocol step — puts (`puts`), gets, batch
forms and removes (`core`) — is a generator written once, and a client only performs what it
yields (`core.drive`: a master call, a transfer of a batch, a revoke, a lease release), so both
have the same semantics by construction and differ only in how they wait. Transfers copy what
they can straight into or out of a live node's segment on this host (`DirectSegments`, in the
calling thread) and send the rest through the transfer engine. A heartbeat (a thread on its own
connection, or a task of the loop) keeps the session alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from yuebing.core.errors import StoreError
from yuebing.core.spin import window_s
from yuebing.protocol import encode
from yuebing.protocol import store as m
from yuebing.store.client import core, gets
from yuebing.store.client import reserve as rv
from yuebing.store.client.direct import DirectSegments, keep_freed_memory, transfer_timeout
from yuebing.store.client.inline import InlineGate
from yuebing.store.client.puts import BatchPut, PutOptions, give_back, put
from yuebing.store.client.rpc import (
    RELEASE_FLUSH_S,
    AsyncMasterConnection,
    MasterConnection,
    StoreRpcError,
)
from yuebing.store.config import CLIENT_SPIN_REF_US, ClientConfig
from yuebing.transfer import BatchStatus, TransferConfig, TransferEngine, TransferRequest
from yuebing.transfer.types import RequestStatus

log = logging.getLogger(__name__)
R = TypeVar("R", MasterConnection, AsyncMasterConnection)


class _Client(Generic[R]):
    """What both clients hold (config, identity, master connection, transfer engine, same-host
    copies, reservations, the sizes the master lately refused to hold) and do without I/O."""

    def __init__(self, cfg: ClientConfig, engine: TransferEngine | None, rpc: R,
                 prefix: str, wait_split: bool) -> None:
        self.cfg = cfg
        self.client_id = cfg.client_id or f"{prefix}-{uuid.uuid4().hex[:10]}"
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(TransferConfig(metadata="p2p"))
        self.rpc: R = rpc
        self.direct = DirectSegments(self.engine, cfg.direct, wait_split)
        keep_freed_memory(cfg.keep_freed)
        self._resv = rv.HeldReservations()
        self._inline = InlineGate()

    def _copy_direct(self, reqs: list[TransferRequest], deadline: float | None,
                     read: bool) -> tuple[list[RequestStatus | None], list[TransferRequest]]:
        """Copy what the same-host fast path can: a status per request (None where left to the
        engine) and the requests left. A put's writes end by its write ``deadline``
        (monotonic), a get's reads (``read``) by its read-lease deadline (`LeaseExpired` or
        `WriteExpired` if past already)."""
        timeout = transfer_timeout(self.cfg, deadline, read)
        done = self.direct.copy(reqs, time.monotonic() + timeout)
        return done, [r for r, d in zip(reqs, done, strict=True) if d is None]

    def _closing(self) -> core.Steps[None]:
        """The reservations still held, given back (one try, at most ``rpc_timeout_s``; else
        the master reclaims them at their write expiry)."""
        held = self._resv.pop_all()
        if held:
            self.rpc.failover_s = 0.0
            yield from give_back(held)  # never written: freed at once

    def _closed(self) -> None:
        self.rpc.close()
        self.direct.close()
        if self._own_engine:
            self.engine.close()


class StoreClient(_Client[MasterConnection]):
    """Blocking client; one thread at a time (the heartbeat runs on its own connection)."""

    def __init__(self, cfg: ClientConfig | None = None, engine: TransferEngine | None = None,
                 heartbeat: bool = True) -> None:
        cfg = cfg or ClientConfig()
        super().__init__(cfg, engine, MasterConnection(
            cfg.masters, cfg.rpc_timeout_s, cfg.failover_s,
            spin_s=window_s(cfg.spin_us, CLIENT_SPIN_REF_US), local=cfg.local_socket), "client",
            wait_split=True)
        if cfg.commit_on_landing:  # the master answers landed commits on a named connection
            self.rpc.name_as = self.client_id
        self._landing = 0
        """The request id of the master's answer to the commit that rode on the last write (0:
        none did)."""
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None
        self._hb_conn = MasterConnection(cfg.masters, cfg.rpc_timeout_s, cfg.failover_s,
                                         local=cfg.local_socket)
        """The heartbeat thread's own connection."""
        self.last_heartbeat: float | None = 0.0 if heartbeat else None
        """`time.monotonic` of the last heartbeat the master answered (0.0: none yet); None
        without a heartbeat thread. Lets a caller whose call failed wait for the master to
        answer again without trying it on its own path (`instance.connector`)."""
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat, name="store-heartbeat", daemon=True)
            self._hb.start()

    def _heartbeat(self) -> None:
        """Heartbeats every ``heartbeat_s`` on a connection of its own; in between, every
        `RELEASE_FLUSH_S`, the lease releases no call of this client carried since."""
        conn = self._hb_conn
        next_hb = time.monotonic() + self.cfg.heartbeat_s
        try:
            while not self._stop.wait(min(RELEASE_FLUSH_S,
                                          max(0.0, next_hb - time.monotonic()))):
                old = self.rpc.take_releases(time.monotonic() - RELEASE_FLUSH_S)
                if old:
                    conn.send_releases(old)
                if time.monotonic() < next_hb:
                    continue
                next_hb = time.monotonic() + self.cfg.heartbeat_s
                try:
                    conn.call(m.Heartbeat(client=self.client_id))
                    self.last_heartbeat = time.monotonic()
                except StoreError as e:
                    if not self._stop.is_set():  # not the one `close` ended
                        log.warning("heartbeat failed: %s", e)
        finally:
            conn.close()

    @contextlib.contextmanager
    def limited(self, seconds: float) -> Iterator[None]:
        """Within the block, each master call gives up after ``seconds`` — all its tries and
        failovers together, each try cut to it — with `StoreError`, instead of retrying for
        ``failover_s`` with tries of ``rpc_timeout_s``: for a caller on a latency path that
        would rather do without the store than wait for a master that does not answer (a
        prefix load, `instance.connector`). Transfers keep their own deadlines; blocks nest
        (the shorter limit holds)."""
        old = self.rpc.call_limit_s
        self.rpc.call_limit_s = min(old, seconds)
        try:
            yield
        finally:
            self.rpc.call_limit_s = old

    def cut_calls(self, seconds: float) -> None:
        """Every master call from now on ends within ``seconds`` — the one in flight too, on
        any thread, and the heartbeat's — with `StoreError` past it, for good: for an owner
        shutting down that would not wait out ``failover_s`` (15 s) for a master that does
        not answer (`instance.connector`'s close). Thread-safe; transfers keep their own
        deadlines."""
        end = time.monotonic() + seconds
        for conn in (self.rpc, self._hb_conn):
            conn.deadline = min(conn.deadline, end)

    def transfer(self, reqs: list[TransferRequest], deadline: float | None,
                 read: bool = False, commit: m.PutCommit | None = None) -> BatchStatus:
        """`core.Io.transfer`: same-host copies, the rest through the engine (one inline frame
        when they fit); one status per request either way. A put's ``commit`` rides on the
        frame (`commit_on_landing`) when its write goes as one inline frame to another host:
        then `commit` waits for the master's answer to it."""
        done, rest = self._copy_direct(reqs, deadline, read)
        self._landing = 0
        if not rest:
            return self.direct.merged(done, None)
        timeout = transfer_timeout(self.cfg, deadline, read)
        if commit is None or not self.cfg.commit_on_landing:
            return self.direct.merged(done, self.engine.transfer_status(rest, timeout))
        conn = self.rpc.conn
        if conn <= 0:  # no named connection to be answered on (yet): the commit RPC
            return self.direct.merged(done, self.engine.transfer_status(rest, timeout))
        rid = self.rpc.new_id()
        status, noted = self.engine.transfer_noted(
            rest, encode(m.LandingCommit(rid=rid, conn=conn, commit=commit)), timeout)
        if noted:
            self._landing = rid
        return self.direct.merged(done, status)

    @property
    def noted(self) -> bool:
        """`core.Io.noted`: whether the last write's commit rode on its frame."""
        return bool(self._landing)

    def commit(self, msg: m.PutCommit) -> m.Message:
        """`core.Io.commit`: the master's answer to the commit that rode on the last write, if
        it comes within `ClientConfig.landing_wait_s`; else ``msg`` sent now (a commit the node
        handed on meanwhile is answered OK again: same client, same reservation). One call:
        within `limited`, the wait and the call together give up after its seconds."""
        rid, self._landing = self._landing, 0
        if not rid:
            return self.rpc.call(msg)
        start = time.monotonic()
        got = self.rpc.answer(rid, self.cfg.landing_wait_s)
        return got if got is not None else self.rpc.call(msg, start)

    # ------------------------------------------------------------------ puts
    def put(self, key: str, value: object, *, replicas: int | None = None,
            strategy: str | None = None, preferred: Sequence[str] | None = None,
            hard_pin: bool = False, soft_pin_s: float = 0.0, best_effort: bool = False) -> int:
        """Store ``value`` (any contiguous buffer) under ``key``; values are immutable. A write
        that fails is revoked (naming the failed segments, which the master then avoids) and
        placed again up to ``put_retries`` times. With ``reserve_ahead``, a put of a shape
        this client holds a reservation for writes into it and commits with one RPC.
        Returns the number of replicas stored: a put that cannot place ``replicas`` copies on
        distinct DRAM segments raises `StoreRpcError` NO_SPACE, unless ``best_effort`` (then
        at least one). The steps are `puts.put`'s."""
        opts = PutOptions(replicas, strategy, preferred, hard_pin, soft_pin_s, best_effort)
        return core.run(put(self.cfg, self.client_id, self._resv, key, value, opts,
                            self._inline), self)

    put_from = put
    """Zero-copy put: the engine reads straight from the caller's (registered) buffer."""

    def batch_put(self, keys: Sequence[str], values: Sequence[object], *,
                  replicas: int | None = None, strategy: str | None = None,
                  preferred: Sequence[str] | None = None, hard_pin: bool = False,
                  soft_pin_s: float = 0.0) -> list[int]:
        """Put many values with one master round trip per phase (or one in all, through held
        reservations); returns a `Code` per key (0 for OK). Keys whose write failed are
        revoked and put again up to ``put_retries`` times; a refusal of the whole batch raises
        (`StoreRpcError`). The steps are `puts.BatchPut`'s."""
        opts = PutOptions(replicas, strategy, preferred, hard_pin, soft_pin_s)
        batch = BatchPut(self.cfg, self.client_id, self._resv, keys, values, opts, self._inline)
        return core.run(batch.steps(), self)

    batch_put_from = batch_put
    """Zero-copy batch put: the engine reads straight from the caller's buffers."""

    # ------------------------------------------------------------------ gets
    def get(self, key: str) -> bytearray:
        """The value of ``key`` in a new buffer; `NotFoundError` if absent, `ChecksumError` if
        the replica read does not match, `ReadLeaseExpired` if every read lease ran out."""
        return gets.value_of(core.run(gets.get_leased(self.cfg, key, gets.new_value), self))

    def get_into(self, key: str, buf: object) -> int:
        """Read ``key`` straight into ``buf`` (zero-copy); returns the value's size."""
        return core.run(gets.get_leased(self.cfg, key, gets.into(buf)), self)[0]

    def batch_get(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Values of many keys (None where absent or unreadable): one master call and one
        transfer batch."""
        return core.run(gets.batch_get(self.cfg, keys), self)

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence[object]) -> list[int]:
        """Read many keys into their buffers with one master call and one transfer batch;
        returns each value's size, or -1 where the key is absent or its read failed."""
        return core.run(gets.batch_get_into(self.cfg, keys, bufs), self)

    # ------------------------------------------------------------------ probes, removal, pins
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a committed value (a probe: no read lease)."""
        return core.reply(self.rpc.call(m.Exists(key=key)), m.Bools).values[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """`exists` of each of ``keys``, with one master call."""
        return core.reply(self.rpc.call(m.BatchExists(keys=list(keys))), m.Bools).values

    def prefix_match(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` are stored (the reusable prefix length in blocks)."""
        return core.reply(self.rpc.call(m.PrefixMatch(keys=list(keys))), m.Count).n

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; `StoreRpcError` NOT_FOUND if absent, unless the request had to be
        resent (its first reply lost, e.g. at a failover): then the first try removed it."""
        try:
            self.rpc.call(m.Remove(key=key, force=force))
        except StoreRpcError as e:
            core.remove_failed(e)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """A `Code` per key (NOT_FOUND counts as OK when the request had to be resent)."""
        return core.run(core.batch_remove(keys, force), self)

    def remove_prefix(self, prefix: str, force: bool = False) -> m.Removed:
        """Remove every value whose key starts with ``prefix``: `messages.Removed` counts those
        removed (``n``) and those kept (``kept``: a read in flight leases them, ``leased``, or
        they are hard-pinned, ``pinned``; ``force`` removes them too)."""
        return core.reply(self.rpc.call(m.RemovePrefix(prefix=prefix, force=force)), m.Removed)

    def remove_all(self, force: bool = False) -> m.Removed:
        """`remove_prefix` of every key."""
        return core.reply(self.rpc.call(m.RemoveAll(force=force)), m.Removed)

    def pin(self, keys: Sequence[str], hard: bool = False, soft_pin_s: float = 0.0,
            unpin: bool = False) -> list[int]:
        """Hard-pin, soft-pin (for ``soft_pin_s``) or, with ``unpin``, clear the pins of
        ``keys``; a `Code` per key."""
        msg = m.Pin(keys=list(keys), hard=hard, soft_pin_s=soft_pin_s, unpin=unpin)
        return core.reply(self.rpc.call(msg), m.Codes).codes

    def stats(self) -> dict[str, float]:
        """The master's counters and gauges (`GetStats`)."""
        return core.reply(self.rpc.call(m.GetStats()), m.Stats).values

    def close(self) -> None:
        """Stop the heartbeat (a heartbeat in flight ends at once), give back held reservations
        (`_closing`; if that fails, the master reclaims them at their write expiry), send the
        lease releases no call carried, close the connection and the engine (if its own)."""
        self._stop.set()
        self._hb_conn.deadline = time.monotonic()
        try:
            core.run(self._closing(), self)
        except StoreError as e:
            log.info("held reservations not given back at close: %s", e)
        if self._hb is not None:
            self._hb.join(timeout=2 * self.cfg.heartbeat_s + self.cfg.rpc_timeout_s)
        if self.rpc.releases:
            self.rpc.send_releases(self.rpc.take_releases())
        self._closed()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStoreClient(_Client[AsyncMasterConnection]):
    """The asyncio client: ``async with AsyncStoreClient(cfg) as c: await c.put(...)``. Many
    coroutines may use one at once: a held reservation is claimed by exactly one of them
    (`puts`); the others of that shape go the two-phase way."""

    def __init__(self, cfg: ClientConfig | None = None,
                 engine: TransferEngine | None = None) -> None:
        cfg = cfg or ClientConfig()
        super().__init__(cfg, engine, AsyncMasterConnection(
            cfg.masters, cfg.rpc_timeout_s, cfg.failover_s, local=cfg.local_socket), "aclient",
            wait_split=False)  # its event loop must not stall on the split measurement
        self._hb: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncStoreClient:
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _heartbeat(self) -> None:
        """Heartbeats every ``heartbeat_s``; in between, every `RELEASE_FLUSH_S`, writes the
        lease releases no call carried since."""
        next_hb = time.monotonic() + self.cfg.heartbeat_s
        while True:
            await asyncio.sleep(min(RELEASE_FLUSH_S, max(0.0, next_hb - time.monotonic())))
            self.rpc.flush_releases(time.monotonic() - RELEASE_FLUSH_S)
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + self.cfg.heartbeat_s
                try:
                    await self.rpc.call(m.Heartbeat(client=self.client_id))
                except StoreError as e:
                    log.warning("heartbeat failed: %s", e)

    async def transfer(self, reqs: list[TransferRequest], deadline: float | None,
                       read: bool = False, commit: m.PutCommit | None = None) -> BatchStatus:
        """`core.Io.transfer`, awaited: same-host copies in the loop's thread (~2 ms for
        16 MiB), the rest submitted to the engine and awaited (``commit`` does not ride along:
        `commit` sends it)."""
        done, rest = self._copy_direct(reqs, deadline, read)
        if not rest:
            return self.direct.merged(done, None)
        bid = self.engine.submit(rest, transfer_timeout(self.cfg, deadline, read))
        try:
            return self.direct.merged(done, await self.engine.wait_async(bid))
        finally:
            self.engine.free(bid)

    def commit(self, msg: m.PutCommit) -> Any:
        """`core.Io.commit`: ``msg`` sent (this client's writes carry no commit)."""
        return self.rpc.call(msg)

    noted = False
    """`core.Io.noted`: this client's writes carry no commit."""

    async def put(self, key: str, value: object, *, replicas: int | None = None,
                  strategy: str | None = None, preferred: Sequence[str] | None = None,
                  hard_pin: bool = False, soft_pin_s: float = 0.0,
                  best_effort: bool = False) -> int:
        """`StoreClient.put`; a held reservation of the shape that another coroutine claimed
        first is not waited for: this put goes the two-phase way."""
        return await core.drive(put(self.cfg, self.client_id, self._resv, key, value,
                                    PutOptions(replicas, strategy, preferred, hard_pin,
                                               soft_pin_s, best_effort), self._inline), self)

    put_from = put
    """Zero-copy put (`StoreClient.put_from`)."""

    async def batch_put(self, keys: Sequence[str], values: Sequence[object], *,
                        replicas: int | None = None, strategy: str | None = None,
                        preferred: Sequence[str] | None = None, hard_pin: bool = False,
                        soft_pin_s: float = 0.0) -> list[int]:
        """`StoreClient.batch_put`, through reservations held for the shape and not claimed by
        a concurrent put or batch; a `Code` per key."""
        return await core.drive(BatchPut(self.cfg, self.client_id, self._resv, keys, values,
                                         PutOptions(replicas, strategy, preferred, hard_pin,
                                                    soft_pin_s), self._inline).steps(), self)

    batch_put_from = batch_put
    """Zero-copy batch put (`StoreClient.batch_put_from`)."""

    async def get(self, key: str) -> bytearray:
        """`StoreClient.get`: a new buffer holding the value."""
        got = await core.drive(gets.get_leased(self.cfg, key, gets.new_value), self)
        return gets.value_of(got)

    async def get_into(self, key: str, buf: object) -> int:
        """`StoreClient.get_into`: the value's size, read into ``buf``."""
        return (await core.drive(gets.get_leased(self.cfg, key, gets.into(buf)), self))[0]

    async def batch_get(self, keys: Sequence[str]) -> list[bytearray | None]:
        """`StoreClient.batch_get`: each value (None where absent or unread)."""
        return await core.drive(gets.batch_get(self.cfg, keys), self)

    async def batch_get_into(self, keys: Sequence[str], bufs: Sequence[object]) -> list[int]:
        """`StoreClient.batch_get_into`: each size (-1 where absent or unread)."""
        return await core.drive(gets.batch_get_into(self.cfg, keys, bufs), self)

    async def exists(self, key: str) -> bool:
        """`StoreClient.exists`."""
        return core.reply(await self.rpc.call(m.Exists(key=key)), m.Bools).values[0]

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """`StoreClient.batch_exists`."""
        return core.reply(await self.rpc.call(m.BatchExists(keys=list(keys))), m.Bools).values

    async def prefix_match(self, keys: Sequence[str]) -> int:
        """`StoreClient.prefix_match`: the stored prefix's length, in keys."""
        return core.reply(await self.rpc.call(m.PrefixMatch(keys=list(keys))), m.Count).n

    async def remove(self, key: str, force: bool = False) -> None:
        """`StoreClient.remove` (a resent remove answered NOT_FOUND succeeded)."""
        try:
            await self.rpc.call(m.Remove(key=key, force=force))
        except StoreRpcError as e:
            core.remove_failed(e)

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """`StoreClient.batch_remove`: a `Code` per key."""
        return await core.drive(core.batch_remove(keys, force), self)

    async def remove_prefix(self, prefix: str, force: bool = False) -> m.Removed:
        """`StoreClient.remove_prefix`: removed and kept (leased, pinned) values."""
        msg = m.RemovePrefix(prefix=prefix, force=force)
        return core.reply(await self.rpc.call(msg), m.Removed)

    async def remove_all(self, force: bool = False) -> m.Removed:
        """`StoreClient.remove_all`."""
        return core.reply(await self.rpc.call(m.RemoveAll(force=force)), m.Removed)

    async def pin(self, keys: Sequence[str], hard: bool = False, soft_pin_s: float = 0.0,
                  unpin: bool = False) -> list[int]:
        """`StoreClient.pin`: a `Code` per key."""
        return core.reply(await self.rpc.call(m.Pin(keys=list(keys), hard=hard,
                                                    soft_pin_s=soft_pin_s, unpin=unpin)),
                          m.Codes).codes

    async def stats(self) -> dict[str, float]:
        """`StoreClient.stats`."""
        return core.reply(await self.rpc.call(m.GetStats()), m.Stats).values

    async def close(self) -> None:
        """`StoreClient.close`: the heartbeat task cancelled, held reservations given back,
        the releases no call carried written, the connection and the engine closed."""
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        await core.drive(self._closing(), self)
        self.rpc.flush_releases()
        self._closed()
