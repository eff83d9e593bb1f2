"""The master's local socket: a client dialing the master on loopback reaches it through the
abstract Unix socket named after its TCP address (`wire.local_name`), with the same token check;
one dialing another address, with the option off at either end, or facing a name another user
listens on, uses TCP; a master whose name is held does not start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator

import pytest
from test_store_wire import _roundtrip

from yuebing.ops.ports import free_port
from yuebing.protocol.codec import decode, encode
from yuebing.protocol.store import Bools, Exists
from yuebing.store.client.rpc import AsyncMasterConnection, MasterConnection
from yuebing.store.wire import FrameSocket, local_name, local_names
from yuebing.store.wire_server import FrameServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract Unix sockets are Linux's")


def _echo(address: str = "tcp://127.0.0.1:0", local: bool = True, token: str = "") -> FrameServer:
    srv: FrameServer

    def on_frame(cid: int, rid: int, payload: bytes) -> None:
        srv.send(cid, rid, payload[::-1])

    srv = FrameServer(address, on_frame, local=local, token=token)
    return srv


def test_a_client_on_loopback_goes_through_the_local_socket() -> None:
    srv = _echo()
    sock = FrameSocket(srv.address, 2.0)
    try:
        assert sock.local
        assert _roundtrip(srv, sock, 7, b"abc") == (7, b"cba")
        (conn,) = srv.conns.values()
        assert conn.peer == f"local pid {os.getpid()}"  # named by its process in the logs
    finally:
        sock.close()
        srv.close()


@pytest.mark.parametrize("server_local, client_local", [(False, True), (True, False)])
def test_either_end_turned_off_means_tcp(server_local: bool, client_local: bool) -> None:
    srv = _echo(local=server_local)
    sock = FrameSocket(srv.address, 2.0, local=client_local)
    try:
        assert not sock.local
        assert _roundtrip(srv, sock, 7, b"abc") == (7, b"cba")
        (conn,) = srv.conns.values()
        assert conn.peer.startswith("127.0.0.1:")
    finally:
        sock.close()
        srv.close()


@pytest.mark.parametrize("bind, dial", [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "localhost")])
def test_loopback_finds_the_wildcard_and_localhost_names(bind: str, dial: str) -> None:
    port = free_port("127.0.0.1")
    srv = _echo(f"tcp://{bind}:{port}")
    sock = FrameSocket(f"tcp://{dial}:{port}", 2.0)
    try:
        assert sock.local
        assert _roundtrip(srv, sock, 7, b"xyz") == (7, b"zyx")
    finally:
        sock.close()
        srv.close()


def test_only_loopback_addresses_have_local_names() -> None:
    """Another address, even one of this host, may be served elsewhere (a virtual address
    routed to another machine): TCP decides, not a local name."""
    assert local_names("tcp://127.0.0.1:5000") == [local_name("127.0.0.1", 5000),
                                                  local_name("0.0.0.0", 5000)]
    assert local_names("tcp://localhost:5000")[0] == local_name("127.0.0.1", 5000)
    assert local_names("tcp://192.0.2.1:5000") == []
    assert local_names("tcp://127.example:5000") == []  # a name, not a loopback address
    mine = socket.gethostbyname(socket.gethostname())
    if not mine.startswith("127."):
        assert local_names(f"tcp://{mine}:5000") == []
    with pytest.raises(ValueError, match="tcp://127.0.0.1:50151"):
        local_names("127.0.0.1")


def test_the_token_is_checked_on_the_local_socket_too() -> None:
    srv = _echo(token="right")
    good = FrameSocket(srv.address, 2.0, token="right")
    bad = FrameSocket(srv.address, 2.0, token="wrong")
    try:
        assert good.local and bad.local
        assert _roundtrip(srv, good, 7, b"ok") == (7, b"ko")
        with pytest.raises(ConnectionError):
            for _ in range(200):  # closed unanswered
                srv.poll(0.01)
                bad.send(1, b"hi")
                bad.recv(0.01)
    finally:
        good.close()
        bad.close()
        srv.close()


def test_a_held_name_stops_the_master_from_starting_unless_turned_off() -> None:
    """As a taken port would: clients on loopback would reach the holder, not the master."""
    port = free_port("127.0.0.1")
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(local_name("127.0.0.1", port))
    try:
        with pytest.raises(OSError, match="--no-local-socket"):
            _echo(f"tcp://127.0.0.1:{port}")
        srv = _echo(f"tcp://127.0.0.1:{port}", local=False)  # the port was released
        sock = FrameSocket(srv.address, 2.0)
        try:
            assert not sock.local  # nobody listens on the held name: refused, then TCP
            assert _roundtrip(srv, sock, 7, b"abc") == (7, b"cba")
        finally:
            sock.close()
            srv.close()
    finally:
        squat.close()


def test_a_closed_master_frees_its_name_for_the_next() -> None:
    port = free_port("127.0.0.1")
    for _ in range(2):
        srv = _echo(f"tcp://127.0.0.1:{port}")
        assert srv.usock is not None
        srv.close()


def _exists_server(local: bool = True, token: str = "") -> FrameServer:
    srv: FrameServer

    def on_frame(cid: int, rid: int, payload: bytes) -> None:
        msg = decode(payload)
        srv.send(cid, rid, encode(Bools(values=[msg.key == "here"])))

    srv = FrameServer("tcp://127.0.0.1:0", on_frame, local=local, token=token)
    return srv


@pytest.fixture
def serving() -> Iterator[list[FrameServer]]:
    """Servers appended to it are polled on a thread until the test ends."""
    servers: list[FrameServer] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for srv in list(servers):
                srv.poll(0.005)
            stop.wait(0.001 if servers else 0.01)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield servers
    stop.set()
    t.join()
    for srv in servers:
        srv.close()


def _both_connections(address: str, token: str) -> tuple[int, int]:
    """Calls through a blocking and an async master connection; their socket families."""
    conn = MasterConnection([address], 2.0, 2.0, token=token)
    try:
        assert conn.call(Exists(key="here")) == Bools(values=[True])
        assert conn.call(Exists(key="gone")) == Bools(values=[False])
        assert conn.sock is not None
        family = conn.sock.sock.family
    finally:
        conn.close()

    async def run() -> int:
        aconn = AsyncMasterConnection([address], 2.0, 2.0, token=token)
        try:
            assert await aconn.call(Exists(key="here")) == Bools(values=[True])
            assert aconn._writer is not None
            return int(aconn._writer.get_extra_info("socket").family)
        finally:
            aconn.close()
    return family, asyncio.run(run())


def test_blocking_and_async_master_connections_use_the_local_socket(
        serving: list[FrameServer]) -> None:
    srv = _exists_server(token="t")
    serving.append(srv)
    assert _both_connections(srv.address, "t") == (socket.AF_UNIX, socket.AF_UNIX)


@pytest.mark.skipif(os.geteuid() != 0, reason="listening as another user needs root")
def test_a_name_another_user_listens_on_gets_nothing(serving: list[FrameServer]) -> None:
    """A squatter of another user listening on the master's name (the master runs with the
    option off) gets no connection and no token: both connections go by TCP."""
    srv = _exists_server(local=False, token="secret")
    serving.append(srv)
    port = int(srv.address.rsplit(":", 1)[1])
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: another user, listening on the master's name
        try:
            os.setuid(65534)
            squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            squat.bind(local_name("127.0.0.1", port))
            squat.listen(8)
            os.write(ready_w, b"x")
            os.read(done_r, 1)
            squat.settimeout(0.2)
            received = 0
            try:
                while True:  # what the connections that reached it sent
                    c, _ = squat.accept()
                    c.settimeout(0.2)
                    with contextlib.suppress(OSError):
                        received += len(c.recv(4096))
            except OSError:
                pass
            os.write(got_w, str(received).encode())
        finally:
            os._exit(0)
    released = False
    try:
        assert os.read(ready_r, 1) == b"x"
        families = _both_connections(srv.address, "secret")
        os.write(done_w, b"x")
        released = True
        assert os.read(got_r, 32) == b"0"  # no byte (no token) reached it
        assert families == (socket.AF_INET, socket.AF_INET)
    finally:
        if not released:
            os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w, got_r, got_w):
            os.close(fd)


def test_the_master_command_names_a_held_local_socket_in_one_line() -> None:
    import subprocess

    from yuebing.ops.procs import yuebing_argv
    port = free_port("127.0.0.1")
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(local_name("127.0.0.1", port))
    try:
        r = subprocess.run(yuebing_argv(["store", "master", "--rpc-address",
                                         f"tcp://127.0.0.1:{port}"]),
                           capture_output=True, text=True, timeout=60)
    finally:
        squat.close()
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"yuebing: error: cannot start the master on tcp://127.0.0.1:{port}: [Errno 98] the local "
        f"socket of tcp://127.0.0.1:{port} is held by another process (Address already in use); "
        "stop it, or start the master with --no-local-socket"]
