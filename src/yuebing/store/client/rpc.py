"""Connections from a store client (or node) to the master, following the leader.

Frames are ``[request id, msgpack message]`` over TCP (`wire`); replies carry the same id, so a
late reply to a call that already timed out is recognised and dropped. A reply
``Err(NOT_LEADER, leader=X)`` moves the connection to X; a timeout moves it to the next address
of the configured list; either way the call is retried until ``failover_s`` has passed. Pushes
from the master (node tasks) arrive with an empty id and are handed to ``on_push``.
`MasterConnection` is for one thread; `AsyncMasterConnection` multiplexes concurrent calls of
one asyncio loop on one socket. Both open every connection with the cluster token's preamble
(`wire.auth_preamble`) when they have one: ``token``, by default the process's
``$YUEBING_CLUSTER_TOKEN`` (`core.auth`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable

from yuebing.core.auth import env_cluster_token
from yuebing.core.errors import StoreError
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol import store as m
from yuebing.store.wire import HEADER, FrameSocket, auth_preamble, connect_local, parse_address

log = logging.getLogger(__name__)
C = m.Code
DEADLINE_POLL_S = 0.1
"""Slice of a reply wait (`MasterConnection._wait`): a `deadline` lowered meanwhile, by a signal
handler or another thread (`StoreClient.cut_calls`), ends the wait by then."""
RELEASE_FLUSH_S = 0.1
"""A queued lease release (`release`) waits at most about this long for a call to carry it;
the clients' heartbeat loops send older ones on their own."""
RELEASE_BATCH = 64
"""Releases a read-only call carries along at once; fewer wait for a call that may need their
space or their keys (a put, a remove: any call not in `READS`), or `RELEASE_FLUSH_S`."""
IDLE_CHECK_S = 0.001
"""A connection whose last reply came this recently is sent on without first checking whether
the master closed it (`MasterConnection._open_socket`: one ``poll`` per call saved on a busy
connection); a close that soon after answering is a master going down mid-stream, which that
check could miss just as well."""
READS = frozenset({m.GetReplicas, m.BatchGetReplicas, m.Exists, m.BatchExists, m.PrefixMatch,
                   m.GetStats, m.Heartbeat})


class StoreRpcError(StoreError):
    """The master answered with an error (``code`` is a `messages.Code`); ``resent``: the
    request was sent again after a try whose reply was lost (e.g. at a failover), so that try
    may have taken effect — a resent remove answered NOT_FOUND removed the key itself."""

    def __init__(self, code: int, message: str, resent: bool = False) -> None:
        self.code = C(code) if code in C._value2member_map_ else C.INTERNAL
        self.resent = resent
        super().__init__(f"{self.code.name}: {message}")


def removed_codes(codes: list[int], resent: bool) -> list[int]:
    """A batch remove's per-key codes; when the request was resent, NOT_FOUND is what an
    earlier try that removed the key leaves behind, so it counts as OK."""
    return [int(C.OK) if resent and c == C.NOT_FOUND else c for c in codes]


class _Base:
    def __init__(self, masters: list[str], timeout_s: float, failover_s: float,
                 token: str | None, local: bool = True) -> None:
        if not masters:
            raise StoreError("no master address given")
        self.token = env_cluster_token() if token is None else token
        self.local = local
        """Reach a master dialed on loopback through its Unix socket (`wire.connect_local`)."""
        self.masters = list(masters)
        self.timeout_s = timeout_s
        self.failover_s = failover_s
        self.current = 0
        self._ids = itertools.count(1)
        self.deadline = float("inf")
        """Monotonic time no call runs past (a stopping node's shutdown deadline): tries are
        cut to it and a call raises `StoreError` once it passed; ``inf``: only ``failover_s``
        bounds a call. Another thread may lower it (a float store): the call in flight ends
        within `DEADLINE_POLL_S` of it."""
        self._rel_lock = threading.Lock()
        self._rel_keys: list[str] = []
        self._rel_ids: list[int] = []
        self._rel_since = 0.0

    def release(self, keys: list[str], ids: list[int]) -> None:
        """Queue the lease releases of finished reads (`messages.ReleaseLeases`, one-way: no
        reply comes). A later call carries them in its own send, ahead of its request — no
        system call or master wake-up of their own, and the master applies them first: any
        call not in `READS`, or a read once `RELEASE_BATCH` are queued; the client's heartbeat
        loop sends those queued `RELEASE_FLUSH_S` ago (`take_releases`). Thread-safe. Releases
        that cannot be sent are dropped (those leases end at their expiry)."""
        with self._rel_lock:
            if not self._rel_keys:
                self._rel_since = time.monotonic()
            self._rel_keys += keys
            self._rel_ids += ids

    @property
    def releases(self) -> int:
        """Lease releases queued."""
        return len(self._rel_keys)

    def take_releases(self, queued_by: float = float("inf")) -> bytes:
        """The queued releases as one `ReleaseLeases` frame, dequeued (none unless the oldest
        was queued at ``queued_by`` or before); each release is taken once."""
        with self._rel_lock:
            if not self._rel_keys or self._rel_since > queued_by:
                return b""
            keys, ids = self._rel_keys, self._rel_ids
            self._rel_keys, self._rel_ids = [], []
        payload = encode(m.ReleaseLeases(keys=keys, ids=ids))
        return HEADER.pack(len(payload), next(self._ids)) + payload

    def _carried(self, kind: type) -> bytes:
        """The releases a call of type ``kind`` carries ahead of its request (see `release`)."""
        n = len(self._rel_keys)
        if not n or (kind in READS and n < RELEASE_BATCH):
            return b""
        return self.take_releases()

    def _left(self, msg: Message, end: float) -> float:
        """Seconds a try of ``msg`` may take now: ``timeout_s`` cut to `deadline` (read now: a
        signal handler may lower it during a call) and to ``end`` (the call's own limit);
        `StoreError` once either passed."""
        left = min(end, self.deadline) - time.monotonic()
        if left <= 0:
            raise StoreError(f"{type(msg).__name__} to master {self.address} not sent: the "
                             "caller's deadline passed")
        return min(self.timeout_s, left)

    @property
    def address(self) -> str:
        return self.masters[self.current]

    def _move(self, leader: str) -> None:
        if leader:
            if leader not in self.masters:
                self.masters.append(leader)
            self.current = self.masters.index(leader)
        else:
            self.current = (self.current + 1) % len(self.masters)
        log.info("master connection moves to %s", self.address)



class MasterConnection(_Base):
    """Blocking request/reply to the leader master; not thread-safe."""

    def __init__(self, masters: list[str], timeout_s: float = 5.0, failover_s: float = 15.0,
                 on_push: Callable[[Message], None] | None = None, spin_s: float = 0.0,
                 token: str | None = None, name_as: str = "", local: bool = True) -> None:
        super().__init__(masters, timeout_s, failover_s, token, local)
        self.on_push = on_push
        self.spin_s = spin_s
        self.sock: FrameSocket | None = None
        self.name_as = name_as
        """A client id: each connection opened is named to the master as that client's
        (`m.ConnName`, ahead of its first request) so that it can be answered unasked
        (`answer`); "" = not named."""
        self.conn = 0
        """This connection's name (`m.ConnName.conn`), once the send that carried it went
        out; 0 while there is none."""
        self._naming = b""
        self._awaited = 0
        """The request id `new_id` drew last: an answer to it that comes while another call
        waits is kept (``_early``) for `answer`, not dropped."""
        self._early: bytes | None = None
        self._answered = 0.0  # monotonic time of the last reply: see IDLE_CHECK_S
        self.call_limit_s = float("inf")
        """Seconds one call may take, all its tries and failovers together (each try cut to
        it); `StoreError` past it. ``inf``: ``failover_s`` bounds the retries and each try gets
        ``timeout_s``. Set for a stretch of calls by `StoreClient.limited`."""

    def _connect(self, timeout_s: float) -> FrameSocket:
        self.close()
        self.sock = FrameSocket(self.address, timeout_s, self.spin_s, self.token, self.local)
        if self.name_as:
            name = random.getrandbits(62) or 1
            payload = encode(m.ConnName(client=self.name_as, conn=name))
            self._naming = HEADER.pack(len(payload), next(self._ids)) + payload
            self.conn = -name  # named once the send carrying `_naming` went out
        return self.sock

    def call(self, msg: Message, start: float | None = None) -> Message:
        """Send ``msg`` and return the reply; `StoreRpcError` for an `Err` reply (``start``: as
        in `call_tracked`)."""
        return self.call_tracked(msg, start)[0]

    def call_tracked(self, msg: Message, start: float | None = None) -> tuple[Message, bool]:
        """`call`, and whether the request was sent again after a try whose reply never came
        (that try may have taken effect); a NOT_LEADER refusal does not count. ``start``: when
        the call began, if before now (its `call_limit_s` and ``failover_s`` count from it)."""
        payload = encode(msg)
        start = time.monotonic() if start is None else start
        end = start + self.call_limit_s  # no try runs past it, nor past `deadline`
        deadline = min(start + self.failover_s, end, self.deadline)  # no try starts past it
        lost = False  # a try went out and its reply never came: it may have taken effect
        while True:
            rid, sent = next(self._ids), False
            try_s = self._left(msg, end)
            try:
                sock = self._open_socket(try_s)
                sent = True
                if self._naming:
                    sock.send(rid, payload, self._naming + self._carried(type(msg)), try_s)
                    self._naming, self.conn = b"", -self.conn
                else:
                    sock.send(rid, payload, self._carried(type(msg)), try_s)
                reply = self._wait(sock, rid, try_s)
            except OSError as e:
                log.info("master %s unreachable: %s", self.address, e)
                reply = None
            if reply is None:
                lost = lost or sent
                if time.monotonic() >= deadline:
                    spent = ("the caller's deadline" if deadline < start + self.failover_s
                             else "failover budget")
                    raise StoreError(f"master {self.address} did not answer within "
                                     f"{time.monotonic() - start:.1f}s ({spent} spent)")
                self.close()
                self._move("")
                time.sleep(0.05)
                continue
            self._answered = time.monotonic()
            if type(reply) is m.Err:
                if reply.code == C.NOT_LEADER and time.monotonic() < deadline:
                    if not reply.leader:
                        time.sleep(0.1)  # election in progress
                    self.close()
                    self._move(reply.leader)
                    continue
                raise StoreRpcError(reply.code, reply.message, lost)
            return reply, lost

    def new_id(self) -> int:
        """A request id for an answer the master sends to this connection unasked (`answer`):
        drawn at random above 2**62, so it is no id of a request sent on any connection."""
        self._awaited, self._early = (1 << 62) | random.getrandbits(62), None
        return self._awaited

    def answer(self, rid: int, wait_s: float) -> Message | None:
        """The master's answer to request id ``rid``, which another process asked for on this
        client's behalf (a commit that landed with its write, `store_cluster.Landed`), waited
        for up to ``wait_s`` (cut to `call_limit_s`; `deadline` ends it too) on the open
        connection; None when none came or there is no connection (the caller then asks
        itself). An answer to the last `new_id` that came while another call waited (a
        revoke after a write that failed) is taken at once. `StoreRpcError` for an `Err`
        answer."""
        early = self._early if rid == self._awaited else None
        self._awaited, self._early = 0, None
        sock = self.sock
        if early is not None:
            reply: Message | None = decode(early)
        elif sock is None:
            return None
        else:
            try:
                reply = self._wait(sock, rid, min(wait_s, self.call_limit_s))
            except OSError:
                self.close()
                return None
        if reply is None:
            return None
        self._answered = time.monotonic()
        if type(reply) is m.Err:
            raise StoreRpcError(reply.code, reply.message)
        return reply

    def send_releases(self, frames: bytes) -> None:
        """Send ``frames`` (`take_releases` of this or another connection: the heartbeat
        thread flushing the main connection's old ones) on this connection; dropped if that
        fails."""
        left = min(self.timeout_s, self.deadline - time.monotonic())
        try:
            if left <= 0:
                raise TimeoutError("the connection's deadline passed")
            self._open_socket(left).send_raw(frames, left)
        except OSError as e:
            log.info("master %s: %d bytes of lease releases not sent: %s", self.address,
                     len(frames), e)
            self.close()

    def _open_socket(self, timeout_s: float) -> FrameSocket:
        """The connection to send on: the open one unless the master closed it while it was
        idle (frames that arrived meanwhile are taken first: pushes handed on, late replies
        dropped), else a new one — so a request sent into a connection already closed is not
        counted as a lost try (it never reached the master). Not checked within
        `IDLE_CHECK_S` of a reply on it."""
        if self.sock is not None and time.monotonic() - self._answered > IDLE_CHECK_S \
                and self.sock.ready():
            try:
                while (got := self.sock.recv(0.0)) is not None:
                    self._aside(got)
            except OSError:
                self.close()
        return self.sock or self._connect(timeout_s)

    def _wait(self, sock: FrameSocket, rid: int, timeout_s: float) -> Message | None:
        """The reply to ``rid`` (pushes meanwhile handed on), None after ``timeout_s``. Waits
        in slices of `DEADLINE_POLL_S`, so a `deadline` lowered meanwhile (a signal handler
        stopping the node, another thread closing the client: `StoreClient.cut_calls`) ends
        the wait by then, the deadline set or not when the wait began."""
        end = time.monotonic() + timeout_s
        while True:
            left = min(end, self.deadline) - time.monotonic()
            got = sock.recv(min(left, DEADLINE_POLL_S))
            if got is None:
                if min(end, self.deadline) > time.monotonic():
                    continue
                return None
            if got[0] == rid:
                return decode(got[1])
            self._aside(got)

    def _aside(self, got: tuple[int, bytes]) -> None:
        """A frame no call waits for: a push handed on, the answer `answer` may be asked for
        kept, anything else (a late reply to a call that gave up) dropped."""
        if got[0] == 0:
            self._push(got[1])
        elif got[0] == self._awaited:
            self._early = got[1]

    def _push(self, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except ProtocolError as e:
            log.error("bad push from master: %s", e)
            return
        if self.on_push is not None:
            self.on_push(msg)

    def poll_pushes(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for pushes and hand them to ``on_push``."""
        if self.sock is None:
            time.sleep(timeout_s)
            return
        try:
            got = self.sock.recv(timeout_s)
            while got is not None:
                self._aside(got)
                got = self.sock.recv(0.0)  # everything already arrived, not one read's worth
        except OSError:
            self.close()

    def close(self) -> None:
        self._answered = 0.0
        self.conn, self._naming = 0, b""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class AsyncMasterConnection(_Base):
    """asyncio request/reply: many concurrent calls share one connection and a reader task."""

    def __init__(self, masters: list[str], timeout_s: float = 5.0, failover_s: float = 15.0,
                 token: str | None = None, local: bool = True) -> None:
        super().__init__(masters, timeout_s, failover_s, token, local)
        self._writer: asyncio.StreamWriter | None = None
        self._waiters: dict[int, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None

    async def _connect(self) -> asyncio.StreamWriter:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent first calls share one connection
            if self._writer is not None:
                return self._writer
            return await self._open()

    async def _open(self) -> asyncio.StreamWriter:
        local = connect_local(self.address, self.timeout_s) if self.local else None
        if local is not None:  # connected already: asyncio only takes it over
            opened = await asyncio.open_unix_connection(sock=local)
        else:
            opened = await asyncio.wait_for(
                asyncio.open_connection(*parse_address(self.address)), self.timeout_s)
        reader, writer = opened
        if self.token:
            writer.write(auth_preamble(self.token))
        self._writer = writer
        self._reader = asyncio.get_running_loop().create_task(self._read(reader, writer))
        return writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hand each reply to its waiting call; when the master closes the connection, fail
        the calls waiting on it and drop it, so the next call opens a new one (not sending
        into a closed one and waiting out ``timeout_s``, counted as a lost try)."""
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                length, rid = HEADER.unpack(head)
                payload = await reader.readexactly(length)
                fut = self._waiters.pop(rid, None)
                if fut is not None and not fut.done():
                    try:
                        fut.set_result(decode(payload))
                    except ProtocolError as e:
                        fut.set_exception(StoreError(f"bad reply from master: {e}"))
        except (asyncio.IncompleteReadError, OSError) as e:
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"master connection lost: {e}"))
            self._waiters.clear()
            if self._writer is writer:
                self._writer, self._reader = None, None
                writer.close()

    async def call(self, msg: Message) -> Message:
        """Send ``msg`` and return the reply; `StoreRpcError` for an `Err` reply."""
        return (await self.call_tracked(msg))[0]

    def flush_releases(self, queued_by: float = float("inf")) -> None:
        """Write the releases (queued since ``queued_by`` or before) on the open connection
        (the heartbeat task, for those no call carried); dropped when none is open."""
        frames = self.take_releases(queued_by)
        if frames and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frames)

    async def call_tracked(self, msg: Message) -> tuple[Message, bool]:
        """`call`, and whether the request was sent again after a try whose reply never came."""
        payload = encode(msg)
        deadline = time.monotonic() + self.failover_s
        lost = False  # a try went out and its reply never came: it may have taken effect
        while True:
            rid, sent = next(self._ids), False
            fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            try:
                writer = self._writer or await self._connect()
                self._waiters[rid] = fut
                sent = True
                writer.write(self._carried(type(msg)) + HEADER.pack(len(payload), rid) + payload)
                reply: Message | None = await asyncio.wait_for(fut, self.timeout_s)
            except (TimeoutError, OSError) as e:
                log.info("master %s: %s", self.address, e)
                self._waiters.pop(rid, None)
                reply = None
            if reply is None:
                lost = lost or sent
                if time.monotonic() >= deadline:
                    raise StoreError(f"master {self.address} did not answer in time")
                self.close()
                self._move("")
                await asyncio.sleep(0.05)
                continue
            if type(reply) is m.Err:
                if reply.code == C.NOT_LEADER and time.monotonic() < deadline:
                    if not reply.leader:
                        await asyncio.sleep(0.1)
                    self.close()
                    self._move(reply.leader)
                    continue
                raise StoreRpcError(reply.code, reply.message, lost)
            return reply, lost

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
