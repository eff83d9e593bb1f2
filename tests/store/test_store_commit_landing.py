"""Commit on landing: a put into a reservation on another host sends its `PutCommit` on the write
frame; the node hands it to the master (`Landed`) once the frame landed whole, and the master
answers the client. The master side on a virtual clock (the fence: nothing revoked, expired,
another's, off-range or from a retired node process commits), the target's landing callback
(only frames that landed whole), and the message count with real processes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from master_factories import SIZE, exists
from store_procs import Proc, store_cluster

from yuebing.core.clock import VirtualClock
from yuebing.core.errors import StoreError
from yuebing.protocol import Message, decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Landed, Mount
from yuebing.protocol.transfer import Hello, HelloReply, SlicesDone, WriteSlices
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig, MasterConfig
from yuebing.store.master.core import MasterCore
from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)
from yuebing.transfer.liveness import DEFAULT_SHM_DIR, SHM_PREFIX
from yuebing.transfer.transport.framing import pack, recv_frame, send_frame
from yuebing.transfer.types import BatchStatus, RequestStatus

CLIENT_CONN, NODE_CONN, HEARTBEAT_CONN = 7, 3, 8
NAME = 12345
"""The client's name for its connection `CLIENT_CONN` (`m.ConnName`)."""


# ---------------------------------------------------------------- master core
def core_with_node() -> tuple[MasterCore, VirtualClock]:
    clock = VirtualClock(100.0)
    core = MasterCore(MasterConfig(alignment=1024), clock)
    assert core.handle(Mount(client="n0", segment="n0/dram", size=64 << 10, node="n0",
                             incarnation="i0"), None, NODE_CONN) == m.Ok()  # type: ignore[arg-type]
    return core, clock


def reserved(core: MasterCore, key: str = "a") -> m.Reservation:
    """Client ``c`` (on connection `CLIENT_CONN`, named `NAME`) puts ``key`` and gets the next
    reservation."""
    assert core.handle(m.ConnName(client="c", conn=NAME), None, CLIENT_CONN) is None  # type: ignore[arg-type]
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key=key, size=SIZE), reserve_next=True),
                    None, CLIENT_CONN)  # type: ignore[arg-type]
    assert isinstance(t, m.PutTargets) and t.reservation is not None
    assert core.handle(m.PutEnd(client="c", key=key), None, CLIENT_CONN) == m.Ok()  # type: ignore[arg-type]
    return t.reservation


def land(core: MasterCore, resv: m.Reservation, key: str, **kw: object) -> list:
    """A node's `Landed` for ``key`` written into ``resv`` (fields overridden by ``kw``): what
    the core leaves to answer (it never answers the node)."""
    r = resv.replicas[0]
    fields: dict[str, object] = dict(
        node="n0", incarnation="i0", segment=r.segment, offset=r.offset, size=SIZE, rid=1 << 62,
        conn=NAME, commit=m.PutCommit(client="c", reservation=resv.key, item=m.PutItem(key=key, size=SIZE),
                           reserve_next=True))
    fields.update(kw)
    assert core.handle(Landed(**fields), None, NODE_CONN) is None  # type: ignore[arg-type]
    out = list(core.ready)
    core.ready.clear()
    return out


def test_landed_commit_is_answered_on_the_connection_the_client_named() -> None:
    core, _ = core_with_node()
    resv = reserved(core)
    core.handle(m.Heartbeat(client="c"), None, HEARTBEAT_CONN)  # type: ignore[arg-type]
    core.handle(m.ReleaseLeases(keys=[], ids=[]), None, 9)  # type: ignore[arg-type]
    core.handle(m.Exists(key="x"), None, 10)  # type: ignore[arg-type]
    core.handle(m.ConnName(client="c", conn=NAME + 1), None, 11)  # type: ignore[arg-type]
    out = land(core, resv, "b")
    assert len(out) == 1
    (conn, rid), reply = out[0]
    assert (conn, rid) == (CLIENT_CONN, 1 << 62)  # not the one of its last request
    assert isinstance(reply, m.PutCommitted) and reply.reservation is not None
    assert exists(core, "b") == [True] and core.counters["landed_commits"] == 1
    # the client's own commit after a lost answer is answered OK, as a retried commit
    again = core.handle(m.PutCommit(client="c", reservation=resv.key,
                                    item=m.PutItem(key="b", size=SIZE)), None, CLIENT_CONN)  # type: ignore[arg-type]
    assert isinstance(again, m.PutCommitted)
    # and a late report of a commit the client made itself commits nothing more
    assert land(core, resv, "b") == [] and core.counters["landings_ignored"] == 1


@pytest.mark.parametrize("case", ["revoked", "given_back", "other_client", "off_range",
                                  "short", "retired_node", "other_node", "unknown_segment",
                                  "bad_rid", "unnamed_conn", "other_clients_conn"])
def test_landing_never_commits_outside_the_clients_live_reservation(case: str) -> None:
    core, _ = core_with_node()
    resv = reserved(core)
    r = resv.replicas[0]
    kw: dict[str, object] = {}
    if case == "revoked":  # the write fence: a revoked put's bytes may still land
        core.handle(m.BatchPutRevoke(client="c", keys=[resv.key], failed=[]), None, CLIENT_CONN)  # type: ignore[arg-type]
    elif case == "given_back":
        core.handle(m.BatchPutRevoke(client="c", keys=[], failed=[], unused=[resv.key]),
                    None, CLIENT_CONN)  # type: ignore[arg-type]
    elif case == "other_client":
        core.handle(m.Heartbeat(client="d"), None, 9)  # type: ignore[arg-type]
        core.handle(m.Exists(key="x"), None, 9)  # type: ignore[arg-type]
        kw["commit"] = m.PutCommit(client="d", reservation=resv.key,
                                   item=m.PutItem(key="b", size=SIZE))
    elif case == "off_range":
        kw["offset"] = r.offset + 1024
    elif case == "short":
        kw["size"] = SIZE - 1024
    elif case == "retired_node":
        kw["incarnation"] = "i-old"
    elif case == "other_node":
        assert core.handle(Mount(client="n1", segment="n1/dram", size=64 << 10, node="n1",
                                 incarnation="j0"), None, 11) == m.Ok()  # type: ignore[arg-type]
        kw.update(node="n1", incarnation="j0")
    elif case == "unknown_segment":
        kw["segment"] = "n9/dram"
    elif case == "bad_rid":  # no answer frame could carry it
        kw["rid"] = 1 << 64
    elif case == "unnamed_conn":  # no connection to answer on
        kw["conn"] = NAME + 1
    elif case == "other_clients_conn":  # a name is the naming client's only
        core.handle(m.ConnName(client="d", conn=NAME + 2), None, 9)  # type: ignore[arg-type]
        kw["conn"] = NAME + 2
    assert land(core, resv, "b", **kw) == []
    assert exists(core, "b") == [False]
    assert core.counters["landed_commits"] == 0 and core.counters["landings_ignored"] == 1


def test_revoke_of_a_reservation_a_landed_commit_consumed_answers_committed() -> None:
    """The node landed the frame and handed on its commit, then died before answering it: the
    client sees its write fail and revokes. That revoke answers COMMITTED (the put is done: a
    retry would find the key, EXISTS) and keeps the value; another client's revoke of the name
    does not. A reservation revoked before its report came is revoked: the report is ignored."""
    core, _ = core_with_node()
    resv = reserved(core)
    (_, answer), = land(core, resv, "b")
    assert isinstance(answer, m.PutCommitted) and answer.reservation is not None
    assert core.handle(m.BatchPutRevoke(client="d", keys=[resv.key]), None, 9) == \
        m.Codes(codes=[m.Code.NOT_PENDING])  # type: ignore[arg-type]
    got = core.handle(m.BatchPutRevoke(client="c", keys=[resv.key], failed=["n0/dram"]),
                      None, CLIENT_CONN)  # type: ignore[arg-type]
    assert got == m.Codes(codes=[m.Code.COMMITTED]) and exists(core, "b") == [True]
    nxt = answer.reservation
    assert core.handle(m.BatchPutRevoke(client="c", keys=[nxt.key]), None, CLIENT_CONN) == \
        m.Codes(codes=[m.Code.OK])  # type: ignore[arg-type]
    assert land(core, nxt, "c") == [] and exists(core, "c") == [False]


def test_landing_past_the_write_expiry_is_refused_not_committed() -> None:
    core, clock = core_with_node()
    resv = reserved(core)
    clock.advance_to(clock.now() + resv.expires_in_s + 0.01)
    out = land(core, resv, "b")
    assert len(out) == 1 and isinstance(out[0][1], m.Err)
    assert out[0][1].code == m.Code.NOT_PENDING and exists(core, "b") == [False]
    assert core.counters["landed_commits"] == 0, "a refused landing is not a landed commit"


def test_landed_commit_replicates_as_the_clients_commit() -> None:
    logs = []
    for landed in (True, False):
        core, _ = core_with_node()
        resv = reserved(core)
        core.log = []
        if landed:
            land(core, resv, "b")
        else:
            core.handle(m.PutCommit(client="c", reservation=resv.key,
                                    item=m.PutItem(key="b", size=SIZE), reserve_next=True))
        logs.append(core.log)
    assert logs[0] == logs[1] and logs[0][0][0] == "rename"


# ---------------------------------------------------------------- the target's callback
@pytest.fixture
def owner() -> Iterator[tuple[TransferEngine, list]]:
    eng = TransferEngine(TransferConfig(engine_id="owner"), metadata=EmbeddedMetadata())
    eng.register_segment("seg", size=1 << 16)
    got: list = []
    eng.on_landed(lambda seg, slices, note: got.append((seg, slices, note)))
    yield eng, got
    eng.close()


def _lane(owner: TransferEngine) -> socket.socket:
    host, _, port = owner.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    send_frame(sock, Hello(engine_id="raw", host_id="h"))
    assert isinstance(recv_frame(sock), HelloReply)
    return sock


def test_landing_callback_only_for_frames_that_landed_whole(owner) -> None:
    eng, got = owner
    with _lane(eng) as sock:
        late = WriteSlices(id=1, segment="seg", slices=[(0, 4096, 0, 4096)],
                           expiry=time.time() - 0.5, note=b"late")
        sock.sendall(pack(late) + b"\x01" * 4096)
        done = recv_frame(sock)
        assert isinstance(done, SlicesDone) and "expired" in done.errors[0]
        bad = WriteSlices(id=2, segment="seg", slices=[(0, 16, 0, 16), (1 << 16, 16, 1 << 16, 16)],
                          expiry=time.time() + 10, note=b"half")
        sock.sendall(pack(bad) + b"\x02" * 32)
        done = recv_frame(sock)
        assert isinstance(done, SlicesDone) and done.errors[0] == "" and done.errors[1]
        plain = WriteSlices(id=3, segment="seg", slices=[(0, 16, 0, 16)], expiry=time.time() + 10)
        sock.sendall(pack(plain) + b"\x03" * 16)
        assert recv_frame(sock) == SlicesDone(id=3, errors=[""])
        assert got == []  # expired, partly refused, or no note: no landing
        ok = WriteSlices(id=4, segment="seg", slices=[(64, 16, 64, 32), (80, 16, 64, 32)],
                         expiry=time.time() + 10, note=b"whole")
        sock.sendall(pack(ok) + b"\x04" * 32)
        assert recv_frame(sock) == SlicesDone(id=4, errors=["", ""])
    assert got == [("seg", [(64, 16, 64, 32), (80, 16, 64, 32)], b"whole")]


def test_engine_carries_a_note_on_an_inline_frame_only(owner) -> None:
    eng, got = owner
    with TransferEngine(TransferConfig(engine_id="peer", transports=("tcp",)),
                        metadata=eng.metadata) as peer:
        src = np.full(4096, 5, np.uint8)
        req = TransferRequest(OpCode.WRITE, src.data, "seg", 4096, 4096)
        status, noted = peer.transfer_noted([req], b"n1", 10.0)
        assert noted and status.status == TransferStatus.DONE
        assert got == [("seg", [(4096, 4096, 4096, 4096)], b"n1")]
        big = np.full(32 << 10, 6, np.uint8)  # over the inline limit: the lanes, no note
        with TransferEngine(TransferConfig(engine_id="lanes", transports=("tcp",),
                                           inline_bytes=16 << 10), metadata=eng.metadata) as lanes:
            status, noted = lanes.transfer_noted(
                [TransferRequest(OpCode.WRITE, big.data, "seg", 0, big.nbytes)], b"n2", 10.0)
        assert not noted and status.status == TransferStatus.DONE and len(got) == 1
    assert (eng.segment("seg").array[:32 << 10] == 6).all()


def test_noted_frame_whose_connection_broke_is_never_sent_again(owner) -> None:
    """The target landed a noted frame (and handed on its note) but the sender's connection
    broke before the answer: the frame may have landed, so the sender fails it ("may have
    landed") instead of moving it again the submit way, into a range the note's commit may
    already have un-fenced. An un-noted frame is moved again as before."""
    eng, got = owner
    slow = [True]

    def landed(seg: str, slices: list, note: bytes) -> None:
        got.append(note)
        if slow[0]:
            time.sleep(1.5)  # past the sender's io_timeout_s: its connection "breaks"

    eng.on_landed(landed)
    cfg = TransferConfig(engine_id="peer", transports=("tcp",), io_timeout_s=0.5)
    with TransferEngine(cfg, metadata=eng.metadata) as peer:
        src = np.full(4096, 7, np.uint8)
        req = TransferRequest(OpCode.WRITE, src.data, "seg", 0, 4096)
        status, noted = peer.transfer_noted([req], b"once", 10.0)
        assert noted and status.status == TransferStatus.FAILED
        assert "may have landed" in status.requests[0].error
        time.sleep(1.5)  # a resubmitted frame would have landed by now
        assert got == [b"once"]
        slow[0] = False
        status, noted = peer.transfer_noted([req], b"twice", 10.0)  # a fresh connection
        assert noted and status.status == TransferStatus.DONE and got == [b"once", b"twice"]


# ---------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, Proc]]:
    with store_cluster("landA") as (mst, n):
        yield mst, n


PATIENT_S = 30.0
"""`ClientConfig.landing_wait_s` of the clients here (not 0.2 s): a test that counts answers
then does not depend on how loaded the host is."""


def tcp_only() -> TransferEngine:
    """A client's engine that reaches the node as another host's would: TCP frames."""
    return TransferEngine(TransferConfig(metadata="p2p", transports=("tcp",)))


@contextlib.contextmanager
def landing_client(cluster: tuple[Proc, Proc], prefix: str, fill: int
                   ) -> Iterator[tuple[StoreClient, TransferEngine, np.ndarray]]:
    """A TCP-only client of ``cluster`` whose puts commit on landing (patient: `PATIENT_S`),
    its engine and a 64 KiB value of ``fill`` bytes, put as ``<prefix>/0..2``: the third put's
    commit landed, and the client holds the reservation that ``<prefix>/3`` writes into. Its
    keys are removed when the block ends without an error."""
    cfg = ClientConfig(master=cluster[0].info["address"], direct=False, inline_max_bytes=0,
                       landing_wait_s=PATIENT_S)
    v = np.full(64 << 10, fill, np.uint8)
    with tcp_only() as eng, StoreClient(cfg, engine=eng) as c:
        before = c.stats()["landed_commits"]
        for i in range(3):
            c.put(f"{prefix}/{i}", v)
        assert c.stats()["landed_commits"] == before + 1
        yield c, eng, v
        c.remove_all(force=True)


class Calls:
    """The master RPCs a client sends itself, and the answers it takes that it never asked."""

    def __init__(self, c: StoreClient) -> None:
        self.msgs: list[str] = []
        call, answer = c.rpc.call, c.rpc.answer

        def recording(msg: Message, *start: float | None) -> Message:
            self.msgs.append(type(msg).__name__)
            return call(msg, *start)

        def answered(rid: int, wait_s: float) -> Message | None:
            got = answer(rid, wait_s)
            self.msgs.append("answer" if got is not None else "no answer")
            return got

        c.rpc.call = recording  # type: ignore[method-assign]
        c.rpc.answer = answered  # type: ignore[method-assign]

    def take(self) -> list[str]:
        out, self.msgs = self.msgs, []
        return out


@pytest.mark.parametrize("landing", [True, False])
def test_remote_put_stream_sends_no_commit_of_its_own(cluster, landing: bool) -> None:
    """A remote put into a reservation: with commit on landing the client sends nothing to the
    master (3 messages: its write, the node's report, the master's answer); without, one
    `PutCommit` after the write. Every value reads back."""
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(3)
    vals = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(8)]
    pre = f"l{int(landing)}/"
    cfg = ClientConfig(master=addr, direct=False, inline_max_bytes=0, commit_on_landing=landing,
                       landing_wait_s=PATIENT_S)
    with tcp_only() as eng, StoreClient(cfg, engine=eng) as c:
        before = c.stats()["landed_commits"]
        calls = Calls(c)
        per_put = []
        for i, v in enumerate(vals):
            c.put(f"{pre}{i}", v)
            per_put.append(calls.take())
        assert per_put[:2] == [["PutStart", "PutEnd"]] * 2
        assert per_put[2:] == ([["answer"]] if landing else [["PutCommit"]]) * 6
        assert [c.get(f"{pre}{i}") for i in range(8)] == [v.tobytes() for v in vals]
        assert c.stats()["landed_commits"] - before == (6 if landing else 0)
        c.remove_all(force=True)


def test_late_landing_answer_falls_back_to_the_clients_commit(cluster) -> None:
    """An answer to a landed commit that the client does not take in time (a lost report, a
    failover) is followed by the client's own commit, answered OK as a retry of a commit
    that landed; the late answer is dropped and the stream goes on."""
    with landing_client(cluster, "late", 9) as (c, _, v):
        calls = Calls(c)
        c.rpc.answer = lambda rid, wait_s: None  # type: ignore[method-assign]
        c.put("late/3", v)
        assert calls.take() == ["PutCommit"]
        assert c.get("late/3") == v.tobytes()
        del c.rpc.answer
        calls = Calls(c)
        for i in (4, 5):
            c.put(f"late/{i}", v)
        assert calls.take() == ["answer", "answer"]
        assert [c.get(f"late/{i}") for i in (4, 5)] == [v.tobytes()] * 2
        assert c.stats()["landed_commits"] >= 3


def answer_lost(c: StoreClient, eng: TransferEngine) -> None:
    """``eng``'s noted writes land, their commit is applied and its answer reaches ``c``'s
    connection, but the write is reported failed (as when the node dies before its answer)."""
    real = eng.transfer_noted

    def lost(reqs: list, note: bytes, timeout_s: float | None = None) -> tuple:
        status, noted = real(reqs, note, timeout_s)
        assert noted and status.status == TransferStatus.DONE
        end = time.monotonic() + 30  # the master committed it: its answer is on the way
        while not c.rpc.sock.ready():  # type: ignore[union-attr]
            assert time.monotonic() < end
            time.sleep(0.01)
        failed = RequestStatus(TransferStatus.FAILED, 0, reqs[0].length, "connection broke")
        return BatchStatus(status.batch_id, TransferStatus.FAILED, (failed,)), noted

    eng.transfer_noted = lost  # type: ignore[method-assign]


def test_put_whose_write_fails_after_its_commit_landed_is_done_not_exists(cluster) -> None:
    """The node lands a put's frame and hands on its commit, then the client sees the write
    fail (the node died before its answer: here the answer is dropped). The client's revoke is
    answered COMMITTED and the put returns: it neither raises EXISTS on its retry nor puts
    the value twice, and the value reads back. The next reservation the landed commit placed
    is not left to its write expiry: taken from the answer that came while revoking, and given
    back (it lies on the segment the write failed on)."""
    with landing_client(cluster, "lost", 4) as (c, eng, v):
        answer_lost(c, eng)
        calls = Calls(c)
        before = c.stats()["reservations"]  # the one lost/3 writes into among them
        calls.take()
        assert c.put("lost/3", v) == 1
        assert calls.take() == ["BatchPutRevoke", "answer", "BatchPutRevoke"]
        assert c.stats()["reservations"] == before - 1
        del eng.transfer_noted
        assert c.get("lost/3") == v.tobytes()
        time.sleep(1.0)  # the revoke blamed the node: placed on again once it heartbeats
        c.put("lost/4", v)
        assert c.get("lost/4") == v.tobytes()


def test_put_whose_revoke_fails_after_its_commit_may_have_landed_says_so(cluster) -> None:
    """As above, but the revoke gets no answer: the put does not go on to a second placement
    (which would raise EXISTS for a value it stored itself); it raises `StoreError` saying
    whether the value is stored is unknown. Here it was: it reads back."""
    with landing_client(cluster, "unk", 5) as (c, eng, v):
        answer_lost(c, eng)
        real = c.rpc.call

        def no_revoke(msg: Message, *start: float | None) -> Message:
            if type(msg) is m.BatchPutRevoke:
                raise StoreError("master did not answer (test)")
            return real(msg, *start)

        c.rpc.call = no_revoke  # type: ignore[method-assign]
        calls = Calls(c)
        with pytest.raises(StoreError, match="whether it is stored is unknown"):
            c.put("unk/3", v)
        assert calls.take() == ["BatchPutRevoke"]
        del eng.transfer_noted, c.rpc.call
        assert c.get("unk/3") == v.tobytes()


def test_node_killed_under_a_landing_put_revokes_and_lands_elsewhere() -> None:
    """The node of a reservation dies: the write fails, no commit lands (nothing reports it),
    the reservation is revoked and the put placed again on the other node, whose next
    reservation commits on landing again. The killed node's segment file does not stay."""
    with store_cluster("landKA", "landKB", dram="4MiB") as (mst, a, b):
        seg_a, seg_b = a.info["dram"], b.info["dram"]
        cfg = ClientConfig(master=mst.info["address"], preferred=(seg_a,), placement="preferred",
                           inline_max_bytes=0, landing_wait_s=PATIENT_S)
        with tcp_only() as eng, StoreClient(cfg, engine=eng) as c:
            calls = Calls(c)
            for i in range(3):
                c.put(f"k/{i}", bytes([i]) * 100_000)
            assert calls.take()[-1:] == ["answer"]
            a.kill()
            c.put("k/3", b"\x03" * 100_000)
            assert calls.take() == ["BatchPutRevoke", "PutStart", "PutEnd"]
            reps = c.rpc.call(m.GetReplicas(key="k/3")).replicas  # type: ignore[attr-defined]
            assert [r.segment for r in reps] == [seg_b] and c.get("k/3") == b"\x03" * 100_000
            calls.take()
            c.put("k/4", b"\x04" * 100_000)
            assert calls.take() == ["answer"] and c.get("k/4") == b"\x04" * 100_000
            st = c.stats()
            assert st["pending"] == 0 and st["landed_commits"] == 2
    assert not list(Path(DEFAULT_SHM_DIR).glob(f"{SHM_PREFIX}{a.proc.pid}-*"))  # swept (rig)


# ---------------------------------------------------------------- the node's reports, the client's wait
class FakeMaster:
    """A listening socket standing in for the master: reads frames only once told to."""

    def __init__(self) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        self.address = f"tcp://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.conn: socket.socket | None = None

    def accept(self) -> socket.socket:
        if self.conn is None:
            self.conn, _ = self.lsock.accept()
        return self.conn

    def close(self) -> None:
        for sock in (self.conn, self.lsock):
            if sock is not None:
                sock.close()


def test_landing_reports_never_wait_on_the_lane_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane thread makes one non-blocking send at most: connecting, and the rest of a report
    the socket buffer could not take, are the sender thread's. A master that reads nothing for a
    while holds up no lane thread, and the reports then arrive whole and in order."""
    from yuebing.store.node import landing
    from yuebing.store.wire import FrameBuffer

    waits: list[str] = []
    for name in ("__init__", "send_raw"):
        real = getattr(landing.FrameSocket, name)

        def spy(self: object, *a: object, _real=real, **kw: object) -> object:
            waits.append(threading.current_thread().name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(landing.FrameSocket, name, spy)
    fake = FakeMaster()
    reports = landing.LandingReports("n0", "i0", lambda: fake.address, "", lambda s: s)
    try:
        n = 3000
        for i in range(n):
            note = m.LandingCommit(rid=(1 << 62) + i, conn=NAME, commit=m.PutCommit(
                client="c", reservation="r", item=m.PutItem(key=f"{i}".rjust(4000, "k"), size=SIZE)))
            reports.landed("seg", [(i * SIZE, SIZE, 0, SIZE)], encode(note))
            if i == 0:
                fake.accept()
        assert reports.queued > 1  # the buffer filled: reports (or their rests) were queued
        assert waits and set(waits) == {"landing-reports"}
        conn, buf, got = fake.accept(), FrameBuffer(), []
        conn.settimeout(10)
        end = time.monotonic() + 30
        while len(got) < n - reports.dropped:
            assert time.monotonic() < end, f"{len(got)} of {n - reports.dropped} arrived"
            with contextlib.suppress(TimeoutError):
                data = conn.recv(1 << 16)
                assert data
                buf.buf += data
                got += [decode(p) for _, p in buf.frames()]
        assert all(type(r) is Landed for r in got) and len(got) == reports.sent
        rids = [r.rid - (1 << 62) for r in got]
        assert rids == sorted(rids) and rids[0] == 0
    finally:
        reports.close()
        fake.close()


def test_answer_wait_keeps_to_the_calls_limit() -> None:
    """Within `StoreClient.limited`, a put's wait for a landed commit's answer is cut to the
    call limit (the master here never answers)."""
    from yuebing.store.client.rpc import MasterConnection

    fake = FakeMaster()
    conn = MasterConnection([fake.address], timeout_s=5.0)
    try:
        conn._connect(5.0)
        conn.call_limit_s = 0.1
        start = time.monotonic()
        assert conn.answer(conn.new_id(), 20.0) is None
        assert time.monotonic() - start < 10.0  # not the 20 s asked for
    finally:
        conn.close()
        fake.close()
